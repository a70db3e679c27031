"""The room board's layout and its two sides (protocol/board.py, ranks/engine_board.py,
pdfabric_sglang/board.py): a slot reads back what the agent wrote for its room and nothing for any
other room or while being written; a reader in another process never accepts a torn slot; the
agent maps a board only when the file is the engine's (nonce, size, directory) and refuses a
submit's slot outside it."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import struct
from pathlib import Path

import pytest

from pdfabric_agent.protocol.board import (
    HEADER_BYTES,
    ORDERED_STORES,
    BoardShare,
    RoomBoard,
    board_bytes,
    slot_bytes,
)
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.views import MemoryAnswer, RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_agent.ranks.engine_board import check_slot, open_board, write_end

ROWS = [40, 8, 100]  # private aux row item sizes
NONCE = bytes(range(16))


def board(slots: int = 4, rows: list[int] = ROWS) -> RoomBoard:
    return RoomBoard.format(bytearray(board_bytes(slots, rows)), slots, rows, NONCE)


def aux(room: int) -> tuple[bytes, ...]:
    return tuple(bytes([(room + i) % 251]) * n for i, n in enumerate(ROWS))


def test_slot_size_is_the_header_and_the_aux_row_rounded_to_64() -> None:
    assert slot_bytes([]) == 64
    assert slot_bytes(ROWS) == 64 + 192  # 148 bytes of rows -> 192
    assert board_bytes(3, ROWS) == HEADER_BYTES + 3 * 256


def test_a_slot_reads_its_rooms_end_and_nothing_else() -> None:
    b = board()
    assert b.read_success(1, 5) is None  # never written
    b.write_success(1, 5, 1234, 17.5, aux(5))
    end = b.read_success(1, 5)
    assert end is not None and (end.moved, end.first_byte_at, end.aux_rows) == (1234, 17.5, aux(5))
    assert b.read_success(1, 6) is None  # another room in the same slot
    assert b.read_success(0, 5) is None and b.read_success(2, 5) is None
    b.write_success(1, 6, 9, None, None)  # the slot's next room, no aux row, no first byte
    got = b.read_success(1, 6)
    assert got is not None and (got.moved, got.first_byte_at, got.aux_rows) == (9, None, None)
    assert b.read_success(1, 5) is None


def test_a_slot_being_written_reads_nothing() -> None:
    b = board()
    b.write_success(2, 77, 1, 1.0, aux(77))
    at = HEADER_BYTES + 2 * b.slot_bytes
    seq = struct.unpack_from("<Q", b.memory, at)[0]
    assert seq % 2 == 0
    struct.pack_into("<Q", b.memory, at, seq + 1)  # the agent is mid-write
    assert b.read_success(2, 77) is None
    struct.pack_into("<Q", b.memory, at, seq + 2)
    assert b.read_success(2, 77) is not None


def test_wrong_rows_and_slots_outside_the_board_are_refused() -> None:
    b = board()
    with pytest.raises(ValueError, match="aux rows"):
        b.write_success(0, 1, 1, None, (b"x",))
    with pytest.raises(IndexError):
        b.write_success(4, 1, 1, None, None)
    with pytest.raises(IndexError):
        b.read_success(-1, 1)
    with pytest.raises(ValueError, match="needs"):
        RoomBoard(bytearray(10), 4, ROWS)


def _map(path: str | Path, slots: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, board_bytes(slots, ROWS))
    finally:
        os.close(fd)


def _writer(path: str, slots: int, rounds: int) -> None:
    b = RoomBoard(_map(path, slots), slots, ROWS)
    for i in range(rounds):
        room = 1 + i % 2  # two rooms alternate in slot 0, each with its own row and byte count
        b.write_success(0, room, room * 1000, float(room), aux(room))


def _board_and_writer(tmp_path: Path, rounds: int) -> tuple[RoomBoard, multiprocessing.process.BaseProcess]:
    """A one-slot board file mapped here, and a started process writing ``rounds`` ends into it."""
    path = tmp_path / "board"
    path.write_bytes(bytes(board_bytes(1, ROWS)))
    b = RoomBoard.format(_map(path, 1), 1, ROWS, NONCE)
    writer = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(path), 1, rounds))
    writer.start()
    return b, writer


@pytest.mark.skipif(not ORDERED_STORES, reason="the board is used on x86-64 only")
def test_a_reader_in_another_process_never_sees_seq_go_back(tmp_path: Path) -> None:
    # seq as struct's "<Q" is stored and loaded a byte at a time: a reader saw values torn between
    # two writes (700-900 reads in 300,000 here), which is how CI once accepted a slot rewritten
    # under its reader. Every read of the word must be a value the writer stored, so never lower.
    b, writer = _board_and_writer(tmp_path, 100_000)
    last, reads, back = 0, 0, []
    while writer.is_alive() or reads == 0:
        seq = b.sequence(0)
        if seq < last:
            back.append((last, seq))
        last, reads = seq, reads + 1
    writer.join()
    assert writer.exitcode == 0 and b.sequence(0) == 2 * 100_000
    assert back == [], f"{len(back)} of {reads} reads went back, e.g. {back[:3]}"


@pytest.mark.skipif(not ORDERED_STORES, reason="the board is used on x86-64 only")
def test_a_reader_in_another_process_never_accepts_a_torn_slot(tmp_path: Path) -> None:
    b, writer = _board_and_writer(tmp_path, 200_000)
    seen = {1: 0, 2: 0}
    while writer.is_alive() or sum(seen.values()) == 0:
        for room in (1, 2):
            end = b.read_success(0, room)
            if end is not None:
                assert (end.moved, end.first_byte_at, end.aux_rows) == (room * 1000, float(room), aux(room))
                seen[room] += 1
    writer.join()
    assert writer.exitcode == 0 and seen[1] > 0 and seen[2] > 0


def _file(tmp_path: Path, slots: int, nonce: bytes = NONCE, size: int | None = None) -> Path:
    path = tmp_path / "shm" / "pdfabric-board"
    path.parent.mkdir(exist_ok=True)
    data = bytearray(board_bytes(slots, ROWS) if size is None else size)
    if size is None:
        RoomBoard.format(data, slots, ROWS, nonce)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.skipif(not ORDERED_STORES, reason="the board is used on x86-64 only")
def test_the_agent_maps_only_the_engines_board(tmp_path: Path) -> None:
    share = BoardShare(str(_file(tmp_path, 4)), 4, NONCE.hex())
    shm = str(tmp_path / "shm")
    mapped, why = open_board(share, ROWS, shm)
    assert mapped is not None and why == ""
    mapped.write_success(3, 11, 5, None, aux(11))
    mapped.release()
    # Another file at that path (the engine's /dev/shm is not the agent's): its nonce differs.
    other = BoardShare(str(_file(tmp_path, 4, nonce=b"\x01" * 16)), 4, NONCE.hex())
    assert open_board(other, ROWS, shm)[0] is None and "not the engine's" in open_board(other, ROWS, shm)[1]
    # The engine's file, described with other aux rows than the registration's: its size says so.
    assert "regular file of 576 bytes" in open_board(BoardShare(str(_file(tmp_path, 4)), 4, NONCE.hex()), [8], shm)[1]
    assert "regular file of" in open_board(BoardShare(str(_file(tmp_path, 4, size=100)), 4, NONCE.hex()), ROWS, shm)[1]
    assert "shared-memory directory" in open_board(share, ROWS, str(tmp_path))[1]
    gone = BoardShare(str(tmp_path / "shm" / "missing"), 4, NONCE.hex())
    assert "cannot open" in open_board(gone, ROWS, shm)[1]


def test_the_agent_writes_successful_ends_only_and_refuses_slots_outside() -> None:
    b = board()
    ok = RoomView(rank="decode-0-tp0", room=9, state=RoomState.SUCCESS, moved={"kv": 10, "aux": 2}, aux_rows=aux(9))
    write_end(b, 1, RoomView(rank="decode-0-tp0", room=9, state=RoomState.FAILED, reason="x"))
    assert b.read_success(1, 9) is None
    write_end(b, None, ok)
    write_end(None, 1, ok)
    assert b.read_success(1, 9) is None
    write_end(b, 1, ok)
    end = b.read_success(1, 9)
    assert end is not None and end.moved == 12 and end.aux_rows == aux(9) and end.first_byte_at is None
    check_slot(b, 3)
    check_slot(None, 99)  # a declined board: the slot is ignored
    with pytest.raises(ApiError) as err:
        check_slot(b, 4)
    assert 400 <= err.value.status < 500 and "outside the engine's board of 4 slots" in str(err.value)


def test_the_wire_carries_the_board_and_its_slots() -> None:
    msg = SendRequest("prefill-0-tp0-cp0", 5, [1, 2], [], None, 0, board_slot=7)
    assert SendRequest.parse(msg.to_json()).board_slot == 7
    assert SendRequest.parse(SendRequest("prefill-0-tp0-cp0", 5, [1], [], None, 0).to_json()).board_slot is None
    rx = ReceiveRequest("decode-0-tp0", 5, [1], [], None, 0, board_slot=0)
    assert ReceiveRequest.parse(rx.to_json()).board_slot == 0
    with pytest.raises(ApiError):
        ReceiveRequest.parse({**rx.to_json(), "board_slot": -1})
    with pytest.raises(ApiError):
        ReceiveRequest.parse({**rx.to_json(), "board_slot": 1 << 16})
    share = BoardShare("/dev/shm/x", 8, NONCE.hex())
    assert BoardShare.parse(share.to_json()) == share and BoardShare.parse(None) is None
    for bad in ({**share.to_json(), "path": "x"}, {**share.to_json(), "nonce": "zz"}, {**share.to_json(), "slots": 0}):
        with pytest.raises(ApiError):
            BoardShare.parse(bad)


def test_the_memory_answer_says_whether_the_board_is_mapped() -> None:
    from pdfabric_agent.memory.pools import PoolLayout

    layout = PoolLayout(2, 2, 64, 64, 1, 64, 8, (8, 8), 8)
    for board_on, refused in ((True, ""), (False, "not shared"), (False, "")):
        answer = MemoryAnswer("decode-0-tp0", layout, 3, ("cpu",), board_on, refused)
        assert MemoryAnswer.parse(answer.to_json()) == answer
    with pytest.raises(ValueError):
        doc = MemoryAnswer("decode-0-tp0", layout, 3, ("cpu",)).to_json()
        doc["memory"]["board"] = "yes"
        MemoryAnswer.parse(doc)


def test_a_senders_aux_row_goes_through_its_slot_and_leaves_the_end_alone() -> None:
    b = board()
    b.write_rows(2, aux(5))
    assert b.read_rows(2) == aux(5)
    assert b.read_success(2, 5) is None  # rows alone are no end
    assert b.read_rows(1) == tuple(bytes(n) for n in ROWS)  # other slots untouched
    with pytest.raises(ValueError, match="aux rows of"):
        b.write_rows(2, aux(5)[:2])
    write_end(b, 2, RoomView(rank="prefill-0-tp0-cp0", room=5, state=RoomState.SUCCESS, moved={"kv": 4}))
    end = b.read_success(2, 5)
    assert end is not None and end.moved == 4 and end.aux_rows is None


def test_the_wire_says_when_the_aux_row_is_on_the_board() -> None:
    from pdfabric_agent.protocol.chunks import SendChunk

    msg = SendChunk("prefill-0-tp0-cp0", 5, [1], [], 3, 0, aux_on_board=True, page_offset=1, final=True)
    doc = msg.to_json()
    assert doc["aux_on_board"] is True and "aux_rows" not in doc
    assert SendChunk.parse(doc).aux_on_board
    assert not SendChunk.parse(SendChunk("prefill-0-tp0-cp0", 5, [1], [], 3, 0).to_json()).aux_on_board
    for bad, why in (
        ({**doc, "aux_rows": ["AAAA"]}, "one way"),
        ({**doc, "aux_index": None}, "without aux_index"),
        ({**doc, "final": False}, "final chunk"),
        ({**doc, "aux_on_board": "yes"}, "aux_on_board"),
    ):
        with pytest.raises(ApiError, match=why):
            SendChunk.parse({k: v for k, v in bad.items() if v is not None})
