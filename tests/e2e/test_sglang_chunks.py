"""A chunked prefill streams (issue 23): SGLang's own sender and receiver (``get_kv_class``) with
real agents on tcp loopback, the sender handed a request's pages in 4 chunks as SGLang's chunked
prefill hands them. The first chunk's bytes land at decode while the later chunks are still being
produced (the producer is held until they are seen there), the room ends byte-exact, and the trace
(each chunk's hand-over against the agent's first byte and decode's sight of chunk 1) is printed.
An abort between chunks fails the room on both sides with its reason, releases decode's claim on
its pages (a new room takes them), and leaves decode memory outside the moved chunk untouched. A
chunk out of order or out of range is refused 4xx with the reason, and fails its room."""

from __future__ import annotations

import threading
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
from tests.e2e.sglang_engine import (
    AUX,
    CHUNKS,
    DST_AUX,
    DST_SLOT,
    MODEL,
    PAGES,
    PER_CHUNK,
    ROOM,
    SLOT,
    SPEC,
    TOKENS,
    Engine,
    announce,
    until,
)
from tests.e2e.sglang_rooms import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def pd(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalFabric, Engine, Engine, Any]]:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer

    # (verify, backend): spec.transfer.verify (True: both sides checksum the whole room, however it
    # was chunked), and the library the agents move the bytes with.
    verify, backend = getattr(request, "param", (False, "mooncake"))
    transfer = {**SPEC["transfer"], "verify": verify}
    with LocalFabric({**SPEC, "backend": backend, "transfer": transfer, "model": MODEL}) as lc:
        token_file = tmp_path / "token"
        token_file.write_text(lc.token)
        dec = Engine(lc, Rank.from_id("decode-0-tp0"), monkeypatch, token_file)
        pre = Engine(lc, Rank.from_id("prefill-0-tp0-cp0"), monkeypatch, token_file)
        server = PdfabricKVBootstrapServer("127.0.0.1", 0)
        try:
            yield lc, pre, dec, server
        finally:
            server.close()
            pre.close()
            dec.close()


@pytest.mark.parametrize(
    "pd", [(False, "mooncake"), (True, "mooncake"), (False, "nixl")], ids=["plain", "verify", "nixl"], indirect=True
)
def test_a_four_chunk_request_moves_its_first_chunk_while_the_rest_are_produced(
    pd: tuple[LocalFabric, Engine, Engine, Any],
) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    _, pre, dec, server = pd
    dst = dec.pool.allocate_pages(PAGES)[::-1]
    tx, rx = announce(pre, dec, server, ROOM, dst)
    src = pre.pool.allocate_pages(PAGES)
    tx.init(PAGES, AUX)
    seen: list[float | None] = []
    for c in range(CHUNKS):
        part = src[c * PER_CHUNK : (c + 1) * PER_CHUNK]
        pre.fill_pages(part, c * PER_CHUNK)  # this chunk's forward
        last = c == CHUNKS - 1
        if last:
            pre.fill_state_aux()  # SGLang's set_buf, before the last chunk
        tx.send(np.asarray(part, np.int32), [np.asarray([SLOT], np.int32)] if last else None)
        if c == 0:
            # The producer is held until chunk 1's bytes are at decode: a sender that keeps the
            # chunks until the last one never gets past this.
            seen.append(until(lambda: dec.landed(dst[:PER_CHUNK], 0)))
            assert seen[0] is not None, "chunk 1 did not land at decode before chunk 2 was produced"
            assert not dec.landed(dst[PER_CHUNK : 2 * PER_CHUNK], PER_CHUNK)  # the next chunk is not produced yet
            assert not dec.state_aux_landed()  # state and aux go with the final chunk
        else:
            time.sleep(0.05)  # the next chunk's forward
    states = poll_until([tx, rx], {KVPoll.Success, KVPoll.Failed}, failed_ends=False)
    assert states == [KVPoll.Success, KVPoll.Success], (tx.reason, rx.reason)
    assert dec.landed(dst, 0) and dec.state_aux_landed()

    view = pre.mgr.client.poll(pre.mgr.rank_id, tx.room)
    assert view.submitted_at is not None
    first_byte = view.submitted_at + view.phases_s["first-byte"]
    handed = tx.handed_at
    assert len(handed) == CHUNKS
    assert seen[0] is not None
    # The first byte moved after chunk 1 was handed over, and well before the last chunk was.
    assert handed[0] <= first_byte < handed[-1] - 0.1
    assert seen[0] < handed[1] < handed[-1]
    # SGLang's metric runs from the first byte moved, not from the first chunk handed over.
    metric = tx.get_transfer_metric()
    assert tx.moving_since == pytest.approx(first_byte, abs=1e-5) and tx.finished_at is not None
    assert metric.transfer_latency_s == pytest.approx(tx.finished_at - first_byte, abs=1e-6)
    trace = ", ".join(f"chunk {i + 1} handed +{(t - handed[0]) * 1e3:.1f} ms" for i, t in enumerate(handed))
    print(
        f"\ntrace: {trace}; agent's first byte +{(first_byte - handed[0]) * 1e3:.1f} ms; chunk 1 seen at decode "
        f"+{(seen[0] - handed[0]) * 1e3:.1f} ms; sender Success seen +{(tx.finished_at - handed[0]) * 1e3:.1f} ms; "
        f"transfer_latency_s {metric.transfer_latency_s:.4f}"
    )


def test_an_abort_between_chunks_fails_both_sides_and_releases_decode(
    pd: tuple[LocalFabric, Engine, Engine, Any],
) -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll

    _, pre, dec, server = pd
    dst = dec.pool.allocate_pages(PAGES)
    before = dec.snapshot()
    tx, rx = announce(pre, dec, server, ROOM, dst)
    src = pre.pool.allocate_pages(PAGES)
    tx.init(PAGES, AUX)
    pre.fill_pages(src[:PER_CHUNK], 0)
    pre.fill_state_aux()
    tx.send(np.asarray(src[:PER_CHUNK], np.int32))
    assert until(lambda: dec.landed(dst[:PER_CHUNK], 0)) is not None
    tx.abort()  # SGLang aborts the request between chunks
    assert poll_until([tx, rx], {KVPoll.Failed}, failed_ends=False) == [KVPoll.Failed, KVPoll.Failed]
    assert "aborted" in tx.reason and rx.reason, (tx.reason, rx.reason)
    assert pre.mgr.calls.wait_idle(5.0)
    decode_view = dec.mgr.client.poll(dec.mgr.rank_id, rx.room)
    assert decode_view.state.title == "Failed" and decode_view.sources_quiet, decode_view
    prefill_view = pre.mgr.client.poll(pre.mgr.rank_id, tx.room)
    assert prefill_view.state.title == "Failed" and "aborted" in prefill_view.reason
    # Later chunks of the aborted request change nothing, and move nothing.
    pre.fill_pages(src[PER_CHUNK:], PER_CHUNK)
    tx.send(np.asarray(src[PER_CHUNK:], np.int32), [np.asarray([SLOT], np.int32)])
    time.sleep(0.3)
    # Decode memory outside the moved chunk is as it was: no page, state slot or aux row written.
    after = dec.snapshot()
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert changed == list(range(len(dec.rows()))), "only KV buffers may have changed (chunk 1's pages)"
    moved_rows = {p * TOKENS + t for p in dst[:PER_CHUNK] for t in range(TOKENS)}
    for i in changed:
        a = np.frombuffer(before[i], np.uint8).reshape(dec.rows()[i].shape)
        b = np.frombuffer(after[i], np.uint8).reshape(dec.rows()[i].shape)
        rows = {int(r) for r in np.nonzero((a != b).reshape(a.shape[0], -1).any(axis=1))[0]}
        assert rows <= moved_rows
    # Decode's claim on the pages is released: a new room takes the very same pages.
    rx2 = PdfabricKVReceiver(dec.mgr, f"127.0.0.1:{server.port}", ROOM + 1)
    rx2.init(0)
    rx2.send_metadata(np.asarray(dst, np.int32), DST_AUX, [np.asarray([DST_SLOT], np.int32)])
    assert dec.mgr.calls.wait_idle(5.0)
    assert int(rx2.poll()) != KVPoll.Failed, rx2.reason
    assert dec.mgr.client.poll(dec.mgr.rank_id, rx2.room).state.title in ("Bootstrapping", "WaitingForInput")
    rx2.abort()


def test_a_chunk_out_of_order_or_out_of_range_is_refused_and_fails_its_room(
    pd: tuple[LocalFabric, Engine, Engine, Any],
) -> None:
    _, pre, dec, server = pd
    client, rank = pre.mgr.client, pre.mgr.rank_id
    src = pre.pool.allocate_pages(PAGES)
    for room, offset, pages, final, status, words in [
        (ROOM + 10, PER_CHUNK + 1, src[PER_CHUNK:], False, 409, "send page_offset 3"),  # a gap
        (ROOM + 11, PER_CHUNK, src[PER_CHUNK:], False, 400, "no chunk may reach past them"),  # past decode's 6 pages
        (ROOM + 12, PER_CHUNK, src[PER_CHUNK : PER_CHUNK + 1], True, 400, "the final one must end there"),
    ]:
        dst = dec.pool.allocate_pages(2 * PER_CHUNK)
        # Each room its own decode state slot and aux row: a failed room's destinations stay claimed
        # until its source says it stopped writing (the agent refuses a room onto them till then).
        n = room - ROOM - 10
        tx, rx = announce(pre, dec, server, room, dst, slot=(0, 1, 3)[n], aux=4 + n)
        opened = client.submit(SendChunk(rank, tx.room, src[:PER_CHUNK], [], None, 0, engine_memory=True, final=False))
        assert opened.state.title == "Transferring"
        with pytest.raises(AgentRefused) as refused:
            client.submit(
                SendChunk(rank, tx.room, pages, [SLOT] if final else [], None, 0, engine_memory=True,
                          page_offset=offset, final=final)
            )  # fmt: skip
        assert (refused.value.status, words in str(refused.value)) == (status, True), refused.value
        view = client.poll(rank, tx.room)
        assert view.state.title == "Failed" and "chunk refused" in view.reason, view
        from sglang.srt.disaggregation.base.conn import KVPoll

        assert poll_until([rx], {KVPoll.Failed}, failed_ends=False) == [KVPoll.Failed], rx.reason
        tx.clear()


class ForwardDone:
    """What SGLang's early cached-prefix send sets on the sender under overlap scheduling (a CUDA
    event recorded on the forward stream, ``_early_send_wait_event``): ``synchronize`` returns once
    the forward that writes the prefix pages is done. CPU has no such event; this one is released
    by the test when it has written the pages."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.done.wait(20.0)


def test_an_early_cached_prefix_send_moves_nothing_before_its_forward_is_done(
    pd: tuple[LocalFabric, Engine, Engine, Any],
) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    _, pre, dec, server = pd
    dst = dec.pool.allocate_pages(2 * PER_CHUNK)
    tx, rx = announce(pre, dec, server, ROOM, dst)
    src = pre.pool.allocate_pages(2 * PER_CHUNK)
    tx.init(2 * PER_CHUNK, AUX)
    forward = ForwardDone()
    tx._early_send_wait_event = forward  # as SGLang's maybe_send_cached_prefix_chunk sets it
    handed = time.monotonic()
    tx.send(np.asarray(src[:PER_CHUNK], np.int32))  # the radix-cache hit, before the forward
    assert time.monotonic() - handed < 0.1  # the scheduler thread does not wait for the forward
    assert forward.waited.wait(5.0)  # the manager's worker does
    time.sleep(0.3)
    assert not dec.landed(dst[:PER_CHUNK], 0)
    # The agent has not seen the chunk: the room is still decode's announcement, not opened.
    view = pre.mgr.client.poll(pre.mgr.rank_id, tx.room)
    assert view.state.title == "WaitingForInput" and view.submitted_at is None, view
    pre.fill_pages(src[:PER_CHUNK], 0)  # the forward writes the prefix pages, and is done
    released = time.monotonic()
    forward.done.set()
    assert until(lambda: dec.landed(dst[:PER_CHUNK], 0)) is not None
    pre.fill_pages(src[PER_CHUNK:], PER_CHUNK)
    pre.fill_state_aux()
    tx.send(np.asarray(src[PER_CHUNK:], np.int32), [np.asarray([SLOT], np.int32)])
    assert poll_until([tx, rx], {KVPoll.Success, KVPoll.Failed}, failed_ends=False) == [
        KVPoll.Success,
        KVPoll.Success,
    ], tx.reason
    assert dec.landed(dst, 0) and dec.state_aux_landed()
    # The transfer latency SGLang reports starts at the first byte, after the forward was done.
    assert tx.moving_since is not None and tx.moving_since >= released
