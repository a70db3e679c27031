"""Destination ownership: on each decode rank, which open room holds each KV page, state slot and
aux row. A receive whose destinations overlap another open room's is refused with 409 naming that
room, so two rooms can never both end Success with one holding the other's bytes.

A room's claims go when it ends Success. When it fails they go once every source's writes into
the room are over (``arrivals``: a source that arrived, reported after writing, or said it is
fenced), which is at once in the usual case: SGLang frees a failed request's pages and hands them
to the next request right away. A source that may still be writing (a write it could not stop)
holds them for the transfer timeout more, its own deadline, so a new room never receives them
meanwhile.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pdfabric_agent.protocol.errors import conflict

FREE = -1
CHUNK_BITS = 12  # owner tables are allocated 4096 entries (32 KiB) at a time


class Owners:
    """The open room (its claim slot) owning each index of one kind of destination, FREE where
    none. Allocated in chunks as claims touch them and freed when a chunk holds no claim again, so
    memory follows the claims in flight, not the registered pool (a 64 GiB registration of small
    pages would otherwise cost an 8-byte entry per page up front), and any registered size fits."""

    def __init__(self) -> None:
        self.chunks: dict[int, npt.NDArray[np.int64]] = {}
        self.held: dict[int, int] = {}  # chunk -> entries not FREE

    @staticmethod
    def _groups(idx: npt.NDArray[np.int64]) -> list[tuple[int, npt.NDArray[np.int64]]]:
        """(chunk, offsets in it) for the distinct indices in `idx`."""
        idx = np.unique(idx)
        hi = idx >> CHUNK_BITS
        cuts = np.flatnonzero(np.diff(hi)) + 1
        lows = idx & ((1 << CHUNK_BITS) - 1)
        return [(int(h[0]), lo) for h, lo in zip(np.split(hi, cuts), np.split(lows, cuts), strict=True) if len(h)]

    def owners(self, idx: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(the distinct indices of `idx` that are owned, their owners), in index order."""
        found_idx: list[npt.NDArray[np.int64]] = []
        found_owner: list[npt.NDArray[np.int64]] = []
        for chunk, lows in self._groups(idx) if self.chunks else ():
            table = self.chunks.get(chunk)
            if table is None:
                continue
            owner = table[lows]
            taken = owner != FREE
            found_idx.append((chunk << CHUNK_BITS) + lows[taken])
            found_owner.append(owner[taken])
        if not found_idx:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(found_idx), np.concatenate(found_owner)

    def set(self, idx: npt.NDArray[np.int64], slot: int) -> None:
        """Owned by `slot` (every index in `idx` FREE before)."""
        for chunk, lows in self._groups(idx):
            table = self.chunks.get(chunk)
            if table is None:
                table = self.chunks[chunk] = np.full(1 << CHUNK_BITS, FREE, dtype=np.int64)
            table[lows] = slot
            self.held[chunk] = self.held.get(chunk, 0) + len(lows)

    def clear(self, idx: npt.NDArray[np.int64]) -> None:
        for chunk, lows in self._groups(idx):
            table = self.chunks.get(chunk)
            if table is None:
                continue
            freed = int(np.count_nonzero(table[lows] != FREE))
            table[lows] = FREE
            left = self.held.get(chunk, 0) - freed
            if left <= 0:
                del self.chunks[chunk]
                self.held.pop(chunk, None)
            else:
                self.held[chunk] = left

    def owner(self, index: int) -> int:
        table = self.chunks.get(index >> CHUNK_BITS)
        return FREE if table is None else int(table[index & ((1 << CHUNK_BITS) - 1)])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.chunks.values())


@dataclass
class _RankClaims:
    pages: Owners = field(default_factory=Owners)
    state: Owners = field(default_factory=Owners)
    aux: Owners = field(default_factory=Owners)
    rooms: dict[int, int] = field(default_factory=dict)  # slot -> room id
    held: dict[int, float] = field(default_factory=dict)  # slot -> when a failed room's hold ends
    claimed: dict[int, tuple[npt.NDArray[np.int64], ...]] = field(default_factory=dict)  # slot -> indices


class DestinationClaims:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._ranks: dict[str, _RankClaims] = {}
        self._slots = itertools.count()
        self._held: collections.deque[tuple[float, str, int]] = collections.deque()  # (due, rank, slot)

    def nbytes(self) -> int:
        """Memory of the owner tables (bounded by the claims in flight)."""
        return sum(t.nbytes for rc in self._ranks.values() for t in (rc.pages, rc.state, rc.aux))

    def claim(self, rank_id: str, room: int, pages: list[int], state: list[int], aux: int | None) -> int:
        """Claim every destination of `room` (indices the receive already checked against the
        rank's memory), or refuse (409) and claim nothing; returns the claim's handle for
        ``release`` / ``hold``."""
        rc = self._ranks.get(rank_id)
        if rc is None:
            rc = self._ranks[rank_id] = _RankClaims()
        checks = (
            ("KV pages", rc.pages, np.asarray(pages, dtype=np.int64)),
            ("state slots", rc.state, np.asarray(state, dtype=np.int64)),
            ("aux row", rc.aux, np.asarray([] if aux is None else [aux], dtype=np.int64)),
        )
        for what, owners, wanted in checks:
            taken, held = owners.owners(wanted)
            if len(taken):
                slot = int(held[0])
                holder = rc.rooms[slot]
                shared = sorted(int(x) for x in taken[:5])
                until = rc.held.get(slot)
                if until is None:
                    raise conflict(
                        f"{what} {shared} of {rank_id} belong to room {holder}, still open; a room's "
                        f"destinations must not overlap another open room's"
                    )
                raise conflict(
                    f"{what} {shared} of {rank_id} belong to room {holder}, which failed while a source "
                    f"may still be writing into them; they are free once it stops, at most "
                    f"{max(0.0, until - self.clock()):.1f} s from now"
                )
        slot = next(self._slots)
        rc.rooms[slot] = room
        rc.claimed[slot] = tuple(wanted for _, _, wanted in checks)
        for _, owners, wanted in checks:
            owners.set(wanted, slot)
        return slot

    def release(self, rank_id: str, slot: int) -> None:
        rc = self._ranks.get(rank_id)
        if rc is None or slot not in rc.claimed:
            return
        del rc.rooms[slot]
        rc.held.pop(slot, None)
        for owners, wanted in zip((rc.pages, rc.state, rc.aux), rc.claimed.pop(slot), strict=True):
            owners.clear(wanted)
        if not rc.claimed:
            del self._ranks[rank_id]

    def hold(self, rank_id: str, slot: int, until: float) -> None:
        """Release at `until` (``sweep``), or earlier by ``release``; not now."""
        rc = self._ranks.get(rank_id)
        if rc is None or slot not in rc.claimed:
            return
        rc.held[slot] = until
        self._held.append((until, rank_id, slot))

    def sweep(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            due, rank_id, slot = self._held.popleft()
            rc = self._ranks.get(rank_id)
            if rc is not None and rc.held.get(slot) == due:  # a later hold of the slot: its own entry
                self.release(rank_id, slot)

    def holder(self, rank_id: str, page: int) -> int | None:
        rc = self._ranks.get(rank_id)
        slot = FREE if rc is None else rc.pages.owner(page)
        return None if rc is None or slot == FREE else rc.rooms[slot]
