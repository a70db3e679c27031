"""Receiver-side reservations: a request whose destination pages overlap a request still in flight
to the same receiver pool is refused, never interleaved (two kernels writing one page leave it
holding a mix of both). The agent is the only writer into its node's decode pools, so one
in-process ledger per agent sees every concurrent request.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping

import torch


class OverlapError(RuntimeError):
    """The request's destination pages are being written by another request right now."""


def _as_set(pages: set[int] | torch.Tensor | Iterable[int]) -> set[int]:
    if isinstance(pages, set):
        return pages
    if isinstance(pages, torch.Tensor):
        return set(pages.tolist())
    return set(pages)


class ReceiverLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[tuple[Hashable, str], set[int]] = {}
        self._rooms: dict[Hashable, list[tuple[tuple[Hashable, str], set[int]]]] = {}
        self._ranges: dict[Hashable, dict[Hashable, list[tuple[int, int]]]] = {}  # receiver -> room -> sorted
        self._room_ranges: dict[Hashable, Hashable] = {}  # room -> receiver

    def reserve(self, room: Hashable, receiver: Hashable, pages_by_pool: Mapping[str, set[int] | torch.Tensor]) -> None:
        wanted = [((receiver, pool), _as_set(p)) for pool, p in pages_by_pool.items()]
        with self._lock:
            if room in self._rooms:
                raise OverlapError(f"room {room!r} is already in flight")
            for key, pages in wanted:
                busy = self._busy.get(key)
                if busy and not busy.isdisjoint(pages):
                    clash = sorted(busy & pages)[:4]
                    raise OverlapError(
                        f"receiver {key[0]!r} pool {key[1]!r}: pages {clash} are in flight for another request"
                    )
            for key, pages in wanted:
                self._busy.setdefault(key, set()).update(pages)
            self._rooms[room] = wanted

    def reserve_ranges(self, room: Hashable, receiver: Hashable, ranges: Iterable[tuple[int, int]]) -> None:
        """Byte ranges [start, end) in the receiver's address space (block writes, exact overlap).

        Each room keeps its own sorted list; a new room is checked against the rooms in flight to
        the same receiver with one merge walk each, so the common case (nothing else in flight)
        costs one sort."""
        new = sorted((s, e) for s, e in ranges if e > s)
        with self._lock:
            if room in self._rooms or room in self._room_ranges:
                raise OverlapError(f"room {room!r} is already in flight")
            others = self._ranges.setdefault(receiver, {})
            for busy in others.values():
                i = j = 0
                while i < len(new) and j < len(busy):
                    (s, e), (bs, be) = new[i], busy[j]
                    if s < be and bs < e:
                        raise OverlapError(
                            f"receiver {receiver!r}: bytes {max(s, bs):#x}..{min(e, be):#x} are in flight for another request"
                        )
                    if e <= be:
                        i += 1
                    else:
                        j += 1
            others[room] = new
            self._room_ranges[room] = receiver

    def release(self, room: Hashable) -> None:
        with self._lock:
            receiver = self._room_ranges.pop(room, None)
            if receiver is not None:
                self._ranges.get(receiver, {}).pop(room, None)
            for key, pages in self._rooms.pop(room, []):
                busy = self._busy.get(key)
                if busy is not None:
                    busy -= pages
                    if not busy:
                        del self._busy[key]

    def in_flight(self) -> int:
        """Requests holding a reservation (one that holds pages and byte ranges counts once)."""
        with self._lock:
            return len(self._rooms.keys() | self._room_ranges.keys())
