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

Rooms before their send are ``early``'s (``EarlyRooms``, this class's base); the checks room info
must pass are ``room_info_checks``'; a room's own transitions are ``PrefillRoom``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdfabric_agent.memory.plan import decode_targets
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
from pdfabric_agent.rooms.early import EarlyRooms
from pdfabric_agent.rooms.room import PrefillRoom, Target
from pdfabric_agent.rooms.room_info_checks import aux_rows_mismatch, check_dst_layout, check_peer
from pdfabric_agent.rooms.targets import TargetSender
from pdfabric_core.duties import kv_shard_size
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank


class PrefillSender(EarlyRooms):
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.targets = TargetSender(ctx)

    # ------------------------------------------------------------ client API
    def submit_send(self, msg: SendRequest) -> RoomView:
        """Validate everything first; only a request that passes creates a room. A chunk after
        the first goes to its open room (``chunks.add_chunk``)."""
        ctx = self.ctx
        local = ctx.ranks.local(msg.rank, Role.PREFILL)
        local.check_engine_memory(msg.engine_memory)
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
        ctx.rooms.add(room)
        given_up = ctx.rooms.unsent.take_given_up((msg.rank, msg.room))
        if given_up is not None:
            self.targets.count_unstarted(room, Outcome.FAILED)
            ctx.rooms.finish(room, RoomState.FAILED, given_up)
            return room.view()
        if not sends:
            # A CP rank that does not send (only CP rank 0 without all-CP-ranks transfer), or a TP
            # rank whose replicated heads another rank sends: no work, and SGLang waits for it.
            room.end(RoomState.SUCCESS, self.why_nothing(local))
            ctx.rooms.retire(room)  # not counted as a request: the rank sends nothing
            return room.view()
        for agent_name in {t.agent for t in targets.values()}:
            if ctx.peers.is_blacklisted(agent_name):
                self.targets.count_unstarted(room, Outcome.FAILED)
                ctx.rooms.finish(room, RoomState.FAILED, ctx.peers.why_blacklisted(agent_name))
                return room.view()
        room.take_early_room_info(ctx.rooms.unsent.take_announced((msg.rank, msg.room)))
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

    # ------------------------------------------------------------ peer API
    def accept_dst(self, info: RoomInfo, sender_agent: str | None = None) -> RoomInfoTaken:
        """A decode agent's room info, from the agent of that decode rank, in the layout that rank
        has: its destinations are what this rank writes, so nothing in it is taken on trust."""
        ctx = self.ctx
        check_peer(ctx, info.prefill_rank, info.decode_rank, sender_agent)
        check_dst_layout(ctx, info)
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
        room.take_room_info(info)
        self._maybe_start(room)
        return RoomInfoTaken(early=False)

    def accept_cancel(self, msg: RoomCancel, sender_agent: str | None = None) -> CancelAnswer:
        """The decode side gave the room up: nothing more of this rank lands there. Room info not
        used yet is dropped (a send of the room then fails at once); an open room fails, its
        batches not yet sent are never sent. ``fenced``: no write of this rank into that decode
        room is in flight."""
        ctx = self.ctx
        check_peer(ctx, msg.prefill_rank, msg.decode_rank, sender_agent)
        key = (msg.prefill_rank, msg.room)
        reason = f"{msg.decode_rank} gave the room up: {msg.reason}"
        room = ctx.rooms.prefill_room(*key)
        if room is None:
            ctx.rooms.unsent.withdraw(key, msg.decode_rank)
            ctx.rooms.unsent.give_up(key, ctx.clock(), reason, replace=False)
            self._announce(msg.prefill_rank, msg.room)
            return CancelAnswer(fenced=True)
        room.target_of(msg.decode_rank)  # malformed before anything changes for a rank it does not send to
        self.abort(room, reason)
        return CancelAnswer(fenced=room.fenced(msg.decode_rank), state=room.state)

    # ------------------------------------------------------------ the send pipeline
    def _maybe_start(self, room: PrefillRoom) -> None:
        if not room.ready:
            return
        ctx = self.ctx
        local = ctx.ranks.by_id[room.rank]
        for t in room.targets.values():
            assert t.dst is not None
            if mismatch := aux_rows_mismatch(local, t.dst):
                self.abort(room, mismatch)
                return
        room.start_transfer(ctx.clock(), ctx.spec.transfer.timeout_seconds)
        # Each target's path is chosen here, once per chunk fed; a kernel path launches here too,
        # inside the API call that made the room ready, so the GPU starts before that call answers.
        self.targets.feed(room, local)
        ctx.tasks.spawn(self._run(room))

    def expire(self, room: PrefillRoom) -> None:
        """The tick found the room past its deadline (Transferring has its own deadline task)."""
        if room.state is RoomState.BOOTSTRAPPING:
            reason = f"no room info from {', '.join(room.missing_room_info())} in time"
            self.targets.count_unstarted(room, Outcome.TIMEOUT)
            self.ctx.rooms.finish(room, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)

    async def _run(self, room: PrefillRoom) -> None:
        ctx = self.ctx
        local = ctx.ranks.by_id[room.rank]
        try:
            sends = [self.targets.send_target(room, local, t) for t in room.targets.values()]
            await until_deadline(room, sends[0] if len(sends) == 1 else asyncio.gather(*sends), ctx.clock)
        except TimeoutError:
            agents = room.agents_not_done()
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
            ctx.rooms.finish(room, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)
            ctx.tasks.spawn(self._notify_failure(room, "transfer timed out"))
            return
        except Exception as exc:
            ctx.rooms.finish(room, RoomState.FAILED, str(exc))
            ctx.tasks.spawn(self._notify_failure(room, str(exc)))
            return
        ctx.rooms.finish(room, RoomState.SUCCESS)

    def abort(self, room: PrefillRoom, reason: str) -> None:
        """The engine gave the room up (its pages may be reused): Failed now, decode told."""
        if room.state.finished:
            return
        self.ctx.rooms.finish(room, RoomState.FAILED, reason)
        self.ctx.tasks.spawn(self._notify_failure(room, reason))

    async def _notify_failure(self, room: PrefillRoom, reason: str) -> None:
        for t in room.targets_not_done():
            report = DoneReport.failure(room.room, t.decode_rank, room.rank, reason, fenced=not t.writing)
            await self.targets.post_failure(t.agent, report)
