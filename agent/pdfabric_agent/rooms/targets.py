"""One target of a prefill room (a decode rank it sends to): planned, written through the rank's
backend or launched on its kernel path, checksummed when the spec verifies, reported done and
acknowledged; its part counted per peer however it ends (``PrefillSender`` runs the room)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time

from pdfabric_agent.memory.plan import TransferPlan, TransferSide, pair_duties, plan_transfer
from pdfabric_agent.peers.client import PEER_ERRORS, PeerRefused
from pdfabric_agent.protocol.labels import Kind, Outcome
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.wire import BytesByPath, zero_bytes
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms import integrity
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.registry import PrefillRoom, Target
from pdfabric_agent.rooms.writer import TCP_SIDE_CHANNEL, Launch, RoomWriter
from pdfabric_agent.runtime import metrics
from pdfabric_agent.transfer.base import TransferError
from pdfabric_core.policy.types import Role


class DecodeFailed(RuntimeError):
    """The decode side answered that its room failed: this room fails too (one outcome)."""


class Delivery(abc.ABC):
    """How one target's bytes go, decided once, when its room turned ready (``TargetSender.start``):
    the rank's kernel path or its transfer engine; the target's task then only ``write``s."""

    plan: TransferPlan
    by_path: BytesByPath  # what moved, by the path that moved it
    # A write that failed may still run on (a launched kernel): the target then stays writing.
    may_run_on = False

    @abc.abstractmethod
    async def write(self) -> None: ...


class EngineDelivery(Delivery):
    """Through the rank's transfer engine, batch by batch, when the room's task runs."""

    def __init__(self, writer: RoomWriter, local: LocalRank, room: PrefillRoom, plan: TransferPlan, peer: str) -> None:
        self.writer, self.local, self.room, self.plan, self.peer = writer, local, room, plan, peer
        self.by_path = {}

    async def write(self) -> None:
        await self.writer.write_engine(self.local, self.peer, self.plan, self.room, self.by_path)


class KernelDelivery(Delivery):
    """Launched on the rank's kernel path in the API call that made the room ready (the GPU starts
    before that call answers); the room's task waits for the launches to land."""

    may_run_on = True

    def __init__(self, writer: RoomWriter, local: LocalRank, room: PrefillRoom, target: Target, launch: Launch) -> None:
        self.writer, self.local, self.room, self.target, self.launch = writer, local, room, target, launch
        self.plan, self.by_path = launch.plan, launch.by_path

    async def write(self) -> None:
        await self.writer.land(self.local, self.room, self.target, self.launch)


class Unstarted(Delivery):
    """A target that could not start (its peer blacklisted, its room not plannable): its task
    fails with ``error``, where its write would have."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.by_path = {}

    async def write(self) -> None:
        raise self.error


class TargetSender:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.writer = RoomWriter(ctx)

    async def post_failure(self, agent_name: str, report: DoneReport) -> None:
        if self.ctx.peers.is_blacklisted(agent_name):
            return
        with contextlib.suppress(Exception):
            await self.ctx.peers.post(agent_name, report, 2.0)

    def _prepare(self, room: PrefillRoom, local: LocalRank, target: Target) -> tuple[TransferPlan, str]:
        """Before any write to a target, kernel or engine: its peer is admitted, its room planned."""
        if self.ctx.peers.is_blacklisted(target.agent):
            raise TransferError(self.ctx.peers.why_blacklisted(target.agent))
        try:
            planned = self.plan_target(room, local, target)
        except ValueError as exc:
            raise ValueError(f"cannot plan {room.rank} -> {target.decode_rank}: {exc}") from None
        room.marks[f"planned:{target.decode_rank}"] = self.ctx.clock()
        return planned

    def plan_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> tuple[TransferPlan, str]:
        dst = target.dst
        assert dst is not None  # _maybe_start starts only rooms whose every target has room info
        spec = self.ctx.spec
        rank = local.rank
        duties = pair_duties(spec, rank.tp_rank, rank.cp_rank, rank.pp_rank, target.decode_tp, len(dst.kv_pages))
        assert duties is not None  # sends_anything already filtered non-sending CP ranks
        with_state = bool(duties.state_layers or duties.state_skipped)
        plan = plan_transfer(
            duties,
            TransferSide(local.layout, local.bases, room.src_pages, room.src_state if with_state else [], room.src_aux),
            TransferSide(dst.layout, dst.bases, dst.kv_pages, dst.state_indices if with_state else [], dst.aux_index),
            coalesce=self.ctx.cfg.coalesce,
            kv_blocks=False,
        )
        return plan, dst.endpoint

    def start(self, room: PrefillRoom, local: LocalRank, target: Target) -> Delivery:
        """The one choice of a target's path: launched on the rank's kernel path now, or written
        through its engine by the room's task. From here the target may be written."""
        try:
            plan, peer = self._prepare(room, local, target)
        except Exception as exc:  # raised in the target's task, where its write would have raised it
            return Unstarted(exc)
        target.writing = True
        kernel = local.backend.kernel
        if kernel is None:
            return EngineDelivery(self.writer, local, room, plan, peer)
        return KernelDelivery(
            self.writer, local, room, target, self.writer.launch(room, local, target, plan, peer, kernel)
        )

    def count_unstarted(self, room: PrefillRoom, outcome: Outcome) -> None:
        """A room that ends before its targets were written: each target's part has its outcome."""
        for t in room.targets.values():
            metrics.count_peer_part(self.ctx.labels.cluster, room.rank, t.agent, Role.PREFILL, outcome)

    def _count_target(self, room: PrefillRoom, target: Target, outcome: Outcome, moved: list[BytesByPath]) -> None:
        """A target's part ended: the bytes it moved (side-channel aux only once acknowledged, as
        ``pdfabric_transfer_bytes_total`` counts them) under the agent the rank map gives it."""
        nbytes = sum(
            n
            for by_path in moved
            for path, per_kind in by_path.items()
            if path != TCP_SIDE_CHANNEL or outcome is Outcome.SUCCESS
            for n in per_kind.values()
        )
        cluster = self.ctx.labels.cluster
        if nbytes:
            metrics.peer_bytes.labels(cluster, room.rank, target.agent, Role.PREFILL.value).inc(nbytes)
        metrics.count_peer_part(
            cluster, room.rank, target.agent, Role.PREFILL, outcome, self.ctx.clock() - room.submitted
        )

    async def send_target(
        self, room: PrefillRoom, local: LocalRank, target: Target, delivery: Delivery | None = None
    ) -> None:
        """Write (``delivery``, else ``start`` now), report and have one target acknowledge; its
        part is counted however it ends (a cancel is the room's transfer deadline)."""
        moved: list[BytesByPath] = []
        outcome = Outcome.FAILED
        try:
            await self._deliver(room, local, target, delivery or self.start(room, local, target), moved)
            outcome = Outcome.SUCCESS
        except asyncio.CancelledError:
            outcome = Outcome.TIMEOUT
            raise
        except Exception:
            if room.state.finished and not target.writing:
                # The room failed while this target was written (its failure report said so, not
                # fenced): now that the write is over, the decode side may reuse its destinations.
                why = room.reason or "the room failed"
                report = DoneReport.failure(room.room, target.decode_rank, room.rank, why, fenced=True)
                self.ctx.tasks.spawn(self.post_failure(target.agent, report))
            raise
        finally:
            self._count_target(room, target, outcome, moved)

    async def _deliver(
        self, room: PrefillRoom, local: LocalRank, target: Target, delivery: Delivery, moved: list[BytesByPath]
    ) -> None:
        ctx = self.ctx
        if isinstance(delivery, Unstarted):  # nothing was written: the reason as it was raised
            raise delivery.error
        plan, by_path = delivery.plan, delivery.by_path
        moved.append(by_path)
        writing_since = ctx.clock()
        try:
            await delivery.write()
        except Exception as exc:
            # The engine's calls returned (a kernel that failed may still run: it stays writing).
            target.writing = delivery.may_run_on
            if not isinstance(exc, TransferError | OSError):
                raise
            why = str(exc)
            if not room.state.finished:  # a room that ended (abort, cancel) is not the peer's fault
                why = ctx.peers.blame(target.agent, why, writing_since)
            raise TransferError(f"{room.rank} -> {target.decode_rank}: {why}") from None
        target.writing = False
        room.marks[f"written:{target.decode_rank}"] = ctx.clock()
        if plan.state_skipped_bytes:
            metrics.state_bytes_skipped.labels(ctx.labels.cluster, ctx.labels.backend).inc(plan.state_skipped_bytes)
            room.skipped_state += plan.state_skipped_bytes
        # Also when watched (the decode agent took the completion marks and counts the bytes when it
        # sees them): the report's answer is decode's confirmation, so the room has one outcome.
        checksum = await self._checksum(local, plan) if ctx.spec.transfer.verify else None
        await self._report_done(room, local, target, plan, by_path, checksum)
        target.done = True
        room.marks[f"acknowledged:{target.decode_rank}"] = ctx.clock()

    async def _checksum(self, local: LocalRank, plan: TransferPlan) -> str:
        """What this rank sent to the target, checksummed at the source (integrity.py)."""
        ctx = self.ctx
        regions = integrity.source_regions(plan)
        started = time.perf_counter()
        checksum = await asyncio.get_running_loop().run_in_executor(
            ctx.workers, integrity.checksum, local.regions(), regions
        )
        metrics.integrity_seconds.labels(ctx.labels.cluster, Role.PREFILL.value).observe(time.perf_counter() - started)
        return checksum

    async def _report_done(
        self,
        room: PrefillRoom,
        local: LocalRank,
        target: Target,
        plan: TransferPlan,
        by_path: BytesByPath,
        checksum: str | None = None,
    ) -> None:
        ctx = self.ctx
        rows = tuple((dst_addr, local.read(src_addr, size)) for src_addr, dst_addr, size in plan.aux_tcp)
        aux_tcp_bytes = sum(size for _, _, size in plan.aux_tcp)
        if aux_tcp_bytes:
            by_path[TCP_SIDE_CHANNEL] = {**zero_bytes(), Kind.AUX.value: aux_tcp_bytes}
        report = DoneReport(
            room.room, target.decode_rank, room.rank, by_path, ok=True, aux_rows=rows, checksum=checksum
        )
        posted = ctx.clock()
        try:
            answer = await ctx.peers.post(target.agent, report, max(0.1, room.deadline - posted))
        except PEER_ERRORS as exc:
            why = ctx.peers.blame(
                target.agent, f"done report failed: {exc}", posted, silent=not isinstance(exc, PeerRefused)
            )
            raise TransferError(f"{target.agent} did not acknowledge room {room.room}: {why}") from None
        if answer.room_failed:
            # Decode gave up on the room (its deadline, another source's failure): not a peer fault.
            raise DecodeFailed(f"{target.decode_rank} reports room {room.room} Failed: {answer.reason}")
        if aux_tcp_bytes:
            labels = ctx.traffic_labels(Role.PREFILL, TCP_SIDE_CHANNEL)
            metrics.transfer_bytes.labels(*labels, Kind.AUX.value).inc(aux_tcp_bytes)
            room.moved[Kind.AUX.value] += aux_tcp_bytes
