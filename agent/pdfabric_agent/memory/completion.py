"""Completion words in shared memory: how a receiving agent learns that a kernel's data landed.

A fast-path sender keeps a *completion board*: BOARD_SLOTS rising u64 sequence numbers in a file
in the agent's shared-memory directory (the directory where pool exports are published, so a
sender that can find its peer's pools and the peer can find the sender's board). The kernel's last
block stores the launch's sequence number into its slot after a system-scope fence, so a reader
that sees the number knows every byte of the launch is in the receiver's memory.

The sender tells the receiving agent (board, slot, seq) right after the launch, while the kernel
still runs; the receiver's `CompletionWatcher` then reads the word itself. No message sits
between the last byte landing and the receiver knowing it. CPU only (no torch, no CUDA): a decode
agent imports this whatever its pools are.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BOARD_SLOTS = 512
BOARD_BYTES = BOARD_SLOTS * 8
BOARD_NAME = re.compile(r"pdfabric-board-[0-9a-f]{12}")  # a file name, never a path
POLL_S = 20e-6  # between reads of pending words; sleeping frees the GIL for the event loop
MAX_READERS = 64  # open boards kept beyond those with pending marks (senders restart, boards change)


@dataclass(frozen=True)
class CompletionMark:
    """Launch `seq` of the sender whose board is `board` is complete once slot `slot` >= seq."""

    board: str
    slot: int
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"board": self.board, "slot": self.slot, "seq": self.seq}

    @classmethod
    def from_json(cls, doc: Any) -> CompletionMark:
        """Checked: a mark names a board file by name only, a slot on it and a positive number."""
        if not isinstance(doc, Mapping):
            raise ValueError("a completion mark must be an object {board, slot, seq}")
        board, slot, seq = doc.get("board"), doc.get("slot"), doc.get("seq")
        if not isinstance(board, str) or not BOARD_NAME.fullmatch(board):
            raise ValueError(f"completion board name {board!r} is not pdfabric-board-<12 hex digits>")
        for name, value in (("slot", slot), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"completion mark {name} must be an integer")
        assert isinstance(slot, int) and isinstance(seq, int)
        if not 0 <= slot < BOARD_SLOTS:
            raise ValueError(f"completion slot {slot} outside 0..{BOARD_SLOTS - 1}")
        if seq < 1:
            raise ValueError(f"completion seq must be positive, got {seq}")
        return cls(board, slot, seq)


class BoardReader:
    """A sender's board, mapped read-only."""

    def __init__(self, directory: str, name: str) -> None:
        if not BOARD_NAME.fullmatch(name):
            raise ValueError(f"completion board name {name!r} is not pdfabric-board-<12 hex digits>")
        self.name = name
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"completion board {name} is not in {directory}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size < BOARD_BYTES:
                raise ValueError(f"completion board {name} is smaller than {BOARD_BYTES} bytes")
            self._mm = mmap.mmap(fd, BOARD_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words = memoryview(self._mm).cast("Q")  # aligned 8-byte reads: never torn

    def read(self, slot: int) -> int:
        return self._words[slot]

    def reached(self, mark: CompletionMark) -> bool:
        return self._words[mark.slot] >= mark.seq

    def close(self) -> None:
        self._words.release()
        self._mm.close()


@dataclass(eq=False)  # identity: two watches of the same marks are two watches
class _Watch:
    marks: tuple[tuple[BoardReader, CompletionMark], ...]
    on_done: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    cancelled: Callable[[], bool]


class CompletionWatcher:
    """One thread per agent reads the words of every pending mark and, once all marks of a watch
    are reached, runs its callback on the event loop. The thread sleeps while nothing is pending."""

    def __init__(self, directory: str, poll_s: float = POLL_S) -> None:
        self.directory = directory
        self.poll_s = poll_s
        self._readers: dict[str, BoardReader] = {}
        self._pending: list[_Watch] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def reader(self, name: str) -> BoardReader:
        with self._cond:
            r = self._readers.get(name)
            if r is not None:
                return r
        r = BoardReader(self.directory, name)  # raises ValueError for a board that is not there
        with self._cond:
            if name in self._readers:
                r.close()
                return self._readers[name]
            if len(self._readers) >= MAX_READERS:
                self._forget_idle()
            self._readers[name] = r
            return r

    def _forget_idle(self) -> None:
        busy = {r.name for w in self._pending for r, _ in w.marks}
        for name in [n for n in self._readers if n not in busy]:
            self._readers.pop(name).close()

    def watch(
        self,
        marks: Sequence[CompletionMark],
        on_done: Callable[[], None],
        *,
        cancelled: Callable[[], bool] = lambda: False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Call `on_done` on `loop` (the running loop by default) once every mark is reached;
        never, if `cancelled()` turns true first. Raises ValueError for a board it cannot open."""
        if not marks:
            raise ValueError("nothing to watch: no completion marks")
        bound = tuple((self.reader(m.board), m) for m in marks)
        w = _Watch(bound, on_done, loop or asyncio.get_running_loop(), cancelled)
        with self._cond:
            if self._closed:
                raise RuntimeError("completion watcher is closed")
            self._pending.append(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdfabric-completion", daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pending = list(self._pending)
            finished = []
            for w in pending:
                if w.cancelled():
                    finished.append(w)
                elif all(r.reached(m) for r, m in w.marks):
                    finished.append(w)
                    with contextlib.suppress(RuntimeError):  # the loop closed under us: agent stopping
                        w.loop.call_soon_threadsafe(w.on_done)
            if finished:
                with self._cond:
                    self._pending = [w for w in self._pending if w not in finished]
            time.sleep(self.poll_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for r in self._readers.values():
            r.close()
        self._readers.clear()
