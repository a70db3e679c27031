"""Moving one planned target's bytes through the rank's backend, and counting what moved.

Two ways, chosen by what the backend declares:
- engine only: KV, state and aux blocks in one list, chunked to the engine's limit, one worker call
  per batch (``write_engine``): the small state and aux blocks ride in the KV's last batch;
- with a kernel path (``backend.kernel``): the KV as whole page lists and the small state and aux
  batches launched back to back on the sender's stream without waiting (``launch``, from the API
  call that made the room ready), then waited for in one worker call (``land``). What the kernel
  does not take goes the engine way. When the kernels took everything, the decode agent is told
  their completion marks while they run (a ``LaunchNotice``) and learns completion itself.

Bytes are counted per confirmed batch under the `path` that really moved them, so a room that fails
later still shows what moved.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdfabric_agent.memory.block_arrays import BlockArrays, kv_arrays
from pdfabric_agent.memory.plan import Block, TransferPlan
from pdfabric_agent.peers.client import PEER_ERRORS
from pdfabric_agent.protocol.fields import MAX_MARKS
from pdfabric_agent.protocol.labels import Kind
from pdfabric_agent.protocol.peer_answers import SourceAnswer
from pdfabric_agent.protocol.peer_wire import LaunchNotice
from pdfabric_agent.protocol.wire import BytesByPath, zero_bytes
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.room import PrefillRoom, Target
from pdfabric_agent.runtime import metrics
from pdfabric_agent.transfer.base import KernelPath, TransferError
from pdfabric_core.policy.chunking import chunk_batch
from pdfabric_core.policy.types import Role

log = logging.getLogger("pdfabric.agent")

TCP_SIDE_CHANNEL = "tcp-side-channel"  # `path` label of aux rows sent in the done report
# Block lists up to this size are launched from the event loop (a table built in microseconds);
# larger ones are planned in a worker thread.
LOOP_SUBMIT_BLOCKS = 256
# A KV table planned as arrays up to this size is planned on the event loop (about 2 ms); a larger
# one (a long prompt of many layers) in a worker thread.
LOOP_ARRAY_BLOCKS = 65536


@dataclass(frozen=True)
class Batch:
    """One engine write: its blocks (arrays for a backend that takes them, ``block_arrays``) and
    what it carries of each kind, (kind, bytes, blocks), counted once the write is confirmed."""

    blocks: Sequence[Block] | BlockArrays
    kinds: tuple[tuple[Kind, int, int], ...]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class Launched:
    """One kernel launch of a target: its handle and what it carries."""

    handle: object
    kind: Kind
    nbytes: int
    units: int


@dataclass
class Launch:
    """One target's kernel batches, launched without waiting (``RoomWriter.launch``)."""

    plan: TransferPlan
    peer: str
    kernel: KernelPath
    by_path: BytesByPath = field(default_factory=dict)
    launched: list[Launched] = field(default_factory=list)
    later: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # what the kernel did not take
    notice: asyncio.Future[SourceAnswer] | None = None  # the completion marks on their way to decode
    error: Exception | None = None  # a launch failed after others went: raised once they landed


class RoomWriter:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def count(
        self, room: PrefillRoom, by_path: BytesByPath, path: str, kind: Kind, moved: int, blocks: int, batches: int = 1
    ) -> None:
        """Count one confirmed batch (or one kind's part of a mixed batch: ``batches`` 0) under the
        path that really moved it."""
        labels = self.ctx.traffic_labels(Role.PREFILL, path)
        metrics.transfer_bytes.labels(*labels, kind.value).inc(moved)
        metrics.transfer_blocks.labels(*labels).inc(blocks)
        if batches:
            metrics.transfer_batches.labels(*labels).inc(batches)
        room.count_moved(kind.value, moved)
        by_path.setdefault(path, zero_bytes())[kind.value] += moved

    # ------------------------------------------------------------ what a launch did not take: kernel call, else engine
    async def write(
        self,
        local: LocalRank,
        kernel: KernelPath,
        peer: str,
        blocks: Sequence[Block],
        kind: Kind,
        room: PrefillRoom,
        by_path: BytesByPath,
    ) -> None:
        """Blocks a launch did not take: in one waited kernel call if it takes them, else through
        the rank's engine in batches."""
        if not blocks:
            return
        loop = asyncio.get_running_loop()
        backend = local.backend
        # A kernel path takes any number of blocks in one launch; None: it moved nothing.
        used = await loop.run_in_executor(self.ctx.workers, kernel.try_write_blocks, peer, blocks)
        if used is not None:
            self.count(room, by_path, used, kind, sum(b.length for b in blocks), len(blocks))
            return
        # The engine's batch limit (the tcp engine fails oversized batches) applies from here on.
        for chunk in chunk_batch(blocks, min(backend.max_batch_entries, self.ctx.spec.transfer.max_batch_entries)):
            if room.state.finished:  # aborted or cancelled meanwhile: what is not sent yet never lands
                raise TransferError(f"room {room.room} ended ({room.reason}); its remaining batches are not sent")
            used = await loop.run_in_executor(self.ctx.workers, backend.write_batch, peer, chunk)
            # A backend with several paths (GPU kernel with engine fallback) names the one it used.
            self.count(room, by_path, used or backend.path, kind, sum(b.length for b in chunk), len(chunk))

    async def write_kv(
        self,
        local: LocalRank,
        kernel: KernelPath,
        peer: str,
        plan: TransferPlan,
        room: PrefillRoom,
        by_path: BytesByPath,
    ) -> None:
        """The KV pages a launch did not take: as page lists in one waited kernel call, else as blocks."""
        kvp = plan.kv_pages
        if kvp is None or not kvp.num_pages:
            await self.write(local, kernel, peer, plan.kv, Kind.KV, room, by_path)
            return
        loop = asyncio.get_running_loop()
        # The route's page lists as they are: every layer and K/V in one kernel launch.
        used = await loop.run_in_executor(self.ctx.workers, kernel.try_write_pages, peer, kvp)
        if used is not None:
            self.count(room, by_path, used, Kind.KV, kvp.nbytes, kvp.units)
            return
        blocks = plan.kv or await loop.run_in_executor(self.ctx.workers, kvp.blocks, self.ctx.cfg.coalesce)
        await self.write(local, kernel, peer, blocks, Kind.KV, room, by_path)

    def engine_batches(self, local: LocalRank, plan: TransferPlan) -> list[Batch] | None:
        """The plan's KV, state and aux blocks as engine batches, built here when the KV table is
        small (None: it is built in a worker). The small state and aux blocks ride in the KV's last
        batch instead of a sync round trip each (upstream Mooncake sends aux as a batch of its own;
        each costs a round trip after the last chunk)."""
        kvp = plan.kv_pages
        if plan.kv or kvp is None or not kvp.num_pages:
            return self._batches(local, plan, plan.kv)
        if local.backend.block_arrays:
            if kvp.units <= LOOP_ARRAY_BLOCKS:
                return self._batches(local, plan, kv_arrays(kvp, self.ctx.cfg.coalesce))
            return None
        if kvp.units <= LOOP_SUBMIT_BLOCKS:
            return self._batches(local, plan, kvp.blocks(self.ctx.cfg.coalesce))
        return None

    def _batches(self, local: LocalRank, plan: TransferPlan, kv: Sequence[Block] | BlockArrays) -> list[Batch]:
        limit = min(local.backend.max_batch_entries, self.ctx.spec.transfer.max_batch_entries)
        if local.backend.block_arrays or isinstance(kv, BlockArrays):
            return array_batches(kv, plan, limit)
        return block_batches(kv, plan, limit)

    def submit_batch(self, local: LocalRank, peer: str, batch: Batch) -> asyncio.Future[str | None]:
        """One engine batch under way now (it runs while the caller goes on): started here when
        the engine can start it without blocking (``start_batch``), a worker only waiting for it;
        else written by a worker. Starting it here saves the worker's wake-up, which waits for
        this loop to let go of the GIL (0.3-0.5 ms on two busy cores, issue 23)."""
        loop = asyncio.get_running_loop()
        backend = local.backend
        blocks = batch.blocks
        if isinstance(blocks, BlockArrays):
            wait = backend.start_arrays(peer, blocks) if len(blocks) <= LOOP_SUBMIT_BLOCKS else None
            write: Callable[[str, Any], str | None] = backend.write_arrays
        else:
            wait = backend.start_batch(peer, blocks) if len(blocks) <= LOOP_SUBMIT_BLOCKS else None
            write = backend.write_batch
        if wait is not None:
            return loop.run_in_executor(self.ctx.workers, wait)
        return loop.run_in_executor(self.ctx.workers, write, peer, blocks)

    async def write_engine(
        self,
        local: LocalRank,
        peer: str,
        plan: TransferPlan,
        room: PrefillRoom,
        by_path: BytesByPath,
        batches: list[Batch] | None = None,
        first: asyncio.Future[str | None] | None = None,
    ) -> None:
        """The plan's batches one after another (``first``: the first one's write, already
        started). A batch is all or nothing, so its kinds are counted once it is confirmed."""
        if batches is None:
            batches = self.engine_batches(local, plan)
        if batches is None:
            kvp = plan.kv_pages
            assert kvp is not None
            loop, coalesce = asyncio.get_running_loop(), self.ctx.cfg.coalesce
            kv: Sequence[Block] | BlockArrays
            if local.backend.block_arrays:
                kv = await loop.run_in_executor(self.ctx.workers, kv_arrays, kvp, coalesce)
            else:
                kv = await loop.run_in_executor(self.ctx.workers, kvp.blocks, coalesce)
            batches = self._batches(local, plan, kv)
        for i, batch in enumerate(batches):
            if first is None or i > 0:
                if room.state.finished:  # aborted or cancelled meanwhile: what is not sent yet never lands
                    raise TransferError(f"room {room.room} ended ({room.reason}); its remaining batches are not sent")
                write = self.submit_batch(local, peer, batch)
            else:
                write = first
            used = await write or local.backend.path
            for j, (kind, moved, count) in enumerate(batch.kinds):
                self.count(room, by_path, used, kind, moved, count, batches=1 if j == 0 else 0)

    # ------------------------------------------------------------ kernel path: launch now, land later
    def launch(
        self,
        room: PrefillRoom,
        local: LocalRank,
        target: Target,
        plan: TransferPlan,
        peer: str,
        kernel: KernelPath,
        *,
        final: bool = True,
    ) -> Launch:
        """Launch what the kernel takes, without waiting. A launch that fails is kept in ``error``:
        whatever went before it is waited for first (``land``). ``final``: the target's last launch
        (a one-shot room's only one): when every launch of the target was wholly the kernel's,
        their completion marks, all of them, may stand for the done report."""
        launch = Launch(plan, peer, kernel)
        by_path = launch.by_path
        try:
            kvp = plan.kv_pages
            if kvp is not None and kvp.num_pages:
                h = kernel.submit_pages(peer, kvp) if kvp.whole_page else None
                if h is not None:
                    launch.launched.append(Launched(h, Kind.KV, kvp.nbytes, kvp.units))
                else:
                    launch.later.append(lambda: self.write_kv(local, kernel, peer, plan, room, by_path))
            elif plan.kv:
                launch.later.append(lambda: self.write(local, kernel, peer, plan.kv, Kind.KV, room, by_path))
            for kind, blocks in ((Kind.STATE, plan.state), (Kind.AUX, plan.aux)):
                if not blocks:
                    continue
                h = kernel.submit_blocks(peer, blocks) if len(blocks) <= LOOP_SUBMIT_BLOCKS else None
                if h is not None:
                    launch.launched.append(Launched(h, kind, sum(b.length for b in blocks), len(blocks)))
                else:
                    launch.later.append(functools.partial(self.write, local, kernel, peer, blocks, kind, room, by_path))
            room.mark(f"launched:{target.decode_rank}", self.ctx.clock())
            self._keep_marks(target, launch, plan)
            if final and target.all_marked and target.marked:
                # While the kernels run: the decode agent watches the marks instead of awaiting a report.
                launch.notice = asyncio.ensure_future(self._notify_launched(room, target, local.backend.path))
        except Exception as exc:  # raised by `land` once what did go has landed
            launch.error = exc
        return launch

    async def land(self, local: LocalRank, room: PrefillRoom, target: Target, launch: Launch) -> None:
        """Wait for a target's launches (one worker call), count them, run what the kernel did not
        take, and let the launch notice finish (the done report follows in any case: its answer is
        decode's outcome)."""
        notice = launch.notice
        try:
            # Launched batches are always waited for (their receiver reservations are released on
            # completion) and counted, also when a later launch was refused.
            if launch.launched:
                loop = asyncio.get_running_loop()
                kernel = launch.kernel
                paths = await loop.run_in_executor(
                    self.ctx.workers, lambda: [kernel.wait(x.handle) for x in launch.launched]
                )
                for path, x in zip(paths, launch.launched, strict=True):
                    self.count(room, launch.by_path, path, x.kind, x.nbytes, x.units)
            if launch.error is not None:
                raise launch.error
        except BaseException:
            if notice is not None:
                notice.cancel()
            raise
        for write in launch.later:
            await write()
        if notice is None:
            return
        try:
            await notice
        except PEER_ERRORS as exc:
            log.info(
                "room %s: %s did not take the completion marks (%s); the done report carries the bytes",
                room.room,
                target.agent,
                exc,
            )
            return
        room.mark(f"notified:{target.decode_rank}", self.ctx.clock())

    def _keep_marks(self, target: Target, launch: Launch, plan: TransferPlan) -> None:
        """Add this launch's completion marks to the target's, or note that they cannot stand for
        its bytes: part of it goes another way (the engine, the report's side channel), or this
        cluster verifies (decode is Success only on the checksummed report)."""
        kernel = launch.kernel
        marks = [kernel.completion_mark(x.handle) for x in launch.launched] if launch.launched else []
        # A sharded room's source names the positions it wrote, which only its done report carries.
        whole = bool(marks) and not launch.later and not plan.aux_tcp and not self.ctx.spec.transfer.verify
        whole = whole and plan.kv_positions is None
        if not whole or any(m is None for m in marks) or len(target.marked) + len(marks) > MAX_MARKS:
            target.all_marked = False
            return
        target.marked.extend(m for m in marks if m is not None)
        for x in launch.launched:
            target.marked_bytes[x.kind.value] += x.nbytes

    async def _notify_launched(self, room: PrefillRoom, target: Target, path: str) -> SourceAnswer:
        notice = LaunchNotice(
            room.room, target.decode_rank, room.rank, {path: dict(target.marked_bytes)}, tuple(target.marked)
        )
        timeout_s = max(0.1, min(5.0, room.deadline - self.ctx.clock()))
        return await self.ctx.peers.post(target.agent, notice, timeout_s)


def block_batches(kv: Sequence[Block], plan: TransferPlan, limit: int) -> list[Batch]:
    """The KV, state and aux blocks in one list chunked under ``limit``, each chunk with what it
    carries of each kind."""
    tagged = [(Kind.KV, b) for b in kv] + [(Kind.STATE, b) for b in plan.state] + [(Kind.AUX, b) for b in plan.aux]
    batches = []
    for chunk in chunk_batch(tagged, limit):
        per_kind: dict[Kind, tuple[int, int]] = {}
        for kind, b in chunk:
            moved, count = per_kind.get(kind, (0, 0))
            per_kind[kind] = (moved + b.length, count + 1)
        kinds = tuple((kind, moved, count) for kind, (moved, count) in per_kind.items())
        batches.append(Batch([b for _, b in chunk], kinds))
    return batches


def array_batches(kv: Sequence[Block] | BlockArrays, plan: TransferPlan, limit: int) -> list[Batch]:
    """``block_batches`` as arrays: the same chunks and counts, no object per block."""
    parts = [
        kv if isinstance(kv, BlockArrays) else BlockArrays.of(kv),
        BlockArrays.of(plan.state),
        BlockArrays.of(plan.aux),
    ]
    every = BlockArrays.joined(parts)
    ends = np.cumsum([0] + [len(p) for p in parts])
    batches = []
    for start in range(0, len(every), limit):
        stop = min(start + limit, len(every))
        kinds = []
        for kind, first, last in zip((Kind.KV, Kind.STATE, Kind.AUX), ends[:-1], ends[1:], strict=True):
            a, b = max(start, int(first)), min(stop, int(last))
            if a < b:
                kinds.append((kind, int(every.length[a:b].sum()), b - a))
        batches.append(Batch(every.part(start, stop), tuple(kinds)))
    return batches
