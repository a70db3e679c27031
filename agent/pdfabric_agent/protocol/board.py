"""A rank's room board: a shared-memory table in which the node agent writes each room's successful
end, so the engine's poll reads it in the loop it already runs instead of waiting for the room feed
to wake a thread of its process (about 0.8 ms a room on two cores, issue 23).

The engine creates the file in ``PDFABRIC_SHM_DIR`` and names it in its memory registration
(``BoardShare``); the agent maps it only after reading back the engine's random ``nonce`` from the
file's header, which proves both see the same memory (an engine pod with a ``/dev/shm`` of its own
gets ``board: false`` in the answer and keeps the feed). The engine owns the slots: a room's submit
names its ``board_slot``, freed once the engine has concluded the room.

A slot is a 64-byte header (``seq``, room, bytes moved, when its first byte moved, row count) and
the room's private aux rows (SGLang's CPU metadata row, which travels with the view). The agent is
the one writer; ``seq`` is odd while it writes (a seqlock), so a reader that sees it odd or changed
reads nothing. ``seq`` and the room are loaded and stored as whole aligned 8-byte words (a ``Q``
view of the memory): ``struct`` zeroes what it packs into and moves a little-endian ``Q`` a byte at
a time, so a reader saw torn values and once (in CI) accepted a slot rewritten under it.

Only Success is written: a failure, its reason and everything else still reach the engine by the
feed, which also carries every Success, so a board entry overwritten by a late end of a room whose
slot was reused costs that room the fast path, never its answer. The order of plain stores and
loads the seqlock relies on holds on x86-64 (TSO); elsewhere the board is not used.
"""

from __future__ import annotations

import functools
import math
import platform
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import MAX_STR, check_object, check_str, field_int

MAGIC = b"PDFBOARD"
HEADER = struct.Struct("<8sII16s")  # magic, slots, slot bytes, nonce
HEADER_BYTES = 64
# A slot's header is seq (word 0), room (word 1), then SLOT_FIELDS: bytes moved, first byte (monotonic; NaN: none), rows
SLOT_FIELDS = struct.Struct("<QdI")
SLOT_FIELDS_AT = 16
SLOT_HEADER_BYTES = 64
MAX_SLOTS = 1 << 16
NONCE_BYTES = 16
# Plain stores become visible in program order, and loads are not reordered with other loads.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def slot_bytes(aux_row_bytes: Sequence[int]) -> int:
    """One slot: its header and room for one private aux row (each item's bytes), 64-byte aligned."""
    rows = sum(aux_row_bytes)
    return SLOT_HEADER_BYTES + -(-rows // 64) * 64


def board_bytes(slots: int, aux_row_bytes: Sequence[int]) -> int:
    return HEADER_BYTES + slots * slot_bytes(aux_row_bytes)


@dataclass(frozen=True)
class BoardShare:
    """The board an engine offers in its registration: the file, its slots, and the nonce its header holds."""

    path: str
    slots: int
    nonce: str  # hex, NONCE_BYTES bytes

    @classmethod
    def parse(cls, value: Any) -> Self | None:
        if value is None:
            return None
        d = check_object(value, "board")
        path = check_str(d.get("path"), "board.path", limit=MAX_STR)
        if not path.startswith("/"):
            raise malformed("board.path must be an absolute path of a shared-memory file")
        nonce = d.get("nonce")
        if not (
            isinstance(nonce, str) and len(nonce) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in nonce)
        ):
            raise malformed(f"board.nonce must be {NONCE_BYTES} bytes in lowercase hex")
        return cls(path, field_int(d, "slots", minimum=1, maximum=MAX_SLOTS), nonce)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "slots": self.slots, "nonce": self.nonce}


@dataclass(frozen=True)
class BoardEnd:
    """A room's successful end as the board holds it."""

    moved: int
    first_byte_at: float | None
    aux_rows: tuple[bytes, ...] | None


class RoomBoard:
    """A mapped board (either side): ``memory`` is the whole file, writable."""

    def __init__(self, memory: Any, slots: int, aux_row_bytes: Sequence[int]) -> None:
        self._source = memory
        self.memory = memoryview(memory).cast("B")
        self.slots = slots
        self.aux_row_bytes = tuple(aux_row_bytes)
        self.slot_bytes = slot_bytes(aux_row_bytes)
        size = board_bytes(slots, aux_row_bytes)
        if len(self.memory) < size:
            raise ValueError(f"a board of {slots} slots needs {size} bytes")
        # Whole-word loads and stores of seq and room (slots are 64-byte aligned in a page-aligned map).
        self.words = self.memory[:size].cast("Q")

    @staticmethod
    def format(memory: Any, slots: int, aux_row_bytes: Sequence[int], nonce: bytes) -> RoomBoard:
        """Write a fresh board's header (the engine, on a zeroed file)."""
        HEADER.pack_into(memory, 0, MAGIC, slots, slot_bytes(aux_row_bytes), nonce)
        return RoomBoard(memory, slots, aux_row_bytes)

    @staticmethod
    def header_matches(memory: Any, share: BoardShare, aux_row_bytes: Sequence[int]) -> str | None:
        """Why the mapped file is not the board ``share`` describes (None: it is)."""
        magic, slots, size, nonce = HEADER.unpack_from(memory, 0)
        if magic != MAGIC or nonce.hex() != share.nonce:
            return "its header is not the engine's (another file at that path: the engine's shared memory is not the agent's)"
        if slots != share.slots or size != slot_bytes(aux_row_bytes):
            return f"its header says {slots} slots of {size} bytes, not {share.slots} of {slot_bytes(aux_row_bytes)}"
        return None

    def _at(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"board slot {slot} outside 0..{self.slots - 1}")
        return HEADER_BYTES + slot * self.slot_bytes

    def write_success(
        self, slot: int, room: int, moved: int, first_byte_at: float | None, aux_rows: Sequence[bytes] | None
    ) -> None:
        """The agent: room ``room`` ended Success (its private aux row, when it has one)."""
        at = self._at(slot)
        word = at // 8
        seq = self.words[word]
        seq += 1 + (seq & 1)  # odd: being written
        self.words[word] = seq
        rows = 0
        if aux_rows:
            self._put_rows(at, aux_rows)
            rows = len(aux_rows)
        first = math.nan if first_byte_at is None else first_byte_at
        self.words[word + 1] = room
        SLOT_FIELDS.pack_into(self.memory, at + SLOT_FIELDS_AT, moved, first, rows)
        self.words[word] = seq + 1  # even: stable

    def write_rows(self, slot: int, rows: Sequence[bytes]) -> None:
        """The engine: a prefill room's private aux row into its slot, before the send that says
        so (``SendRequest.aux_on_board``). The agent writes no rows into a sender's slot, so the
        two never write the same bytes; the send's request orders this write before the read."""
        self._put_rows(self._at(slot), rows)

    def read_rows(self, slot: int) -> tuple[bytes, ...]:
        """The agent: the aux row an engine wrote into ``slot`` (``write_rows``)."""
        return self._rows(self._at(slot))

    def _put_rows(self, at: int, rows: Sequence[bytes]) -> None:
        """An aux row, one bytes per item of the board's row sizes, after the slot's header at ``at``."""
        sizes = [len(r) for r in rows]
        if sizes != list(self.aux_row_bytes):
            raise ValueError(f"aux rows of {sizes} bytes on a board for rows of {list(self.aux_row_bytes)}")
        pos = at + SLOT_HEADER_BYTES
        for row in rows:
            self.memory[pos : pos + len(row)] = row
            pos += len(row)

    def _rows(self, at: int) -> tuple[bytes, ...]:
        pos, rows = at + SLOT_HEADER_BYTES, []
        for size in self.aux_row_bytes:
            rows.append(bytes(self.memory[pos : pos + size]))
            pos += size
        return tuple(rows)

    def read_success(self, slot: int, room: int) -> BoardEnd | None:
        """The engine: room ``room``'s successful end, or None (not ended Success yet, being
        written, or the slot holds another room)."""
        return self.read_at(self._at(slot), room)

    def reader(self, slot: int, room: int) -> Callable[[], BoardEnd | None]:
        """``read_success`` of one slot and room with its offset worked out once: a poll reads it
        for every request in flight on every scheduler iteration."""
        return functools.partial(self.read_at, self._at(slot), room)

    def sequence(self, slot: int) -> int:
        """A slot's ``seq``: twice the ends written into it, odd while one is being written."""
        return self.words[self._at(slot) // 8]

    def read_at(self, at: int, room: int) -> BoardEnd | None:
        word = at // 8
        seq = self.words[word]
        if seq & 1 or seq == 0 or self.words[word + 1] != room:
            return None  # the common answer: two words read
        moved, first, rows = SLOT_FIELDS.unpack_from(self.memory, at + SLOT_FIELDS_AT)
        aux = self._rows(at) if rows else None
        if self.words[word] != seq:
            return None  # rewritten while read
        return BoardEnd(moved, None if math.isnan(first) else first, aux)

    def release(self) -> None:
        """Unmap (the mapping's owner: the engine at exit, the agent when another registration replaces it)."""
        self.words.release()
        self.memory.release()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
