"""The room board (issue 23): the agent writes a room's successful end, with its private aux row,
into a shared-memory table its engine offered, and SGLang's own sender and receiver
(``get_kv_class``) conclude from it in their poll instead of waiting for the room feed's thread.
Real agents on tcp loopback. A board the agent cannot see (outside its shared-memory directory) is
declined with the reason and the rooms end by the feed; with every slot taken, a room reads the
feed; the answer, the bytes, the aux row and SGLang's metric are the same either way."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_core.rankmap import Rank
from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.sglang_engine import AUX, MODEL, SLOT, SPEC, Engine, announce
from tests.e2e.sglang_rooms import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGES = 6


def pair(lc: LocalFabric, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Engine, Engine, Any]:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer

    token_file = tmp_path / "token"
    token_file.write_text(lc.token)
    dec = Engine(lc, Rank.from_id("decode-0-tp0"), monkeypatch, token_file)
    pre = Engine(lc, Rank.from_id("prefill-0-tp0-cp0"), monkeypatch, token_file)
    return pre, dec, PdfabricKVBootstrapServer("127.0.0.1", 0)


@pytest.fixture
def fabric() -> Iterator[LocalFabric]:
    with LocalFabric({**SPEC, "model": MODEL}) as lc:
        yield lc


def move_room(pre: Engine, dec: Engine, server: Any, room: int) -> tuple[Any, Any, list[int]]:
    """One request of PAGES pages, state and aux row, through SGLang's sender and receiver."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    dst = dec.pool.allocate_pages(PAGES)
    tx, rx = announce(pre, dec, server, room, dst)
    src = pre.pool.allocate_pages(PAGES)
    tx.init(PAGES, AUX)
    pre.fill_pages(src, 0)
    pre.fill_state_aux()
    tx.send(np.asarray(src, np.int32), [np.asarray([SLOT], np.int32)])
    states = poll_until([tx, rx], {KVPoll.Success, KVPoll.Failed}, failed_ends=False)
    assert states == [KVPoll.Success, KVPoll.Success], (tx.reason, rx.reason)
    return tx, rx, dst


def test_room_ends_are_read_from_the_board_byte_exact(
    fabric: LocalFabric, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pre, dec, server = pair(fabric, monkeypatch, tmp_path)
    try:
        assert pre.mgr.board is not None and dec.mgr.board is not None, "the agent declined a board in its own shm dir"
        for room in (7001, 7002, 7003):
            tx, rx, dst = move_room(pre, dec, server, room)
            assert dec.landed(dst, 0) and dec.state_aux_landed()  # the aux row came off the board
            # The board's answer is the feed's: the bytes the agent counted, the first byte's time.
            view = dec.mgr.client.poll(dec.mgr.rank_id, rx.room)
            assert rx.bytes_moved == sum(view.moved.values()) > 0
            sent = pre.mgr.client.poll(pre.mgr.rank_id, tx.room)
            assert tx.bytes_moved == sum(sent.moved.values()) and tx.moving_since == sent.first_byte_at
            assert tx.get_transfer_metric().transfer_latency_s is not None
            assert rx.board_slot is None and tx.board_slot is None  # given back once concluded
            # The feed carries the end too, a little later (FEED_AFTER_BOARD_S): what a room whose
            # board entry was overwritten falls back on.
            for mgr, ours in ((dec.mgr, rx.room), (pre.mgr, tx.room)):
                deadline = time.monotonic() + 5
                while (fed := mgr.events.view(ours)) is None or not fed.finished:
                    assert time.monotonic() < deadline, f"the feed never carried room {ours}'s end"
                    time.sleep(0.002)
                assert fed.succeeded
        # Every room ended from the board on both sides: none waited for the feed. The sender handed
        # each room's private aux row over on the board too (aux_on_board), not in the send's body.
        assert (pre.mgr.board.reads, dec.mgr.board.reads) == (3, 3)
        assert pre.mgr.registration.aux_inline and pre.mgr.board.rows_written == 3
        assert len(dec.mgr.board._free) == dec.mgr.board.share.slots  # no slot leaked
    finally:
        server.close()
        pre.close()
        dec.close()


def test_a_board_the_agent_cannot_map_is_declined_and_rooms_end_by_the_feed(
    fabric: LocalFabric, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The engines' board files land outside the agent's shared-memory directory, as in an engine
    # pod whose /dev/shm is its own: the agent says why and the registration stands.
    elsewhere = tmp_path / "engine-shm"
    elsewhere.mkdir()
    monkeypatch.setenv("PDFABRIC_SHM_DIR", str(elsewhere))
    pre, dec, server = pair(fabric, monkeypatch, tmp_path)
    try:
        assert pre.mgr.board is None and dec.mgr.board is None
        answer = dec.mgr.client.register_memory(dec.mgr.registration)
        assert not answer.board and "not in the agent's shared-memory directory" in answer.board_refused
        assert list(elsewhere.iterdir()) == []  # the declined boards' files are gone
        _tx, rx, dst = move_room(pre, dec, server, 7101)
        assert dec.landed(dst, 0) and dec.state_aux_landed()
        assert rx.bytes_moved == sum(dec.mgr.client.poll(dec.mgr.rank_id, rx.room).moved.values()) > 0
        assert dec.state_aux_landed()  # the sender's aux row went in the send's body
        # A send that says its aux row is on a board the agent does not map: refused with the fix,
        # and no room is left behind.
        bad = SendChunk(pre.mgr.rank_id, 7102, [1], [], AUX, 0, engine_memory=True, aux_on_board=True)
        with pytest.raises(AgentRefused) as err:
            pre.mgr.client.submit(bad)
        assert err.value.status == 400 and "send the row in aux_rows" in str(err.value)
        with pytest.raises(AgentRefused) as gone:
            pre.mgr.client.poll(pre.mgr.rank_id, 7102)
        assert gone.value.status == 404
    finally:
        server.close()
        pre.close()
        dec.close()


def test_with_every_slot_taken_a_room_reads_the_feed(
    fabric: LocalFabric, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver

    monkeypatch.setenv("PDFABRIC_ROOM_BOARD_SLOTS", "1")
    pre, dec, server = pair(fabric, monkeypatch, tmp_path)
    try:
        assert dec.mgr.board is not None and dec.mgr.board.share.slots == 1
        holder = PdfabricKVReceiver(dec.mgr, f"127.0.0.1:{server.port}", 7200)  # takes the only slot
        assert holder.board_slot == 0
        _tx, rx, dst = move_room(pre, dec, server, 7201)
        assert rx.board_slot is None and dec.landed(dst, 0) and dec.state_aux_landed()
        assert dec.mgr.board.reads == 0 and pre.mgr.board is not None and pre.mgr.board.reads == 1
        assert pre.mgr.board.rows_written == 1  # the sender's slot is its own: its aux row went on it
        holder.abort()  # concluded: its slot is free for the next room
        _, _rx2, dst2 = move_room(pre, dec, server, 7202)
        assert dec.landed(dst2, 0) and dec.mgr.board.reads == 1
    finally:
        server.close()
        pre.close()
        dec.close()
