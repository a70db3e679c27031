"""The decode side: a `receive` opens a room, its room info goes to every prefill rank that sends
to it, and each source's arrival is learned from its done report or from its kernels' completion
marks; the room is Success once every expected source arrived.

1. ``submit_receive``: checks the request, opens the room expecting the prefill (tp, cp, pp) ranks
   the rank mapping names, and pushes a ``RoomInfo`` to each of their agents (``_bootstrap``); an
   unreachable agent fails the room and is blacklisted.
2. ``accept_done``: a source's ``DoneReport``; its side-channel aux rows are written after checking
   that each is one item of this room's own aux row.
3. ``accept_launched``: a source's ``LaunchNotice``; the completion watcher reads the marks on the
   sender's board and the source has arrived once every mark is reached.
4. ``heartbeat``: the prefill agents that waiting rooms still expect are pinged; two misses fail
   those rooms now instead of at their deadline.
5. ``_fail``: a room that fails here sends a ``RoomCancel`` to each source whose writes are not
   known to be over; its answer says whether they are (``fenced``). The room's destinations go
   back to the pool once every source is quiet (``claims``), else after the transfer timeout
   (the cancels and the quiet sources: ``source_cancels``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from pdfabric_agent.memory.completion import CompletionWatcher
from pdfabric_agent.memory.plan import expected_sources, pair_duties
from pdfabric_agent.peers.client import PEER_ERRORS, ROOM_INFO_PUSH_S, PeerRefused
from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.labels import Completion, Integrity, Kind, Outcome
from pdfabric_agent.protocol.peer_answers import SourceAnswer
from pdfabric_agent.protocol.peer_wire import DoneReport, LaunchNotice, RoomInfo, SourceReport
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import BytesByPath, KindBytes, ReceiveRequest, zero_bytes
from pdfabric_agent.ranks.engine_board import check_slot
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms import integrity
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.landing import check_owed, checked_aux_rows, count_arrival, landing_plan, unwritten_positions
from pdfabric_agent.rooms.room import DecodeRoom
from pdfabric_agent.rooms.source_cancels import SourceCancels
from pdfabric_agent.rooms.writer import TCP_SIDE_CHANNEL
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.peer_series import PEERS
from pdfabric_agent.runtime.tasks import later
from pdfabric_agent.transfer.registry import path_labels
from pdfabric_core.duties import PairDuties, kv_shard_size
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_core.traffic import duty_bytes

ABORT_WAIT_S = 0.5  # how long an engine's abort waits for the sources' answers to its cancels


class DecodeArrivals(SourceCancels):
    def __init__(self, ctx: AgentContext, completions: CompletionWatcher) -> None:
        super().__init__(ctx)
        self.completions = completions  # kernel senders' completion words
        # Path names a byte report may carry: they become metric labels, so a closed set.
        self.paths = path_labels() | {TCP_SIDE_CHANNEL}

    # ------------------------------------------------------------ client API
    def submit_receive(self, msg: ReceiveRequest) -> RoomView:
        ctx = self.ctx
        local = ctx.ranks.local(msg.rank, Role.DECODE)
        local.check_engine_memory(msg.engine_memory)
        msg.check_bounds(local.layout, ctx.ranks.peer_replicas(Role.PREFILL), ctx.spec.prefill.dp)
        check_slot(local.board, msg.board_slot)
        ctx.rooms.refuse_reuse(Role.DECODE, msg.rank, msg.room)
        expected, owed = {}, {}
        for p, c, s in expected_sources(ctx.spec, local.rank.tp_rank, local.rank.pp_rank):
            prefill_rank = Rank(Role.PREFILL, msg.peer_replica, p, c, s, dp_rank=msg.peer_dp).rank_id
            expected[prefill_rank] = ctx.ranks.agent_for(prefill_rank)
            owed[prefill_rank] = self._owed(local, (p, c, s), msg)
        now = ctx.clock()
        # Last check before the room exists: nothing is claimed or created when it refuses.
        claim = self.claims.claim(msg.rank, msg.room, msg.kv_pages, msg.state_indices, msg.aux_index)
        room = DecodeRoom(
            rank=msg.rank,
            room=msg.room,
            submitted=now,
            deadline=now + ctx.cfg.bootstrap_timeout_s,
            dst_pages=msg.kv_pages,
            dst_state=msg.state_indices,
            dst_aux=msg.aux_index,
            expected=expected,
            owed=owed,
            board_slot=msg.board_slot,
            sharded=kv_shard_size(ctx.spec) > 1,
            claim=claim,
        )
        ctx.rooms.add(room)
        info = RoomInfo(
            room=msg.room,
            decode_rank=msg.rank,
            prefill_rank="",  # one per source, set when pushed
            endpoint=local.backend.endpoint(),
            layout=local.layout,
            bases=local.bases,
            kv_pages=msg.kv_pages,
            state_indices=msg.state_indices,
            aux_index=msg.aux_index,
            prefix_tokens=msg.prefix_tokens,
        )
        ctx.tasks.spawn(self._bootstrap(room, info))
        return room.view()

    def _owed(self, local: LocalRank, source: tuple[int, int, int], msg: ReceiveRequest) -> KindBytes:
        """What one source must deliver into this room: the bytes its own agent plans from the same
        duties (``core.duties``, ``core.traffic.duty_bytes``), so a report can be held to them."""
        spec = self.ctx.spec
        p, c, s = source
        d, ds = local.rank.tp_rank, local.rank.pp_rank
        duties = pair_duties(spec, p, c, s, d, len(msg.kv_pages))
        if duties is None:  # expected_sources names only sources that send
            return zero_bytes()
        if duties.sharded:  # the KV of one position: a report names how many it wrote (check_owed)
            duties = dataclasses.replace(duties, pages=range(1), kv_shard_size=1, kv_shard_rank=0)
        owed = duty_bytes(spec, PairDuties(p, c, s, d, ds, duties), state_slots=len(msg.state_indices))
        return {
            Kind.KV.value: owed.kv,
            Kind.STATE.value: owed.state if msg.state_indices else 0,
            # The engines' own aux rows (registered, and checked equal between the roles).
            Kind.AUX.value: sum(local.layout.aux_items) if duties.send_aux and msg.aux_index is not None else 0,
        }

    async def _bootstrap(self, room: DecodeRoom, info: RoomInfo) -> None:
        ctx = self.ctx

        async def push(prefill_rank: str, agent_name: str) -> None:
            if not await ctx.peers.usable(agent_name):
                raise RuntimeError(ctx.peers.why_blacklisted(agent_name))
            msg = dataclasses.replace(info, prefill_rank=prefill_rank)
            pushed = ctx.clock()
            try:
                await ctx.peers.post(agent_name, msg, ROOM_INFO_PUSH_S)
            except PeerRefused:
                raise
            except PEER_ERRORS as exc:
                why = ctx.peers.blame(agent_name, f"room info push failed: {exc}", pushed, silent=True)
                raise RuntimeError(f"prefill agent {agent_name} unreachable: {why}") from None

        try:
            await asyncio.gather(*(push(r, a) for r, a in room.expected.items()))
        except Exception as exc:
            self._fail(room, str(exc))
            return
        room.room_info_pushed()

    def expire(self, room: DecodeRoom) -> None:
        reason = f"no data from {', '.join(room.missing_sources())} in time"
        self._fail(room, reason, Outcome.TIMEOUT)

    # ------------------------------------------------------------ peer API
    def _source(self, msg: SourceReport, sender_agent: str | None) -> tuple[DecodeRoom, LocalRank]:
        """The decode room a report speaks of, and a check that the speaker is one of its sources
        and the agent the rank map gives that source."""
        local = self.ctx.ranks.local(msg.decode_rank, Role.DECODE)
        room = self.ctx.rooms.lookup(Role.DECODE, msg.decode_rank, msg.room)
        assert isinstance(room, DecodeRoom)
        if msg.prefill_rank not in room.expected:
            raise malformed(f"{msg.prefill_rank} is not a source of room {msg.room} on {msg.decode_rank}")
        self.ctx.ranks.check_speaker(msg.prefill_rank, sender_agent)
        unknown = sorted(set(msg.bytes_by_path) - self.paths)
        if unknown:
            raise malformed(f"bytes_by_path names paths {unknown[:3]}; known paths are {sorted(self.paths)}")
        return room, local

    async def accept_done(self, msg: DoneReport, sender_agent: str | None = None) -> SourceAnswer:
        room, local = self._source(msg, sender_agent)
        if msg.ok:  # a false report is refused even when it is late
            check_owed(room, msg.prefill_rank, msg.bytes_by_path, msg.kv_positions)
        if msg.writes_over:
            self._quiet(room, msg.prefill_rank)
        if room.done_with(msg.prefill_rank):
            # Late or repeated reports change nothing (and count no bytes twice); the answer is
            # the room's outcome, which the source takes as its own.
            return SourceAnswer(room.state, room.reason)
        if not msg.ok:
            self._fail(room, f"{msg.prefill_rank} failed: {msg.reason}")
            return SourceAnswer(room.state)
        rows = checked_aux_rows(msg.aux_rows, local, room)
        if self.ctx.spec.transfer.verify:
            if msg.checksum is None:
                raise malformed("this cluster verifies transfers (spec.transfer.verify): the report needs a checksum")
            for dst_addr, raw in rows:  # side-channel rows are part of what is checked
                local.write(dst_addr, raw)
            rows = []
            if not await self._verified(room, local, msg.prefill_rank, msg.checksum, msg.kv_positions):
                return SourceAnswer(room.state, room.reason)
        if msg.kv_positions is not None:
            room.take_positions(msg.prefill_rank, msg.kv_positions)
        self._arrived(room, local, msg.prefill_rank, msg.bytes_by_path, rows, Completion.DONE_REPORT)
        if room.state is RoomState.SUCCESS:
            # The engine's room feed (woken by the room's end) writes before this answer is made:
            # decode's engine is on the request's critical path, the source's answer is not.
            await asyncio.sleep(0)
        return SourceAnswer(room.state)

    async def _verified(
        self, room: DecodeRoom, local: LocalRank, prefill_rank: str, theirs: str, positions: Sequence[int] | None
    ) -> bool:
        """Checksum what landed from this source (in a worker: it reads every byte) and compare; a
        mismatch fails the room, so no engine reads bytes that are not what was sent."""
        ctx = self.ctx
        plan = landing_plan(self.ctx, room, local, prefill_rank, positions)
        regions = integrity.dest_regions(plan)
        started = time.perf_counter()
        ours = await asyncio.get_running_loop().run_in_executor(
            ctx.workers, integrity.checksum, local.regions(), regions
        )
        metrics.integrity_seconds.labels(ctx.labels.cluster, Role.DECODE.value).observe(time.perf_counter() - started)
        result = Integrity.MATCH if ours == theirs else Integrity.MISMATCH
        metrics.integrity_checks.labels(ctx.labels.cluster, result.value).inc()
        if result is Integrity.MISMATCH:
            reason = f"checksum of what arrived from {prefill_rank} ({ours}) is not the sender's ({theirs})"
            self._fail(room, reason)
            return False
        return not room.state.finished  # the room may have ended (its deadline) while the sum ran

    def accept_launched(self, msg: LaunchNotice, sender_agent: str | None = None) -> SourceAnswer:
        """A source's kernels are on their way: watch their completion marks; the source has arrived
        (its bytes counted, the room Success when it was the last) once every mark is reached."""
        room, local = self._source(msg, sender_agent)
        source = msg.prefill_rank
        if room.sharded:
            raise malformed(
                f"room {room.room} is KV-sharded: its sources complete with done reports naming kv_positions"
            )
        check_owed(room, source, msg.bytes_by_path, None)
        if room.done_with(source):
            return SourceAnswer(room.state)
        if self.ctx.spec.transfer.verify:
            raise malformed(
                "this cluster verifies transfers (spec.transfer.verify): completion comes with the done report"
            )
        try:
            self.completions.watch(
                list(msg.marks),
                lambda: self._arrived(room, local, source, msg.bytes_by_path, [], Completion.COMPLETION_BOARD),
                cancelled=lambda: room.done_with(source),
            )
        except ValueError as exc:
            raise malformed(f"cannot watch the completion of room {room.room}: {exc}") from None
        room.source_launched(source, self.ctx.clock())
        return SourceAnswer(room.state, watching=len(msg.marks))

    def _arrived(
        self,
        room: DecodeRoom,
        local: LocalRank,
        prefill_rank: str,
        by_path: BytesByPath,
        rows: Sequence[tuple[int, bytes]],
        how: Completion,
    ) -> None:
        if room.done_with(prefill_rank):
            return  # a done report and a completion mark of one source: counted once
        room.mark(f"arrived:{prefill_rank}", self.ctx.clock())
        for dst_addr, raw in rows:
            local.write(dst_addr, raw)
        sent = room.source_arrived(prefill_rank, by_path)
        if room.all_arrived and room.sharded and (gap := unwritten_positions(room)):
            self._fail(room, gap)  # never Success for a page that did not arrive
        elif room.all_arrived:
            engine = local.engine
            if engine is not None and engine.aux_inline and room.dst_aux is not None:
                room.keep_aux_rows(engine.aux_row(room.dst_aux))  # the engine writes it into its own row
            self.ctx.rooms.finish(room, RoomState.SUCCESS)
        duration = room.marks[f"arrived:{prefill_rank}"] - room.submitted
        part = (room.rank, room.expected[prefill_rank], sum(sent.values()), duration)
        later(lambda: count_arrival(self.ctx, by_path, how, *part))

    def give_up(self, room: DecodeRoom, reason: str) -> None:
        """Fail the room now (its engine exited); the sources are told in the background."""
        self._fail(room, reason)

    async def abort(self, room: DecodeRoom, reason: str) -> None:
        """The engine gave the room up: Failed now; a source's late report is answered Failed.
        Answers once the sources answered the cancel (``RoomCancel``), so the engine, which frees
        the room's pages when this returns, finds them free for its next room; at most
        ``ABORT_WAIT_S``, since the engine's scheduler waits on this call (the cancels go on)."""
        cancels = self._fail(room, reason)
        if cancels is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(cancels), ABORT_WAIT_S)

    def _fail(self, room: DecodeRoom, reason: str, outcome: Outcome = Outcome.FAILED) -> asyncio.Task[None] | None:
        """The room fails: each source that had not arrived counts its part with that outcome, and
        each whose writes are not known to be over is told (the task returned)."""
        if room.state.finished:
            return None
        for _, agent_name in sorted(room.sources_not_arrived().items()):
            PEERS.count(self.ctx.labels.cluster, room.rank, agent_name, Role.DECODE, outcome)
        self.ctx.rooms.finish(room, RoomState.FAILED, reason, outcome=outcome)
        if room.sources_quiet:
            return None
        return self.ctx.tasks.spawn(self._cancel_sources(room, reason))

    # ------------------------------------------------------------ upkeep
    async def heartbeat(self, timeout_s: float) -> None:
        """Ping the prefill agents that waiting rooms still expect data from; an agent that misses
        twice fails those rooms now instead of at the waiting deadline."""
        ctx = self.ctx
        waiting: dict[str, list[DecodeRoom]] = {}
        for _, room in ctx.rooms.open_rooms():
            if isinstance(room, DecodeRoom) and not room.state.finished:
                for agent_name in room.sources_not_arrived().values():
                    waiting.setdefault(agent_name, []).append(room)
        names = sorted(waiting)
        sent = ctx.clock()
        results = await asyncio.gather(*(ctx.peers.ping(n, timeout_s=timeout_s) for n in names))
        for name, ok in zip(names, results, strict=True):
            if ctx.peers.heartbeat_result(name, ok, sent):
                for room in waiting[name]:
                    self._fail(room, f"prefill agent {name} stopped answering")
