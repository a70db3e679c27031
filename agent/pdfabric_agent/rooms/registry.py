"""The registry of rooms: the rooms of every local rank, by role, and the rooms' outcomes counted.

Open rooms are scanned by the tick for deadlines; finished ones are kept for their TTL in finish
order (so a late poll still sees the outcome) and then forgotten, without the tick walking that
history. A room's own state and rules are ``room``'s; the registry keeps, counts and retires them.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdfabric_agent.protocol.errors import conflict, unknown_room
from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.rooms.room import AnyRoom, DecodeRoom, PrefillRoom
from pdfabric_agent.rooms.unsent import RoomKey, UnsentRooms
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.tasks import later
from pdfabric_core.policy.types import Role

log = logging.getLogger("pdfabric.agent")


@dataclass(frozen=True)
class MetricLabels:
    """The labels every room outcome is counted under."""

    cluster: str
    backend: str
    transport: str


class RoomRegistry:
    """The rooms of this agent's ranks, by role, and the prefill rooms a decode side spoke of
    before their send (``unsent``)."""

    def __init__(self, labels: MetricLabels, clock: Callable[[], float]) -> None:
        self.labels = labels
        self.clock = clock
        self.prefill: dict[RoomKey, PrefillRoom] = {}
        self.decode: dict[RoomKey, DecodeRoom] = {}
        self.unsent = UnsentRooms()
        self._open: dict[tuple[Role, str, int], AnyRoom] = {}
        self._finished: collections.deque[tuple[float, RoomKey, AnyRoom]] = collections.deque()
        self.on_retire: list[Callable[[AnyRoom], None]] = []  # called once per room, when final

    def _rooms(self, role: Role) -> dict[RoomKey, PrefillRoom] | dict[RoomKey, DecodeRoom]:
        return self.prefill if role == Role.PREFILL else self.decode

    def get(self, role: Role, rank_id: str, room_id: int) -> AnyRoom | None:
        return self._rooms(role).get((rank_id, room_id))

    def prefill_room(self, rank_id: str, room_id: int) -> PrefillRoom | None:
        """The prefill room (open, or ended and still remembered); None before its send."""
        return self.prefill.get((rank_id, room_id))

    def rooms_of(self, role: Role, rank_id: str) -> list[AnyRoom]:
        """Every room of one local rank: open, or ended and still remembered."""
        return [room for (rank, _), room in self._rooms(role).items() if rank == rank_id]

    def lookup(self, role: Role, rank_id: str, room_id: int) -> AnyRoom:
        room = self.get(role, rank_id, room_id)
        if room is None:
            raise unknown_room(room_id, rank_id)
        return room

    def refuse_reuse(self, role: Role, rank_id: str, room_id: int) -> None:
        """A room id names one request (SGLang draws bootstrap rooms at random): while the room is
        open, or finished and still remembered, a second use is a conflict, never a silent reopen."""
        old = self.get(role, rank_id, room_id)
        if old is None:
            return
        if not old.state.finished:
            raise conflict(f"room {room_id} is already {old.state.title} on {rank_id}")
        raise conflict(
            f"room {room_id} on {rank_id} already ended {old.state.title}; a room id names one request "
            f"(ids are remembered for PDFABRIC_ROOM_TTL_S after they end)"
        )

    def add(self, room: AnyRoom) -> None:
        key = (room.rank, room.room)
        if isinstance(room, PrefillRoom):
            self.prefill[key] = room
        else:
            self.decode[key] = room
        self._open[(room.role, *key)] = room

    def open_rooms(self) -> Iterator[tuple[Role, AnyRoom]]:
        for (role, _, _), room in list(self._open.items()):
            yield role, room

    def finish(self, room: AnyRoom, state: RoomState, reason: str = "", *, outcome: Outcome | None = None) -> None:
        """The room's one outcome, counted: later calls change nothing."""
        if not room.end(state, reason):
            return
        self.retire(room)
        lab, role = self.labels, room.role
        if state is RoomState.SUCCESS:
            duration = room.finished_at - room.submitted

            def count() -> None:
                metrics.requests.labels(lab.cluster, role, Outcome.SUCCESS.value).inc()
                metrics.request_duration.labels(lab.cluster, role, lab.backend, lab.transport).observe(duration)

            later(count)
        else:
            metrics.requests.labels(lab.cluster, role, (outcome or Outcome.FAILED).value).inc()
            log.warning("%s room %s on %s failed: %s", role, room.room, room.rank, reason)

    def retire(self, room: AnyRoom) -> None:
        """The room is final: wake long polls, stop scanning it, queue it for forgetting."""
        room.stamp_end(self.clock())
        room.wake_waiters()
        key = (room.rank, room.room)
        if self._open.get((room.role, *key)) is room:
            del self._open[(room.role, *key)]
        self._finished.append((room.finished_at, key, room))
        for hook in self.on_retire:
            hook(room)

    def forget(self, now: float, ttl_s: float, early_ttl_s: float) -> None:
        """Drop finished rooms after their TTL and room info nobody claimed in time."""
        while self._finished and now - self._finished[0][0] > ttl_s:
            _, key, room = self._finished.popleft()
            rooms = self._rooms(room.role)
            if rooms.get(key) is room:  # a newer use of the same room id stays
                del rooms[key]
        self.unsent.expire(now, early_ttl_s)

    @property
    def open_count(self) -> int:
        return len(self._open)
