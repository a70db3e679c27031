"""The prefill side: a `send` opens a room per local rank, the decode agents' room info makes it
ready, the targets are planned and written, and the decode side confirms.

1. ``submit_send``: checks the request, opens the room with one ``Target`` per decode rank that
   the rank mapping sends to; a CP rank that sends nothing for this spec ends Success at once.
2. ``accept_dst``: a decode agent's ``RoomInfo``; early info (the decode side was first) waits in
   the registry. When every target's info is there the room is Transferring: a backend with a
   kernel path launches inside this very call, so the GPU starts before it answers.
3. ``_run``: every target is written (``RoomWriter``) within the transfer deadline, then reported
   (``DoneReport``) unless the decode agent took completion marks; the room is Success once every
   target was acknowledged. A timeout blacklists the silent peers; any failure tells the decode
   side (``ok: false``) so it fails now instead of at its deadline, and whether this rank's writes
   there are over (``fenced``), so the decode side can reuse the destinations.
4. ``accept_cancel``: the decode side gave a room up: its room info is dropped (a later send of
   that room fails at once) or the room fails; the answer says whether writes are over.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdfabric_agent.memory.plan import decode_targets
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_agent.protocol.errors import conflict, malformed, out_of_range
from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.protocol.peer_answers import CancelAnswer, RoomInfoTaken
from pdfabric_agent.protocol.peer_wire import DoneReport, RoomCancel, RoomInfo
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import SendRequest
from pdfabric_agent.ranks.engine_board import check_slot
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.chunks import add_chunk, until_deadline
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.registry import PrefillRoom, Target
from pdfabric_agent.rooms.targets import TargetSender
from pdfabric_core.duties import kv_shard_size, prefill_rank_sends
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank


def aux_rows_mismatch(local: LocalRank, info: RoomInfo) -> str:
    """Why a decode rank's aux rows cannot take this rank's (different sizes), or ""."""
    mine, theirs = local.layout.aux_items, info.layout.aux_items
    if mine == theirs:
        return ""
    return (
        f"aux rows of {info.decode_rank} are {list(theirs)} bytes, {local.rank.rank_id}'s {list(mine)}: prefill "
        "and decode engines must hand the same metadata rows (the same SGLang version, model hidden size and settings)"
    )


class PrefillSender:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.targets = TargetSender(ctx)

    # ------------------------------------------------------------ client API
    def submit_send(self, msg: SendRequest) -> RoomView:
        """Validate everything first; only a request that passes creates a room. A chunk after
        the first goes to its open room (``chunks.add_chunk``)."""
        ctx = self.ctx
        local = ctx.ranks.local(msg.rank, Role.PREFILL)
        decode_replicas = ctx.ranks.peer_replicas(Role.DECODE)
        shards = kv_shard_size(ctx.spec)
        # Under KV cache sharding the pages are the request's logical ones, striped over the shard
        # group: the pool holds 1 / shards of them (the planner checks the ones this rank owns).
        layout = (
            dataclasses.replace(local.layout, kv_pages=local.layout.kv_pages * shards) if shards > 1 else local.layout
        )
        msg.check_bounds(layout, decode_replicas, ctx.spec.decode.dp)
        check_slot(local.board, msg.board_slot)
        if isinstance(msg, SendChunk) and not msg.opens:
            return add_chunk(self, local, msg)
        sends = self.sends_anything(local)
        replica = msg.peer_replica
        if sends and not ctx.ranks.feeds(local.rank.replica, replica):
            raise out_of_range(f"prefill replica {local.rank.replica} does not feed decode replica {replica}")
        ctx.rooms.refuse_reuse(Role.PREFILL, msg.rank, msg.room)
        self.take_aux_row(local, msg, msg.board_slot)
        targets: dict[str, Target] = {}
        for route in decode_targets(ctx.spec, local.rank.tp_rank) if sends else []:
            stage = ctx.ranks.decode_stage(local)
            decode_rank = Rank(Role.DECODE, replica, route.decode_tp_rank, 0, stage, dp_rank=msg.peer_dp).rank_id
            targets[decode_rank] = Target(decode_rank, route.decode_tp_rank, ctx.ranks.agent_for(decode_rank))
        now = ctx.clock()
        room = PrefillRoom(
            rank=msg.rank,
            room=msg.room,
            submitted=now,
            deadline=now + ctx.cfg.bootstrap_timeout_s,
            src_pages=msg.kv_pages,
            src_state=msg.state_indices,
            src_aux=msg.aux_index,
            targets=targets,
            sealed=not isinstance(msg, SendChunk) or msg.final,
            board_slot=msg.board_slot,
        )
        ctx.rooms.add(Role.PREFILL, room)
        given_up = ctx.rooms.unsent.take_given_up((msg.rank, msg.room))
        if given_up is not None:
            self.targets.count_unstarted(room, Outcome.FAILED)
            ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, given_up)
            return room.view()
        if not sends:
            # A CP rank that does not send (only CP rank 0 without all-CP-ranks transfer), or a TP
            # rank whose replicated heads another rank sends: no work, and SGLang waits for it.
            room.state = RoomState.SUCCESS
            room.reason = self.why_nothing(local)
            ctx.rooms.retire(Role.PREFILL, room)
            return room.view()
        for agent_name in {t.agent for t in targets.values()}:
            if ctx.peers.is_blacklisted(agent_name):
                self.targets.count_unstarted(room, Outcome.FAILED)
                ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, ctx.peers.why_blacklisted(agent_name))
                return room.view()
        for decode_rank, info in ctx.rooms.unsent.take_announced((msg.rank, msg.room)).items():
            if decode_rank in targets:
                targets[decode_rank].dst = info
        self._maybe_start(room)
        return room.view()

    def take_aux_row(self, local: LocalRank, msg: SendRequest, slot: int | None) -> None:
        """An engine that keeps its aux rows private hands the room's with the send (in the body,
        or in the room's board ``slot``): into the agent's own row ``aux_index``, from where the
        room moves it like any aux row."""
        engine = local.engine
        inline = engine is not None and engine.aux_inline
        if (msg.aux_rows or msg.aux_on_board) and not inline:
            raise malformed(
                f"aux_rows or aux_on_board given, but the agent maps {msg.rank}'s aux buffers: send the row only after "
                "registering private aux rows (aux_slots)"
            )
        if not inline or msg.aux_index is None:
            return
        assert engine is not None
        rows = msg.aux_rows
        if msg.aux_on_board:
            if local.board is None or slot is None:
                raise malformed(
                    f"aux_on_board, but the agent maps no room board slot of room {msg.room} on {msg.rank} (no board "
                    "mapped, or the room named no board_slot): send the row in aux_rows"
                )
            rows = local.board.read_rows(slot)
        sizes = [len(row) for row in rows]
        if sizes != list(engine.layout.aux_items):
            raise malformed(
                f"{msg.rank} registered private aux rows of {list(engine.layout.aux_items)} bytes: the send must "
                f"carry its row (aux_rows), one entry per item of those sizes; got {sizes}"
            )
        engine.put_aux_row(msg.aux_index, rows)

    def early_view(self, rank_id: str, room_id: int) -> RoomView | None:
        """A prefill room not sent yet whose decode side already announced itself: upstream's
        Bootstrapping / WaitingForInput, so a prefill engine can see decode is ready."""
        ctx = self.ctx
        if ctx.rooms.prefill_room(rank_id, room_id) is not None:
            return None
        given_up = ctx.rooms.unsent.given_up((rank_id, room_id))
        if given_up is not None:
            ctx.ranks.served(rank_id)
            return RoomView(rank=rank_id, room=room_id, state=RoomState.FAILED, reason=given_up, decode_ranks_ready=())
        local = ctx.ranks.served(rank_id)
        if local.rank.role is not Role.PREFILL:
            return None  # a decode rank's rooms are its own (the poll looks them up)
        if not self.sends_anything(local):
            # No decode rank announces a room to a rank it does not read from: ready at once.
            return RoomView(
                rank=rank_id,
                room=room_id,
                state=RoomState.WAITING_FOR_INPUT,
                reason=self.why_nothing(local),
                decode_ranks_ready=(),
                sends=False,
            )
        infos = ctx.rooms.unsent.announced((rank_id, room_id))
        if not infos:
            return None
        needed = len(decode_targets(ctx.spec, local.rank.tp_rank))
        state = RoomState.WAITING_FOR_INPUT if len(infos) >= needed else RoomState.BOOTSTRAPPING
        return RoomView(
            rank=rank_id,
            room=room_id,
            state=state,
            decode_ranks_ready=tuple(sorted(infos)),
            # What decode holds already (one request: every decode rank says the same).
            decode_prefix_tokens=max(info.prefix_tokens for info in infos.values()),
        )

    def _announce(self, rank_id: str, room_id: int) -> None:
        """A room not sent yet changed for its engine (decode announced it, or gave it up): its
        engine's room feed gets the view its poll would."""
        if self.ctx.feed.watched(rank_id):
            view = self.early_view(rank_id, room_id)
            if view is not None:
                self.ctx.feed.publish(view)

    def unsent_views(self, rank_id: str) -> list[RoomView]:
        """The views of every room of this rank not sent yet that its engine can act on (a feed's
        snapshot): announced by decode, or given up by it."""
        views = (self.early_view(rank_id, room_id) for _, room_id in sorted(self.ctx.rooms.unsent.keys(rank_id)))
        return [v for v in views if v is not None]

    def sends_anything(self, local: LocalRank) -> bool:
        return prefill_rank_sends(self.ctx.spec, local.rank.tp_rank, local.rank.cp_rank)

    def why_nothing(self, local: LocalRank) -> str:
        if decode_targets(self.ctx.spec, local.rank.tp_rank):
            return f"CP rank {local.rank.cp_rank} sends nothing for this spec"
        return (
            f"TP rank {local.rank.tp_rank}'s KV heads (or MLA latent) are replicated: another prefill rank sends them"
        )

    # ------------------------------------------------------------ peer API
    def accept_dst(self, info: RoomInfo, sender_agent: str | None = None) -> RoomInfoTaken:
        """A decode agent's room info, from the agent of that decode rank, in the layout that rank
        has: its destinations are what this rank writes, so nothing in it is taken on trust."""
        ctx = self.ctx
        self._check_peer(info.prefill_rank, info.decode_rank, sender_agent)
        self._check_dst_layout(info)
        key = (info.prefill_rank, info.room)
        room = ctx.rooms.prefill_room(*key)
        given_up = ctx.rooms.unsent.given_up(key)
        if given_up is not None and room is None:
            raise conflict(f"room {info.room} on {info.prefill_rank} was given up: {given_up}")
        if room is None:
            # The decode side was first: keep it for the send.
            ctx.rooms.unsent.announce(key, info, ctx.clock())
            self._announce(info.prefill_rank, info.room)
            return RoomInfoTaken(early=True)
        target = room.targets.get(info.decode_rank)
        if target is None:
            raise malformed(f"room {info.room} on {info.prefill_rank} does not send to {info.decode_rank}")
        if room.state is not RoomState.BOOTSTRAPPING or target.dst is not None:
            # Room info arrives once per target; a second copy must not redirect a room in flight.
            raise conflict(f"room {info.room} on {info.prefill_rank} already has room info of {info.decode_rank}")
        target.dst = info
        self._maybe_start(room)
        return RoomInfoTaken(early=False)

    def accept_cancel(self, msg: RoomCancel, sender_agent: str | None = None) -> CancelAnswer:
        """The decode side gave the room up: nothing more of this rank lands there. Room info not
        used yet is dropped (a send of the room then fails at once); an open room fails, its
        batches not yet sent are never sent. ``fenced``: no write of this rank into that decode
        room is in flight."""
        ctx = self.ctx
        self._check_peer(msg.prefill_rank, msg.decode_rank, sender_agent)
        key = (msg.prefill_rank, msg.room)
        reason = f"{msg.decode_rank} gave the room up: {msg.reason}"
        room = ctx.rooms.prefill_room(*key)
        if room is None:
            ctx.rooms.unsent.withdraw(key, msg.decode_rank)
            ctx.rooms.unsent.give_up(key, ctx.clock(), reason, replace=False)
            self._announce(msg.prefill_rank, msg.room)
            return CancelAnswer(fenced=True)
        target = room.targets.get(msg.decode_rank)
        if target is None:
            raise malformed(f"room {msg.room} on {msg.prefill_rank} does not send to {msg.decode_rank}")
        self.abort(room, reason)
        return CancelAnswer(fenced=not target.writing, state=room.state)

    def forget_room_info(self, rank_ids: set[str], reason: str) -> int:
        """The engine of these ranks exited: every room it had not sent is given up
        (``give_up_unsent``). Returns the decode ranks told."""
        keys = self.ctx.rooms.unsent.announced_keys(rank_ids)
        return sum(self.give_up_unsent(rank_id, room_id, reason) for rank_id, room_id in keys)

    def give_up_unsent(self, rank_id: str, room_id: int, reason: str) -> int:
        """The engine gave up a room it has not sent (it aborted the request, or exited): the room
        info that waited for its send is dropped and each decode side that announced itself is told
        at once, fenced (nothing was written), instead of waiting out its deadline with the room's
        pages; room info still to come is refused and a late send fails (the room is remembered as
        given up). Returns the decode ranks told."""
        ctx = self.ctx
        key = (rank_id, room_id)
        ctx.rooms.unsent.give_up(key, ctx.clock(), reason)
        told = 0
        for decode_rank in sorted(ctx.rooms.unsent.take_announced(key)):
            report = DoneReport.failure(room_id, decode_rank, rank_id, reason, fenced=True)
            ctx.tasks.spawn(self.targets.post_failure(ctx.ranks.agent_for(decode_rank), report))
            told += 1
        return told

    def _check_peer(self, prefill_rank: str, decode_rank: str, sender_agent: str | None) -> None:
        """A decode rank this local prefill rank feeds, spoken for by the agent that holds it."""
        ctx = self.ctx
        local = ctx.ranks.local(prefill_rank, Role.PREFILL)
        valid = {
            Rank(Role.DECODE, r, route.decode_tp_rank, 0, ctx.ranks.decode_stage(local), dp_rank=dp).rank_id
            for r in range(ctx.ranks.peer_replicas(Role.DECODE))
            for dp in range(ctx.spec.decode.dp)
            for route in decode_targets(ctx.spec, local.rank.tp_rank)
        }
        if decode_rank not in valid:
            raise malformed(f"{decode_rank} is not fed by {prefill_rank}")
        ctx.ranks.check_speaker(decode_rank, sender_agent)

    def _check_dst_layout(self, info: RoomInfo) -> None:
        """The destination layout must be the one the spec gives that decode rank (only pool sizes
        and the page order of its memory, which the decode side chooses, may differ: a page order
        unlike this side's is refused when planned): else the planned offsets would be wrong."""
        spec = self.ctx.spec
        rank = self.ctx.ranks.rank(info.decode_rank)
        got = info.layout
        want = PoolLayout.from_geometry(
            spec.model,
            spec.decode.tp,
            kv_pages=got.kv_pages,
            state_slots=got.state_slots,
            aux_slots=got.aux_slots,
            pp=spec.decode.pp,
            pp_stage=rank.pp_rank,
        )
        local = self.ctx.ranks.by_id[info.prefill_rank]
        # The aux rows are the engines' own; until this rank's engine registered (again, after an
        # agent restart) its rows are not known here: the room checks them when it starts.
        if local.engine is not None and (mismatch := aux_rows_mismatch(local, info)):
            raise malformed(mismatch)
        want = dataclasses.replace(want, page_order=got.page_order, aux_items=got.aux_items)
        if got.kv_buffers == 1 and want.kv_buffers == 2:
            want = want.fused()  # the decode engine keeps K and V together (vLLM): its choice, as the order is
        if got != want:
            mine = vars(got)
            diff = ", ".join(f"{k} {mine[k]} (expected {v})" for k, v in vars(want).items() if mine[k] != v)
            raise malformed(f"room info of {info.decode_rank} has a layout the spec does not give it: {diff}")

    # ------------------------------------------------------------ the send pipeline
    def _maybe_start(self, room: PrefillRoom) -> None:
        if room.state is not RoomState.BOOTSTRAPPING or any(t.dst is None for t in room.targets.values()):
            return
        ctx = self.ctx
        local = ctx.ranks.by_id[room.rank]
        for t in room.targets.values():
            assert t.dst is not None
            if mismatch := aux_rows_mismatch(local, t.dst):
                self.abort(room, mismatch)
                return
        room.state = RoomState.TRANSFERRING
        room.marks["transferring"] = ctx.clock()
        room.deadline = ctx.clock() + ctx.spec.transfer.timeout_seconds
        # Each target's path is chosen here, once per chunk fed; a kernel path launches here too,
        # inside the API call that made the room ready, so the GPU starts before that call answers.
        self.targets.feed(room, local)
        ctx.tasks.spawn(self._run(room))

    def expire(self, room: PrefillRoom) -> None:
        """The tick found the room past its deadline (Transferring has its own deadline task)."""
        if room.state is RoomState.BOOTSTRAPPING:
            missing = sorted(t.decode_rank for t in room.targets.values() if t.dst is None)
            reason = f"no room info from {', '.join(missing)} in time"
            self.targets.count_unstarted(room, Outcome.TIMEOUT)
            self.ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)

    async def _run(self, room: PrefillRoom) -> None:
        ctx = self.ctx
        local = ctx.ranks.by_id[room.rank]
        try:
            sends = [self.targets.send_target(room, local, t) for t in room.targets.values()]
            await until_deadline(room, sends[0] if len(sends) == 1 else asyncio.gather(*sends), ctx.clock)
        except TimeoutError:
            agents = sorted({t.agent for t in room.targets.values() if not t.done})
            reason = (
                f"transfer did not complete within {ctx.spec.transfer.timeout_seconds:g} s (peers {', '.join(agents)})"
            )
            stall = ctx.peers.stall(room.submitted)
            if stall:
                # This agent was not running (stopped, frozen): the deadline says nothing of the peers.
                reason += f"; {stall}, so the peers are not blamed"
            else:
                for agent_name in agents:
                    ctx.peers.blame(agent_name, f"room {room.room} timed out", room.submitted, silent=True)
            ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)
            ctx.tasks.spawn(self._notify_failure(room, "transfer timed out"))
            return
        except Exception as exc:
            ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, str(exc))
            ctx.tasks.spawn(self._notify_failure(room, str(exc)))
            return
        ctx.rooms.finish(room, Role.PREFILL, RoomState.SUCCESS)

    def abort(self, room: PrefillRoom, reason: str) -> None:
        """The engine gave the room up (its pages may be reused): Failed now, decode told."""
        if room.state.finished:
            return
        self.ctx.rooms.finish(room, Role.PREFILL, RoomState.FAILED, reason)
        self.ctx.tasks.spawn(self._notify_failure(room, reason))

    async def _notify_failure(self, room: PrefillRoom, reason: str) -> None:
        for t in room.targets.values():
            if t.done:
                continue
            report = DoneReport.failure(room.room, t.decode_rank, room.rank, reason, fenced=not t.writing)
            await self.targets.post_failure(t.agent, report)
