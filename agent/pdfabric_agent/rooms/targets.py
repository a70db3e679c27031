"""One target of a prefill room (a decode rank it sends to): planned, written through the rank's
backend or launched on its kernel path, checksummed when the spec verifies, reported done and
acknowledged; its part counted per peer however it ends (``PrefillSender`` runs the room).

A room sent in chunks (``SendChunk``) is fed to its targets as the chunks come (``feed``): each
target's task takes one delivery per feed, in order, the pages that came since the last one,
state and aux with the final one; the checksum and the done report then cover the whole room, as
the decode side plans it. A one-shot room is one delivery, planned as it always was."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from pdfabric_agent.memory.plan import Duties, TransferPlan, TransferSide, pair_duties, plan_transfer
from pdfabric_agent.peers.client import PEER_ERRORS, PeerRefused
from pdfabric_agent.protocol.labels import Kind, Outcome
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.wire import BytesByPath, zero_bytes
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms import integrity
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.room import Delivery, PrefillRoom, Target
from pdfabric_agent.rooms.writer import TCP_SIDE_CHANNEL, Launch, RoomWriter
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.peer_series import PEERS
from pdfabric_agent.transfer.base import TransferError
from pdfabric_core.policy.types import Role


class DecodeFailed(RuntimeError):
    """The decode side answered that its room failed: this room fails too (one outcome)."""


class EngineDelivery(Delivery):
    """Through the rank's transfer engine, batch by batch. When nothing else of the target is in
    flight, its first batch goes to a worker in the call that fed it (``eager``), as a kernel path
    launches there, instead of when the room's task gets to it after that call answered. A backend
    that must load the decode rank's metadata first (NIXL) starts nothing before it is loaded."""

    def __init__(
        self,
        writer: RoomWriter,
        local: LocalRank,
        room: PrefillRoom,
        target: Target,
        plan: TransferPlan,
        peer: str,
        eager: bool,
    ) -> None:
        self.writer, self.local, self.room, self.target, self.plan, self.peer = writer, local, room, target, plan, peer
        self.by_path = {}
        # Asked once: a newer endpoint loaded meanwhile drops this one, and the write then says so.
        self.metadata_loaded = not local.backend.needs_metadata(peer)
        eager = eager and self.metadata_loaded
        self.batches = writer.engine_batches(local, plan) if eager else None
        self.first = writer.submit_batch(local, peer, self.batches[0]) if self.batches else None

    async def write(self) -> None:
        if not self.metadata_loaded:
            target = self.target
            await self.writer.ctx.metadata.ensure(self.local.backend, target.agent, target.decode_rank, self.peer)
        await self.writer.write_engine(
            self.local, self.peer, self.plan, self.room, self.by_path, self.batches, self.first
        )

    async def settle(self) -> None:
        if self.first is not None:
            await self.first


class KernelDelivery(Delivery):
    """Launched on the rank's kernel path in the API call that made the room ready (the GPU starts
    before that call answers); the room's task waits for the launches to land."""

    may_run_on = True

    def __init__(self, writer: RoomWriter, local: LocalRank, room: PrefillRoom, target: Target, launch: Launch) -> None:
        self.writer, self.local, self.room, self.target, self.launch = writer, local, room, target, launch
        self.plan, self.by_path = launch.plan, launch.by_path

    async def write(self) -> None:
        await self.writer.land(self.local, self.room, self.target, self.launch)

    async def settle(self) -> None:
        await self.write()


class Unstarted(Delivery):
    """A target that could not start (its peer blacklisted, its room not plannable): its task
    fails with ``error``, where its write would have."""

    def __init__(self, error: Exception, final: bool = True) -> None:
        self.error, self.final = error, final
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

    def _prepare(self, room: PrefillRoom, local: LocalRank, target: Target, pages: range) -> tuple[TransferPlan, str]:
        """Before any write to a target, kernel or engine: its peer is admitted, these source
        pages of its room planned (all of them, with state and aux, for a one-shot room)."""
        if self.ctx.peers.is_blacklisted(target.agent):
            raise TransferError(self.ctx.peers.why_blacklisted(target.agent))
        try:
            whole = pages.start == 0 and room.sealed
            planned = self.plan_target(room, local, target) if whole else self.plan_chunk(room, local, target, pages)
        except ValueError as exc:
            raise ValueError(f"cannot plan {room.rank} -> {target.decode_rank}: {exc}") from None
        if pages.start == 0:  # the target's first plan: a later chunk's comes after it
            room.mark_first(f"planned:{target.decode_rank}", self.ctx.clock())
        return planned

    def duties(self, local: LocalRank, target: Target) -> Duties:
        """What this rank sends the target: worked out when first asked, once its room info is
        there (it arrives once), and kept on the target for every chunk and the whole room."""
        if target.duties is None:
            assert target.dst is not None
            rank = local.rank
            duties = pair_duties(
                self.ctx.spec, rank.tp_rank, rank.cp_rank, rank.pp_rank, target.decode_tp, len(target.dst.kv_pages)
            )
            assert duties is not None  # sends_anything already filtered non-sending CP ranks
            target.duties = duties
        return target.duties

    def share(self, local: LocalRank, target: Target) -> range:
        """The request positions this rank sends the target (decode's pages): its source pages."""
        return self.duties(local, target).pages

    def plan_chunk(self, room: PrefillRoom, local: LocalRank, target: Target, pages: range) -> tuple[TransferPlan, str]:
        """The source pages ``pages`` of a room sent in chunks (positions in this rank's page list)
        to the decode pages at the same positions of the target's share; the state slots and the
        aux row only once the room is sealed (its final chunk)."""
        dst = target.dst
        assert dst is not None
        duties = self.duties(local, target)
        share = duties.pages  # the request positions this rank sends, in its page order
        if pages.stop > len(share) or (room.sealed and pages.stop != len(share)):
            raise ValueError(
                f"the room's chunks hold {pages.stop} source pages, but {target.decode_rank} takes {len(share)} "
                f"from this rank (decode's pages); a chunk must not reach past them, and the final one must end there"
            )
        last = room.sealed
        with_state = last and bool(duties.state_layers or duties.state_skipped)
        plan = plan_transfer(
            dataclasses.replace(duties, pages=range(len(pages))),
            TransferSide(
                local.layout,
                local.bases,
                room.src_pages[pages.start : pages.stop],
                room.src_state if with_state else [],
                room.src_aux if last else None,
            ),
            TransferSide(
                dst.layout,
                dst.bases,
                [dst.kv_pages[i] for i in share[pages.start : pages.stop]],
                dst.state_indices if with_state else [],
                dst.aux_index if last else None,
            ),
            coalesce=self.ctx.cfg.coalesce,
            kv_blocks=False,
        )
        return plan, dst.endpoint

    def plan_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> tuple[TransferPlan, str]:
        dst = target.dst
        assert dst is not None  # _maybe_start starts only rooms whose every target has room info
        duties = self.duties(local, target)
        with_state = bool(duties.state_layers or duties.state_skipped)
        plan = plan_transfer(
            duties,
            TransferSide(local.layout, local.bases, room.src_pages, room.src_state if with_state else [], room.src_aux),
            TransferSide(dst.layout, dst.bases, dst.kv_pages, dst.state_indices if with_state else [], dst.aux_index),
            coalesce=self.ctx.cfg.coalesce,
            kv_blocks=False,
        )
        return plan, dst.endpoint

    def feed(self, room: PrefillRoom, local: LocalRank) -> None:
        """Hand each target of a Transferring room what it was not given yet: the source pages
        that came since (a chunk, or every chunk before decode's destinations were known), and the
        final part once the room is sealed. Each is planned, and launched on a kernel path, here."""
        for t in room.targets.values():
            self._feed_target(room, local, t)

    def _feed_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> None:
        stop = len(room.src_pages)
        if target.fed_final or (target.fed == stop and not room.sealed):
            return
        delivery = self.start(room, local, target, range(target.fed, stop))
        target.fed, target.fed_final = stop, room.sealed
        target.deliveries.put_nowait(delivery)

    def start(self, room: PrefillRoom, local: LocalRank, target: Target, pages: range) -> Delivery:
        """The one choice of a delivery's byte mover: launched on the rank's kernel path now (what
        it does not take then goes the engine way: ``RoomWriter.land``), or written through its
        engine by the target's task. From here the target may be written."""
        final = room.sealed
        try:
            plan, peer = self._prepare(room, local, target, pages)
        except Exception as exc:  # raised in the target's task, where its write would have raised it
            return Unstarted(exc, final)
        idle = not target.writing  # none of the target's earlier deliveries is still being written
        target.writing = True
        kernel = local.backend.kernel
        if kernel is None:
            delivery: Delivery = EngineDelivery(self.writer, local, room, target, plan, peer, eager=idle)
        else:
            launch = self.writer.launch(room, local, target, plan, peer, kernel, final=final)
            delivery = KernelDelivery(self.writer, local, room, target, launch)
        delivery.final = final
        return delivery

    def count_unstarted(self, room: PrefillRoom, outcome: Outcome) -> None:
        """A room that ends before its targets were written: each target's part has its outcome."""
        for t in room.targets.values():
            PEERS.count(self.ctx.labels.cluster, room.rank, t.agent, Role.PREFILL, outcome)

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
        duration_s = self.ctx.clock() - room.submitted
        PEERS.count(self.ctx.labels.cluster, room.rank, target.agent, Role.PREFILL, outcome, duration_s, nbytes)

    async def send_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> None:
        """Write the target's deliveries as they are fed, report and have it acknowledge; its
        part is counted however it ends (a cancel is the room's transfer deadline)."""
        moved: list[BytesByPath] = []
        outcome = Outcome.FAILED
        if target.fed == 0 and target.deliveries.empty():
            self._feed_target(room, local, target)  # a room run without its start's feed (a whole one)
        try:
            await self._deliver(room, local, target, moved)
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

    async def _next(self, room: PrefillRoom, target: Target) -> Delivery:
        """The target's next delivery, once fed; a room that ended meanwhile (an abort between
        chunks) raises, after what was launched already has landed (then nothing writes there)."""
        queue = target.deliveries
        if queue.empty() and not room.state.finished:
            getter = asyncio.ensure_future(queue.get())
            ended = asyncio.ensure_future(room.finished_event.wait())
            try:
                await asyncio.wait((getter, ended), return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                if not getter.done():
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                queue.put_nowait(getter.result())  # back in line: the ended room is checked first
        if not room.state.finished:
            return queue.get_nowait()
        running = False
        while not queue.empty():
            queued = queue.get_nowait()
            try:
                await queued.settle()
            except Exception:
                running = running or queued.may_run_on  # a kernel that failed may still run: the target stays writing
        target.writing = running
        raise TransferError(f"room {room.room} ended ({room.reason}) before all its chunks were sent")

    async def _deliver(self, room: PrefillRoom, local: LocalRank, target: Target, moved: list[BytesByPath]) -> None:
        ctx = self.ctx
        deliveries: list[Delivery] = []
        while not deliveries or not deliveries[-1].final:
            delivery = await self._next(room, target)
            if isinstance(delivery, Unstarted):  # nothing of it was written: the reason as it was raised
                target.writing = not target.deliveries.empty()
                raise delivery.error
            moved.append(delivery.by_path)
            writing_since = ctx.clock()
            if not deliveries:  # the target's first: a later chunk's writes come after it
                room.mark_first("first-byte", writing_since)
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
            target.writing = not target.deliveries.empty()  # a launched next chunk still writes
            room.mark(f"written:{target.decode_rank}", ctx.clock())
            deliveries.append(delivery)
        if len(deliveries) == 1:
            plan, by_path = deliveries[0].plan, deliveries[0].by_path
        else:
            # The checksum and the report cover the whole room, as the decode side plans it.
            plan = self.plan_target(room, local, target)[0]
            by_path = {}
            for part in moved:
                for path, per_kind in part.items():
                    total = by_path.setdefault(path, zero_bytes())
                    for kind, n in per_kind.items():
                        total[kind] += n
            moved[:] = [by_path]  # the side-channel aux rows the report adds are counted with it
        if plan.state_skipped_bytes:
            metrics.state_bytes_skipped.labels(ctx.labels.cluster, ctx.labels.backend).inc(plan.state_skipped_bytes)
            room.count_skipped_state(plan.state_skipped_bytes)
        # Also when watched (the decode agent took the completion marks and counts the bytes when it
        # sees them): the report's answer is decode's confirmation, so the room has one outcome.
        checksum = await self._checksum(local, plan) if ctx.spec.transfer.verify else None
        await self._report_done(room, local, target, plan, by_path, checksum)
        room.acknowledged(target, ctx.clock())

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
        report = DoneReport(room.room, target.decode_rank, room.rank, by_path, ok=True, aux_rows=rows)
        # kv_positions: a KV-sharded room's, which of decode's pages this rank wrote.
        report = dataclasses.replace(report, checksum=checksum, kv_positions=plan.kv_positions)
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
            room.count_moved(Kind.AUX.value, aux_tcp_bytes)
