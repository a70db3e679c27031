"""Completion marks read from shared memory (no GPU): a board file written here stands in for the
word a kernel's last block stores; the watcher must fire exactly when every word is reached."""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.completion import BOARD_BYTES, BOARD_SLOTS, BoardReader, CompletionMark, CompletionWatcher


class Board:
    """The writing side of a board file, as a sender's kernel updates it."""

    def __init__(self, directory: Path, name: str) -> None:
        path = directory / name
        with open(path, "wb") as fh:
            fh.truncate(BOARD_BYTES)
        fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(fd, BOARD_BYTES)
        os.close(fd)
        self.name = name

    def store(self, slot: int, seq: int) -> None:
        struct.pack_into("<Q", self.mm, 8 * slot, seq)


NAME_A, NAME_B = "pdfabric-board-0123456789ab", "pdfabric-board-ba9876543210"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"board": "../../etc/passwd", "slot": 0, "seq": 1}, "is not pdfabric-board"),
        ({"board": "pdfabric-board-0123456789ab/x", "slot": 0, "seq": 1}, "is not pdfabric-board"),
        ({"board": NAME_A, "slot": BOARD_SLOTS, "seq": 1}, "outside 0..511"),
        ({"board": NAME_A, "slot": -1, "seq": 1}, "outside 0..511"),
        ({"board": NAME_A, "slot": 0, "seq": 0}, "must be positive"),
        ({"board": NAME_A, "slot": True, "seq": 1}, "slot must be an integer"),
        ({"board": NAME_A, "slot": 0, "seq": "1"}, "seq must be an integer"),
        ([NAME_A, 0, 1], "must be an object"),
    ],
)
def test_bad_marks_are_refused_with_what_to_fix(doc: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompletionMark.from_json(doc)


def test_mark_round_trips() -> None:
    m = CompletionMark(NAME_A, 7, 123)
    assert CompletionMark.from_json(m.to_json()) == m


def test_reader_refuses_missing_short_and_linked_boards(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not in"):
        BoardReader(str(tmp_path), NAME_A)
    (tmp_path / NAME_A).write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="smaller than"):
        BoardReader(str(tmp_path), NAME_A)
    other = tmp_path / "elsewhere"
    other.mkdir()
    Board(other, NAME_B)
    (tmp_path / NAME_B).symlink_to(other / NAME_B)
    with pytest.raises(ValueError, match="is not in"):
        BoardReader(str(tmp_path), NAME_B)


def test_reader_sees_the_writers_words(tmp_path: Path) -> None:
    board = Board(tmp_path, NAME_A)
    r = BoardReader(str(tmp_path), NAME_A)
    board.store(5, 2**63 + 9)
    assert r.read(5) == 2**63 + 9 and r.read(4) == 0
    assert r.reached(CompletionMark(NAME_A, 5, 9)) and not r.reached(CompletionMark(NAME_A, 4, 1))
    r.close()


def test_watcher_fires_once_every_mark_is_reached(tmp_path: Path) -> None:
    a, b = Board(tmp_path, NAME_A), Board(tmp_path, NAME_B)
    fired: list[str] = []

    async def go() -> None:
        w = CompletionWatcher(str(tmp_path))
        try:
            w.watch([CompletionMark(NAME_A, 3, 10), CompletionMark(NAME_B, 0, 2)], lambda: fired.append("room"))
            a.store(3, 10)  # one of two
            await asyncio.sleep(0.05)
            assert fired == [] and w.pending == 1
            b.store(0, 1)  # still below
            await asyncio.sleep(0.05)
            assert fired == []
            b.store(0, 2)
            for _ in range(200):
                if fired:
                    break
                await asyncio.sleep(0.005)
            assert fired == ["room"]
            await asyncio.sleep(0.05)
            assert fired == ["room"] and w.pending == 0  # once, then forgotten
        finally:
            w.close()

    asyncio.run(go())


def test_cancelled_watch_never_fires(tmp_path: Path) -> None:
    board = Board(tmp_path, NAME_A)
    fired: list[int] = []
    cancelled = [False]

    async def go() -> None:
        w = CompletionWatcher(str(tmp_path))
        try:
            w.watch([CompletionMark(NAME_A, 1, 1)], lambda: fired.append(1), cancelled=lambda: cancelled[0])
            cancelled[0] = True
            await asyncio.sleep(0.05)
            assert w.pending == 0
            board.store(1, 1)
            await asyncio.sleep(0.05)
            assert fired == []
        finally:
            w.close()

    asyncio.run(go())


def test_watch_of_a_board_that_is_not_there_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        w = CompletionWatcher(str(tmp_path))
        try:
            with pytest.raises(ValueError, match="is not in"):
                w.watch([CompletionMark(NAME_A, 0, 1)], lambda: None)
            with pytest.raises(ValueError, match="nothing to watch"):
                w.watch([], lambda: None)
            assert w.pending == 0
        finally:
            w.close()

    asyncio.run(go())
