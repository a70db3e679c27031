"""A real decode agent learning completion from a sender's completion board (no GPU here): the
test writes the board word a fast-path kernel's last block would store, after posting the launch
notice a prefill agent sends while its kernels run. The GPU tests run the same with the kernel."""

from __future__ import annotations

import json
import mmap
import os
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pdfabric_agent.memory.completion import BOARD_BYTES
from pdfabric_agent.protocol.views import RoomState
from pdfabric_devcluster.fabric import LocalFabric
from tests.deadlines import wait_until
from tests.e2e.specs import SMALL

pytestmark = pytest.mark.e2e

D, P = "decode-0-tp0", "prefill-0-tp0-cp0"


class Board:
    """A sender's completion board in the agents' shared-memory directory."""

    def __init__(self, directory: str) -> None:
        self.name = f"pdfabric-board-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, BOARD_BYTES)
        self.mm = mmap.mmap(fd, BOARD_BYTES)
        os.close(fd)

    def store(self, slot: int, seq: int) -> None:
        struct.pack_into("<Q", self.mm, 8 * slot, seq)

    def close(self) -> None:
        self.mm.close()
        os.unlink(self.path)


@pytest.fixture(scope="module")
def fabric() -> Iterator[LocalFabric]:
    with LocalFabric(SMALL) as lc:
        yield lc


@pytest.fixture
def board(fabric: LocalFabric) -> Iterator[Board]:
    b = Board(fabric.shm_dir)
    yield b
    b.close()


# What open_room's room plans from its one source: 2 pages x 2 layers x K/V x 2 heads x 256 B.
KV = 2048


def notice(lc: LocalFabric, room: int, marks: list[dict[str, Any]], kv: int = KV) -> tuple[int, dict[str, Any]]:
    body = {
        "cluster": lc.uid,
        "room": room,
        "decode_rank": D,
        "prefill_rank": P,
        "marks": marks,
        "bytes_by_path": {"nvlink-kernel": {"kv": kv, "state": 0, "aux": 16}},
    }
    return lc.peer_post(lc.agent_of(D), "/v1/peer/launched", json.dumps(body).encode(), as_agent=lc.agent_of(P))


def open_room(lc: LocalFabric, room: int) -> None:
    # Destinations of their own per room: rooms left open (or failed, held) keep theirs claimed.
    n = room % 100
    lc.client(D).receive(D, room, [2 * n, 2 * n + 1], aux_index=n % 7 + 1)
    wait_until(
        lambda: lc.client(D).poll(D, room).state.title == "WaitingForInput", timeout=5, what="room info delivered"
    )


def test_decode_room_completes_when_the_board_word_arrives(fabric: LocalFabric, board: Board) -> None:
    lc = fabric
    open_room(lc, 1001)
    before = lc.metric_sum("pdfabric_transfer_bytes_total", role="decode", path="nvlink-kernel")
    seen = lc.metric_sum("pdfabric_decode_completions_total", how="completion-board")
    code, doc = notice(
        lc, 1001, [{"board": board.name, "slot": 4, "seq": 7}, {"board": board.name, "slot": 4, "seq": 8}]
    )
    assert (code, doc["state"], doc["watching"]) == (200, "Transferring", 2)
    board.store(4, 7)  # the first launch landed, the second not yet
    view = lc.client(D).poll(D, 1001, wait_s=0.3)
    assert view.state is RoomState.TRANSFERRING and view.moved["kv"] == 0
    board.store(4, 8)
    view = lc.client(D).wait(D, 1001, 5)
    assert view.state is RoomState.SUCCESS
    assert view.moved == {"kv": KV, "state": 0, "aux": 16}
    assert view.senders == {P: {"kv": KV, "state": 0, "aux": 16}}
    after = lc.metric_sum("pdfabric_transfer_bytes_total", role="decode", path="nvlink-kernel")
    assert after - before == KV + 16
    assert lc.metric_sum("pdfabric_decode_completions_total", how="completion-board") == seen + 1
    # A done report of the same source afterwards changes nothing (no bytes counted twice).
    body = {"cluster": lc.uid, "room": 1001, "decode_rank": D, "prefill_rank": P, "ok": True,
            "bytes_by_path": {"nvlink-kernel": {"kv": KV, "state": 0, "aux": 16}}}  # fmt: skip
    code, doc = lc.peer_post(lc.agent_of(D), "/v1/peer/done", json.dumps(body).encode(), as_agent=lc.agent_of(P))
    assert (code, doc["state"]) == (200, "Success")
    assert lc.metric_sum("pdfabric_transfer_bytes_total", role="decode", path="nvlink-kernel") == after


def test_failure_report_after_the_notice_fails_the_room_and_the_word_changes_nothing(
    fabric: LocalFabric, board: Board
) -> None:
    lc = fabric
    open_room(lc, 1002)
    assert notice(lc, 1002, [{"board": board.name, "slot": 9, "seq": 1}])[0] == 200
    body = {"cluster": lc.uid, "room": 1002, "decode_rank": D, "prefill_rank": P, "ok": False,
            "reason": "kernel timed out"}  # fmt: skip
    lc.peer_post(lc.agent_of(D), "/v1/peer/done", json.dumps(body).encode(), as_agent=lc.agent_of(P))
    view = lc.client(D).wait(D, 1002, 5)
    assert view.state is RoomState.FAILED and "kernel timed out" in view.reason
    board.store(9, 1)
    assert lc.client(D).poll(D, 1002, wait_s=0.2).state.title == "Failed"


BAD_MARKS = [
    ("path-in-name", [{"board": "../../etc/shadow", "slot": 0, "seq": 1}], "is not pdfabric-board"),
    ("no-such-board", [{"board": "pdfabric-board-000000000000", "slot": 0, "seq": 1}], "is not in"),
    ("slot-out-of-range", [{"board": "BOARD", "slot": 512, "seq": 1}], "outside 0..511"),
    ("no-marks", [], "non-empty list"),
]


@pytest.mark.parametrize(("case", "marks", "message"), BAD_MARKS, ids=[c[0] for c in BAD_MARKS])
def test_bad_notice_is_refused_and_the_room_waits_on(
    fabric: LocalFabric, board: Board, case: str, marks: list[dict[str, Any]], message: str
) -> None:
    lc = fabric
    room = 1010 + [c[0] for c in BAD_MARKS].index(case)
    open_room(lc, room)
    marks = [{**m, "board": board.name} if m["board"] == "BOARD" else m for m in marks]
    code, doc = notice(lc, room, marks)
    assert (code, doc["reason"]) == (400, "malformed") and message in doc["error"], doc
    assert lc.client(D).poll(D, room).state.title == "WaitingForInput"


def test_notice_for_an_unknown_room_is_refused(fabric: LocalFabric, board: Board) -> None:
    code, doc = notice(fabric, 1099, [{"board": board.name, "slot": 0, "seq": 1}])
    assert (code, doc["reason"]) == (404, "unknown_room")
