"""A room: one request's transfer on one local rank, its state and the rules of its state machine.

A room is Bootstrapping until both sides are known, then Transferring, then Success or Failed
(SGLang's KVPoll values); its first outcome is its one outcome. A prefill room sends to its
targets (the decode ranks the rank mapping gives it); a decode room waits for its sources. The
rooms hold state and its rules only: metrics, peers, tasks and the registry's bookkeeping are the
callers' (``PrefillSender``, ``DecodeArrivals``, ``RoomRegistry``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Duties, TransferPlan
from pdfabric_agent.protocol.errors import conflict, malformed
from pdfabric_agent.protocol.labels import Kind
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import BytesByPath, KindBytes, zero_bytes
from pdfabric_core.policy.types import Role


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

    role: ClassVar[Role]
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

    def expired(self, now: float) -> bool:
        """Its deadline (bootstrap, or transfer) has passed."""
        return now >= self.deadline

    def mark(self, phase: str, at: float) -> None:
        """Stamp a phase of the latency breakdown (a later stamp of the phase wins)."""
        self.marks[phase] = at

    def mark_first(self, phase: str, at: float) -> None:
        """Stamp a phase unless it was stamped already (its first time counts)."""
        self.marks.setdefault(phase, at)

    def count_moved(self, kind: str, nbytes: int) -> None:
        """Bytes of one kind that moved for the room."""
        self.moved[kind] += nbytes

    def end(self, state: RoomState, reason: str = "") -> bool:
        """Take the room's one outcome; False, and nothing changed, when it has one already."""
        if not state.finished:
            raise ValueError(f"{state.title} is not an outcome: a room ends Success or Failed")
        if self.state.finished:
            return False
        self.state, self.reason = state, reason
        return True

    def stamp_end(self, at: float) -> None:
        """When the room became final: the latency breakdown's last phase."""
        self.finished_at = at
        self.marks["ended"] = at

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
    role: ClassVar[Role] = Role.PREFILL
    src_pages: list[int]
    src_state: list[int]
    src_aux: int | None
    targets: dict[str, Target]
    skipped_state: int = 0
    # The final chunk arrived (a one-shot send is one): src_pages is whole, src_state and src_aux set.
    sealed: bool = True

    def target_of(self, decode_rank: str) -> Target:
        """The target that is this decode rank; malformed when the room does not send to it."""
        target = self.targets.get(decode_rank)
        if target is None:
            raise malformed(f"room {self.room} on {self.rank} does not send to {decode_rank}")
        return target

    def missing_room_info(self) -> list[str]:
        """The decode ranks whose room info has not come, in order."""
        return sorted(t.decode_rank for t in self.targets.values() if t.dst is None)

    def targets_with_room_info(self) -> list[Target]:
        """The targets whose room info came: their share of the room is known."""
        return [t for t in self.targets.values() if t.dst is not None]

    @property
    def ready(self) -> bool:
        """Bootstrapping, and every target's room info came: the transfer may start."""
        return self.state is RoomState.BOOTSTRAPPING and all(t.dst is not None for t in self.targets.values())

    def take_room_info(self, info: RoomInfo) -> None:
        """One target's room info, from its decode rank: once per target, and only while the room
        is Bootstrapping, so a second copy cannot redirect a room in flight (conflict)."""
        target = self.target_of(info.decode_rank)
        if self.state is not RoomState.BOOTSTRAPPING or target.dst is not None:
            raise conflict(f"room {self.room} on {self.rank} already has room info of {info.decode_rank}")
        target.dst = info

    def take_early_room_info(self, infos: Mapping[str, RoomInfo]) -> None:
        """Room info the decode side announced before the send: each target's taken (a decode rank
        the room does not send to is no target, and its info is left)."""
        for decode_rank, info in infos.items():
            if decode_rank in self.targets:
                self.targets[decode_rank].dst = info

    def start_transfer(self, now: float, timeout_s: float) -> None:
        """Every target's room info came: Transferring, within the transfer timeout from now."""
        self.state = RoomState.TRANSFERRING
        self.mark("transferring", now)
        self.deadline = now + timeout_s

    def take_chunk(self, pages: Sequence[int], offset: int, at: float) -> None:
        """A later chunk's source pages (checked by ``chunks.add_chunk``), after those held."""
        self.src_pages.extend(pages)
        self.mark(f"chunk:{offset}", at)

    def seal(self, state_indices: Sequence[int], aux_index: int | None) -> None:
        """The final chunk came: the pages are whole, and the state slots and aux row known."""
        self.src_state, self.src_aux, self.sealed = list(state_indices), aux_index, True

    def renew_deadline(self, now: float, timeout_s: float) -> None:
        """A chunk came while Transferring: the transfer timeout counts from it (a chunked
        prefill lasts as long as its forwards)."""
        self.deadline = now + timeout_s

    def acknowledged(self, target: Target, at: float) -> None:
        """The target's decode rank confirmed what it was sent."""
        target.done = True
        self.mark(f"acknowledged:{target.decode_rank}", at)

    def count_skipped_state(self, nbytes: int) -> None:
        """State bytes a plan left out (the decode side keeps no such state)."""
        self.skipped_state += nbytes

    def targets_not_done(self) -> list[Target]:
        """The targets that have not confirmed their part."""
        return [t for t in self.targets.values() if not t.done]

    def agents_not_done(self) -> list[str]:
        """The agents of the targets not done, each once, in order."""
        return sorted({t.agent for t in self.targets_not_done()})

    def fenced(self, decode_rank: str) -> bool:
        """No write of this room into the decode rank is in flight (malformed when it is no
        target): the decode side may reuse its destinations."""
        return not self.target_of(decode_rank).writing

    def view(self) -> RoomView:
        return dataclasses.replace(super().view(), state_bytes_skipped=self.skipped_state)


@dataclass(kw_only=True)
class DecodeRoom(Room):
    role: ClassVar[Role] = Role.DECODE
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

    def source_quiet(self, prefill_rank: str) -> bool:
        """The source writes nothing more into the room; True when that made every source quiet."""
        was_quiet = self.sources_quiet
        self.quiet.add(prefill_rank)
        return self.sources_quiet and not was_quiet

    def sources_not_arrived(self) -> dict[str, str]:
        """The sources that have not arrived: prefill rank id -> agent name."""
        return {rank: agent for rank, agent in self.expected.items() if rank not in self.arrived}

    def missing_sources(self) -> list[str]:
        """The sources that have not arrived, in order."""
        return sorted(set(self.expected) - self.arrived)

    @property
    def all_arrived(self) -> bool:
        return self.arrived == set(self.expected)

    def done_with(self, prefill_rank: str) -> bool:
        """The room takes nothing more from the source: it ended, or the source arrived already
        (a done report and a completion mark of one source count once)."""
        return self.state.finished or prefill_rank in self.arrived

    def room_info_pushed(self) -> None:
        """Every source has the room's info: a room still Bootstrapping waits for their data."""
        if self.state is RoomState.BOOTSTRAPPING:
            self.state = RoomState.WAITING_FOR_INPUT

    def source_launched(self, prefill_rank: str, at: float) -> None:
        """The source's kernels are on their way (its completion marks watched)."""
        if self.state is not RoomState.FAILED:
            self.state = RoomState.TRANSFERRING
        self.mark(f"notified:{prefill_rank}", at)

    def take_positions(self, prefill_rank: str, positions: tuple[int, ...]) -> None:
        """The positions a source of a KV-sharded room wrote (checked: ``landing.check_owed``)."""
        self.positions[prefill_rank] = positions

    def keep_aux_rows(self, rows: tuple[bytes, ...]) -> None:
        """The room's aux row as the engine holds it, kept for the engine's view (its own rows are
        private to it, so the view hands them over)."""
        self.aux_rows = rows

    def source_arrived(self, prefill_rank: str, by_path: BytesByPath) -> KindBytes:
        """The source's bytes landed: counted, by kind, for the room and for the source (returned);
        it arrived, and writes nothing more. Its arrival's phase is the caller's to stamp."""
        sent = zero_bytes()
        for per_kind in by_path.values():
            for kind in Kind:
                n = per_kind.get(kind.value, 0)
                self.moved[kind.value] += n
                sent[kind.value] += n
        self.senders[prefill_rank] = sent
        self.arrived.add(prefill_rank)
        self.quiet.add(prefill_rank)
        if self.state is not RoomState.FAILED:
            self.state = RoomState.TRANSFERRING
        return sent

    def view(self) -> RoomView:
        senders = {k: dict(v) for k, v in sorted(self.senders.items())}
        # sources_quiet: every source's writes into the room are over, a failed room's pages may be reused.
        return dataclasses.replace(
            super().view(), senders=senders, sources_quiet=self.sources_quiet, aux_rows=self.aux_rows
        )


AnyRoom = PrefillRoom | DecodeRoom
