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

from pdfabric_agent.errors import conflict
from pdfabric_agent.pools import PoolLayout

FREE = -1


@dataclass
class _RankClaims:
    # Owner slot per destination (FREE when no open room holds it); a slot maps to a room id.
    pages: npt.NDArray[np.int64]
    state: npt.NDArray[np.int64]
    aux: npt.NDArray[np.int64]
    rooms: dict[int, int] = field(default_factory=dict)  # slot -> room id
    held: dict[int, float] = field(default_factory=dict)  # slot -> when a failed room's hold ends
    claimed: dict[int, tuple[npt.NDArray[np.int64], ...]] = field(default_factory=dict)  # slot -> indices


class DestinationClaims:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._ranks: dict[str, _RankClaims] = {}
        self._slots = itertools.count()
        self._held: collections.deque[tuple[float, str, int]] = collections.deque()  # (due, rank, slot)

    def _rank(self, rank_id: str, layout: PoolLayout) -> _RankClaims:
        rc = self._ranks.get(rank_id)
        if rc is None:
            rc = self._ranks[rank_id] = _RankClaims(
                np.full(layout.kv_pages, FREE, dtype=np.int64),
                np.full(layout.state_slots, FREE, dtype=np.int64),
                np.full(layout.aux_slots, FREE, dtype=np.int64),
            )
        return rc

    def claim(
        self, rank_id: str, layout: PoolLayout, room: int, pages: list[int], state: list[int], aux: int | None
    ) -> int:
        """Claim every destination of `room`, or refuse (409) and claim nothing; returns the claim's
        handle for ``release`` / ``hold``."""
        rc = self._rank(rank_id, layout)
        checks = (
            ("KV pages", rc.pages, np.asarray(pages, dtype=np.int64)),
            ("state slots", rc.state, np.asarray(state, dtype=np.int64)),
            ("aux row", rc.aux, np.asarray([] if aux is None else [aux], dtype=np.int64)),
        )
        for what, owners, wanted in checks:
            held = owners[wanted]
            taken = held != FREE
            if taken.any():
                slot = int(held[taken][0])
                holder = rc.rooms[slot]
                shared = sorted({int(x) for x in wanted[taken][:5]})
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
            owners[wanted] = slot
        return slot

    def release(self, rank_id: str, slot: int) -> None:
        rc = self._ranks.get(rank_id)
        if rc is None or slot not in rc.claimed:
            return
        del rc.rooms[slot]
        rc.held.pop(slot, None)
        for owners, wanted in zip((rc.pages, rc.state, rc.aux), rc.claimed.pop(slot), strict=True):
            owners[wanted] = FREE

    def hold(self, rank_id: str, slot: int, until: float) -> None:
        """Release at `until` (``sweep``), or earlier by ``release``; not now."""
        rc = self._ranks.get(rank_id)
        if rc is None or slot not in rc.claimed:
            return
        rc.held[slot] = until
        self._held.append((until, rank_id, slot))

    def sweep(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            _, rank_id, slot = self._held.popleft()
            self.release(rank_id, slot)

    def holder(self, rank_id: str, page: int) -> int | None:
        rc = self._ranks.get(rank_id)
        if rc is None or rc.pages[page] == FREE:
            return None
        return rc.rooms[int(rc.pages[page])]
