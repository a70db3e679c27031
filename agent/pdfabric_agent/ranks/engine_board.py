"""Mapping an engine's room board (``protocol/board.py``) into the agent: the file must be a regular
file in the agent's shared-memory directory, of the size its slots need, and hold the nonce the
engine registered, or the board is declined with the reason (the registration still stands: the
engine's polls then read the room feed, as without a board). ``open_engine_file`` is the one check
of an engine's shared-memory file, for the board and for the engine's CPU buffers alike."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Sequence

from pdfabric_agent.protocol.board import ORDERED_STORES, BoardShare, RoomBoard, board_bytes
from pdfabric_agent.protocol.errors import ApiError, layout_mismatch, out_of_range
from pdfabric_agent.protocol.views import RoomView


def open_engine_file(path: str, shm_dir: str) -> tuple[int, os.stat_result]:
    """An open descriptor of the engine's file ``path`` and its stat; refuses (422) a file outside
    the agent's shared-memory directory, one that cannot be opened, or anything but a non-empty
    regular file. The caller closes the descriptor."""
    try:
        # A link swapped while realpath walks it makes readlink fail (EINVAL on what is no longer
        # a link, ELOOP, ENOENT): the engine's file is then not one the agent can check.
        real = os.path.realpath(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise layout_mismatch(f"cannot resolve {path}: {exc}") from None
    if os.path.dirname(real) != os.path.realpath(shm_dir):
        raise layout_mismatch(
            f"{path} is not in the agent's shared-memory directory {shm_dir}: "
            "allocate engine files there (PDFABRIC_SHM_DIR) so the agent may map them"
        )
    try:
        # O_NOFOLLOW: a symlink swapped in after realpath is refused, never followed outside.
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise layout_mismatch(f"cannot open {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        os.close(fd)
        raise layout_mismatch(f"{path} is not a non-empty regular file")
    return fd, st


def open_board(share: BoardShare, aux_row_bytes: Sequence[int], shm_dir: str) -> tuple[RoomBoard | None, str]:
    """The mapped board, or None and why it is declined."""
    if not ORDERED_STORES:
        return None, "the room board needs x86-64 store ordering; this agent's machine reads the feed"
    size = board_bytes(share.slots, aux_row_bytes)
    try:
        fd, st = open_engine_file(share.path, shm_dir)
    except ApiError as exc:
        return None, exc.message
    try:
        if st.st_size != size:
            return None, f"{share.path} is not a regular file of {size} bytes"
        memory = mmap.mmap(fd, size)
    except (OSError, ValueError) as exc:
        return None, f"cannot map {share.path}: {exc}"
    finally:
        os.close(fd)
    why = RoomBoard.header_matches(memory, share, aux_row_bytes)
    if why is not None:
        memory.close()
        return None, f"{share.path}: {why}"
    return RoomBoard(memory, share.slots, aux_row_bytes), ""


# A Success written onto the board goes out on the room feed this much later: the engine's next poll
# reads it from the board, and its feed thread, woken at once, would take the engine's GIL from
# the scheduler just when that poll comes. The feed still carries it (a board entry overwritten by
# a late end of a reused slot's earlier room costs that room this long).
FEED_AFTER_BOARD_S = 0.01


def write_end(board: RoomBoard | None, slot: int | None, view: RoomView) -> bool:
    """A room's successful end onto its engine's board; False (nothing written) for any other end,
    or without a board: the feed carries those."""
    if board is None or slot is None or not view.succeeded or slot >= board.slots:
        return False
    board.write_success(slot, view.room, sum(view.moved.values()), view.first_byte_at, view.aux_rows)
    return True


def check_slot(board: RoomBoard | None, slot: int | None) -> None:
    """Refuse (4xx) a submit's board slot outside the engine's board; a slot for a rank whose board
    was declined is ignored (its engine reads the feed)."""
    if board is not None and slot is not None and slot >= board.slots:
        raise out_of_range(f"board_slot {slot} outside the engine's board of {board.slots} slots")
