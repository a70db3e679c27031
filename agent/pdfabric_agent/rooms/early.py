"""A prefill rank's rooms before their send, as the prefill side answers for them: the room info
a decode side announced early (the send takes it), the rooms given up before their send (a send
of one then fails at once), and what the rank's engine sees of them (``early_view``: upstream's
Bootstrapping / WaitingForInput, so a prefill engine can see decode is ready). ``EarlyRooms`` is
``PrefillSender``'s base: what it keeps of these rooms is the registry's ``UnsentRooms``."""

from __future__ import annotations

from pdfabric_agent.memory.plan import decode_targets
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.targets import TargetSender
from pdfabric_core.duties import prefill_rank_sends
from pdfabric_core.policy.types import Role


class EarlyRooms:
    """The prefill side's rules for rooms not sent yet (``PrefillSender`` sets both attributes)."""

    ctx: AgentContext
    targets: TargetSender

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
