"""The engine's side of its rank's room board (``pdfabric_agent.protocol.board``): a shared-memory
file in ``PDFABRIC_SHM_DIR`` the node agent writes successful room ends into, so a sender's or
receiver's poll reads its room's end on the scheduler thread, in the loop SGLang already runs,
instead of waiting for the room feed's thread to be woken. The manager offers it with its memory
registration and uses it only when the agent's answer says it mapped it.

Each room takes a slot when its sender or receiver is made and gives it back when the poll has
concluded it; with every slot taken (more rooms in flight than ``PDFABRIC_ROOM_BOARD_SLOTS``) a
room simply reads the feed. ``PDFABRIC_ROOM_BOARD_SLOTS=0`` offers no board."""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Callable, Sequence

from pdfabric_agent.client.shm import remove_orphans, shared_file, shm_dir
from pdfabric_agent.protocol.board import ORDERED_STORES, BoardEnd, BoardShare, RoomBoard, board_bytes

log = logging.getLogger("pdfabric.sglang")

ENV_SLOTS = "PDFABRIC_ROOM_BOARD_SLOTS"
DEFAULT_SLOTS = 4096  # rooms in flight on one rank before new ones fall back to the feed


class EngineBoard:
    """A board this engine created: its share for the registration, and the free slots."""

    def __init__(self, board: RoomBoard, share: BoardShare) -> None:
        self.board, self.share = board, share
        self._free = collections.deque(range(share.slots))
        self.reads = 0  # rooms concluded from the board (tests and benchmarks read it)
        self.rows_written = 0  # aux rows senders handed over on the board, not in the send's body

    @classmethod
    def create(cls, aux_row_bytes: Sequence[int], slots: int | None = None) -> EngineBoard | None:
        """A fresh board, or None where none is offered (disabled, or a machine whose store order
        the board's seqlock cannot rely on)."""
        if slots is None:
            slots = int(os.environ.get(ENV_SLOTS, DEFAULT_SLOTS))
        if slots <= 0 or not ORDERED_STORES:
            return None
        directory = shm_dir()
        remove_orphans(directory)
        try:
            path = shared_file(board_bytes(slots, aux_row_bytes), directory)
            fd = os.open(path, os.O_RDWR)
            try:
                memory = mmap.mmap(fd, board_bytes(slots, aux_row_bytes))
            finally:
                os.close(fd)
        except OSError as exc:
            log.info("pdfabric: no room board in %s (%s): room ends come by the feed", directory, exc)
            return None
        nonce = secrets.token_bytes(16)
        board = RoomBoard.format(memory, slots, aux_row_bytes, nonce)
        return cls(board, BoardShare(path, slots, nonce.hex()))

    def take(self) -> int | None:
        """A free slot for a new room (None: all taken, the room reads the feed)."""
        return self._free.popleft() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def write_rows(self, slot: int, rows: Sequence[bytes]) -> None:
        """A sender's private aux row into its room's slot, for the agent to read (``aux_on_board``)."""
        self.board.write_rows(slot, rows)
        self.rows_written += 1

    def reader(self, slot: int, room: int) -> Callable[[], BoardEnd | None]:
        """What a room's poll calls: its end from ``slot``, or None."""
        return self.board.reader(slot, room)

    def close(self) -> None:
        self.board.release()
        with contextlib.suppress(OSError):
            os.unlink(self.share.path)
