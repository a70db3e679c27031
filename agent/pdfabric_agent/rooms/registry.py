"""Rooms: one request's transfer on one local rank, its state machine, and the registry of rooms.

A room is Bootstrapping until both sides are known, then Transferring, then Success or Failed
(SGLang's KVPoll values). The registry holds the rooms of every local rank: open ones are scanned
by the tick for deadlines; finished ones are kept for their TTL in finish order (so a late poll
still sees the outcome) and then forgotten, without the tick walking that history.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Duties, TransferPlan
from pdfabric_agent.protocol.errors import conflict, unknown_room
from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import BytesByPath, KindBytes, zero_bytes
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.tasks import later
from pdfabric_core.policy.types import Role

log = logging.getLogger("pdfabric.agent")

RoomKey = tuple[str, int]  # (local rank id, room id)


class Delivery(abc.ABC):
    """How one target's bytes go, decided once, when its room turned ready (``TargetSender.start``):
    the rank's kernel path or its transfer engine; the target's task then only ``write``s. Declared
    here, beside the ``Target`` whose queue holds them; the kinds are made in ``targets``, above."""

    plan: TransferPlan
    by_path: BytesByPath  # what moved, by the path that moved it
    # A write that failed may still run on (a launched kernel): the target then stays writing.
    may_run_on = False
    final = True  # the room's last delivery to the target (state and aux go with it)

    @abc.abstractmethod
    async def write(self) -> None: ...

    async def settle(self) -> None:
        """A room that ended before this delivery's turn: wait for what of it already started
        (then nothing writes into the target any more); raises when that failed."""
        return None  # nothing starts before its turn unless a subclass says so


@dataclass
class Target:
    """One decode rank a prefill room sends to."""

    decode_rank: str
    decode_tp: int
    agent: str
    dst: RoomInfo | None = None  # the decode side's room info, once it arrived
    # What this rank sends the target, worked out once from its room info (``TargetSender.duties``):
    # every chunk of the room is planned from it.
    duties: Duties | None = None
    done: bool = False
    # A write into this target may be in flight: from just before it is submitted until its call
    # returns. A cancelled wait leaves it set, since the worker or the kernel may still be writing.
    writing: bool = False
    # The room's source pages already handed to this target's task (``TargetSender.feed``), and
    # whether the final part (state and aux) went with them; the task takes them in order.
    fed: int = 0
    fed_final: bool = False
    deliveries: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)
    # The completion marks of the target's kernel launches so far and what they carry, while every
    # launch was wholly the kernel's (``RoomWriter.launch``): the final one sends them all to decode.
    marked: list[CompletionMark] = field(default_factory=list)
    marked_bytes: KindBytes = field(default_factory=zero_bytes)
    all_marked: bool = True


@dataclass(kw_only=True)
class Room:
    """What a prefill and a decode room share: identity, deadline, state and the bytes moved."""

    rank: str
    room: int
    submitted: float
    deadline: float  # bootstrap deadline, then the transfer deadline
    state: RoomState = RoomState.BOOTSTRAPPING
    reason: str = ""
    finished_at: float = 0.0
    moved: KindBytes = field(default_factory=zero_bytes)
    marks: dict[str, float] = field(default_factory=dict)  # phase -> clock, for the latency breakdown
    board_slot: int | None = None  # where its engine's room board takes its end (protocol/board.py)
    _finished_event: asyncio.Event | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def finished_event(self) -> asyncio.Event:
        """Set once the room is final, for long polls and a sender waiting on its next delivery;
        made when first waited on: most rooms never are, and an event (about 760 bytes) would be
        kept with every finished room for its TTL (PDFABRIC_ROOM_TTL_S)."""
        if self._finished_event is None:
            self._finished_event = asyncio.Event()
            if self.state.finished:
                self._finished_event.set()
        return self._finished_event

    def wake_waiters(self) -> None:
        """The room is final: whoever waits on ``finished_event`` goes on."""
        if self._finished_event is not None:
            self._finished_event.set()

    def view(self) -> RoomView:
        return RoomView(
            rank=self.rank,
            room=self.room,
            state=self.state,
            reason=self.reason,
            moved=dict(self.moved),
            # The agent's monotonic clock (node-wide): phases of rooms on one node line up.
            submitted_at=round(self.submitted, 6),
            phases_s={k: round(v - self.submitted, 6) for k, v in self.marks.items()},
        )


@dataclass(kw_only=True)
class PrefillRoom(Room):
    src_pages: list[int]
    src_state: list[int]
    src_aux: int | None
    targets: dict[str, Target]
    skipped_state: int = 0
    # The final chunk arrived (a one-shot send is one): src_pages is whole, src_state and src_aux set.
    sealed: bool = True

    def view(self) -> RoomView:
        return dataclasses.replace(super().view(), state_bytes_skipped=self.skipped_state)


@dataclass(kw_only=True)
class DecodeRoom(Room):
    dst_pages: list[int]
    dst_state: list[int]
    dst_aux: int | None
    expected: dict[str, str]  # prefill rank id -> agent name
    claim: int | None = None  # its destinations' claim (claims.DestinationClaims)
    owed: dict[str, KindBytes] = field(default_factory=dict)  # prefill rank id -> bytes it must deliver
    arrived: set[str] = field(default_factory=set)
    # Sources whose writes into this room are over (arrived, reported after writing, or fenced):
    # once all are, a failed room's destinations may go to the next room.
    quiet: set[str] = field(default_factory=set)
    senders: dict[str, KindBytes] = field(default_factory=dict)
    aux_rows: tuple[bytes, ...] | None = None  # once Success, for an engine whose aux rows are private
    # MLA KV cache sharding: each source writes the positions whose pages it owns; ``owed`` then
    # holds its KV bytes per position, and ``positions`` what each arrived source wrote.
    sharded: bool = False
    positions: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def sources_quiet(self) -> bool:
        return self.quiet >= self.expected.keys()

    def view(self) -> RoomView:
        senders = {k: dict(v) for k, v in sorted(self.senders.items())}
        # sources_quiet: every source's writes into the room are over, a failed room's pages may be reused.
        return dataclasses.replace(
            super().view(), senders=senders, sources_quiet=self.sources_quiet, aux_rows=self.aux_rows
        )


AnyRoom = PrefillRoom | DecodeRoom


# Rooms remembered as given up before their send, at most (the oldest forgotten first), and the
# reason kept with each: a peer's burst of cancels for rooms that never come (20,000 frames grew an
# agent by 14 MB, issue 40) costs a bounded few MB; a forgotten room's late send waits for room info
# until its bootstrap deadline, as if no cancel had come.
MAX_GIVEN_UP = 4096
MAX_GIVEN_UP_REASON = 256


class UnsentRooms:
    """Prefill rooms not sent yet that a decode side spoke of first, for the early room info's TTL:
    the room info each decode rank announced (kept for the send, which takes it), and the rooms a
    decode side or the engine gave up before their send (a send of one then fails at once with
    the reason, instead of waiting for room info that will not come; at most ``MAX_GIVEN_UP``)."""

    def __init__(self) -> None:
        self._announced: dict[RoomKey, dict[str, tuple[float, RoomInfo]]] = {}  # decode rank -> (when, info)
        self._given_up: dict[RoomKey, tuple[float, str]] = {}  # (when, why), oldest first

    def announce(self, key: RoomKey, info: RoomInfo, at: float) -> None:
        self._announced.setdefault(key, {})[info.decode_rank] = (at, info)

    def announced(self, key: RoomKey) -> dict[str, RoomInfo]:
        """The room info announced for the room so far, by decode rank."""
        return {rank: info for rank, (_, info) in self._announced.get(key, {}).items()}

    def take_announced(self, key: RoomKey) -> dict[str, RoomInfo]:
        """The room info announced for the room, no longer kept (its send took it, or it ended)."""
        return {rank: info for rank, (_, info) in self._announced.pop(key, {}).items()}

    def withdraw(self, key: RoomKey, decode_rank: str) -> None:
        """One decode rank's room info is void (it gave the room up)."""
        infos = self._announced.get(key)
        if infos is not None:
            infos.pop(decode_rank, None)
            if not infos:
                del self._announced[key]

    def give_up(self, key: RoomKey, at: float, reason: str, *, replace: bool = True) -> None:
        """Remember the room as given up before its send; ``replace``: a later reason wins."""
        if key in self._given_up and not replace:
            return
        self._given_up.pop(key, None)  # to the newest end
        self._given_up[key] = (at, reason[:MAX_GIVEN_UP_REASON])
        while len(self._given_up) > MAX_GIVEN_UP:
            del self._given_up[next(iter(self._given_up))]

    def given_up(self, key: RoomKey) -> str | None:
        """Why the room was given up before its send; None if it was not."""
        entry = self._given_up.get(key)
        return None if entry is None else entry[1]

    def take_given_up(self, key: RoomKey) -> str | None:
        """``given_up``, no longer remembered (its send came, and fails with it)."""
        entry = self._given_up.pop(key, None)
        return None if entry is None else entry[1]

    def announced_keys(self, rank_ids: Collection[str]) -> list[RoomKey]:
        return [key for key in self._announced if key[0] in rank_ids]

    def keys(self, rank_id: str) -> set[RoomKey]:
        """Every room of ``rank_id`` announced or given up."""
        return {key for key in (*self._announced, *self._given_up) if key[0] == rank_id}

    def given_up_reasons(self) -> dict[RoomKey, str]:
        return {key: why for key, (_, why) in self._given_up.items()}

    def expire(self, now: float, ttl_s: float) -> None:
        for key, infos in list(self._announced.items()):
            for decode_rank, (at, _) in list(infos.items()):
                if now - at > ttl_s:
                    del infos[decode_rank]
            if not infos:
                del self._announced[key]
        for key, (at, _) in list(self._given_up.items()):
            if now - at > ttl_s:
                del self._given_up[key]

    def __bool__(self) -> bool:
        return bool(self._announced or self._given_up)


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
        self._finished: collections.deque[tuple[float, Role, RoomKey, AnyRoom]] = collections.deque()
        self.on_retire: list[Callable[[Role, AnyRoom], None]] = []  # called once per room, when final

    def _rooms(self, role: Role) -> dict[RoomKey, Any]:
        return self.prefill if role == Role.PREFILL else self.decode

    def get(self, role: Role, rank_id: str, room_id: int) -> AnyRoom | None:
        room: AnyRoom | None = self._rooms(role).get((rank_id, room_id))
        return room

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

    def add(self, role: Role, room: AnyRoom) -> None:
        self._rooms(role)[(room.rank, room.room)] = room
        self._open[(role, room.rank, room.room)] = room

    def open_rooms(self) -> Iterator[tuple[Role, AnyRoom]]:
        for (role, _, _), room in list(self._open.items()):
            yield role, room

    def finish(
        self, room: AnyRoom, role: Role, state: RoomState, reason: str = "", *, outcome: Outcome | None = None
    ) -> None:
        """The room's one outcome: later calls change nothing."""
        if room.state.finished:
            return
        room.state = state
        room.reason = reason
        self.retire(role, room)
        lab = self.labels
        if state is RoomState.SUCCESS:
            duration = room.finished_at - room.submitted

            def count() -> None:
                metrics.requests.labels(lab.cluster, role, Outcome.SUCCESS.value).inc()
                metrics.request_duration.labels(lab.cluster, role, lab.backend, lab.transport).observe(duration)

            later(count)
        else:
            metrics.requests.labels(lab.cluster, role, (outcome or Outcome.FAILED).value).inc()
            log.warning("%s room %s on %s failed: %s", role, room.room, room.rank, reason)

    def retire(self, role: Role, room: AnyRoom) -> None:
        """The room is final: wake long polls, stop scanning it, queue it for forgetting."""
        room.finished_at = self.clock()
        room.marks["ended"] = room.finished_at  # the latency breakdown's last phase
        room.wake_waiters()
        if self._open.get((role, room.rank, room.room)) is room:
            del self._open[(role, room.rank, room.room)]
        self._finished.append((room.finished_at, role, (room.rank, room.room), room))
        for hook in self.on_retire:
            hook(role, room)

    def forget(self, now: float, ttl_s: float, early_ttl_s: float) -> None:
        """Drop finished rooms after their TTL and room info nobody claimed in time."""
        while self._finished and now - self._finished[0][0] > ttl_s:
            _, role, key, room = self._finished.popleft()
            rooms = self._rooms(role)
            if rooms.get(key) is room:  # a newer use of the same room id stays
                del rooms[key]
        self.unsent.expire(now, early_ttl_s)

    @property
    def open_count(self) -> int:
        return len(self._open)
