"""A decode room's sources, once their writes into it are over or must stop: a source is quiet
when it arrived, reported after writing, or answered a ``RoomCancel`` fenced; a failed room whose
sources are all quiet gives its destinations back (``claims``), else they are held for the
transfer timeout. The cancels are sent here, and those of a room its engine gave up before it was
submitted. ``SourceCancels`` is ``DecodeArrivals``' base."""

from __future__ import annotations

import asyncio
import logging

from pdfabric_agent.memory.plan import expected_sources
from pdfabric_agent.peers.client import PEER_ERRORS
from pdfabric_agent.protocol.errors import out_of_range
from pdfabric_agent.protocol.peer_answers import CancelAnswer
from pdfabric_agent.protocol.peer_wire import RoomCancel
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.claims import DestinationClaims
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.room import AnyRoom, DecodeRoom
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank

log = logging.getLogger("pdfabric.agent")

CANCEL_TIMEOUT_S = 2.0  # a source that does not answer a cancel in time keeps the room's hold


class SourceCancels:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.claims = DestinationClaims(ctx.clock)
        ctx.rooms.on_retire.append(self._retired)

    def _retired(self, room: AnyRoom) -> None:
        if not isinstance(room, DecodeRoom) or room.claim is None:
            return
        if room.state is RoomState.SUCCESS or room.sources_quiet:
            self.claims.release(room.rank, room.claim)
        else:  # a source may still be writing until its own deadline (or until it says it stopped)
            self.claims.hold(room.rank, room.claim, self.ctx.clock() + self.ctx.spec.transfer.timeout_seconds)

    def _quiet(self, room: DecodeRoom, prefill_rank: str) -> None:
        """This source writes nothing more into the room: a failed room whose sources are all
        quiet gives its destinations back now."""
        became_quiet = room.source_quiet(prefill_rank)
        if room.state.finished and room.sources_quiet and room.claim is not None:
            self.claims.release(room.rank, room.claim)
        if room.state.finished and became_quiet and self.ctx.feed.watched(room.rank):
            self.ctx.feed.publish(room.view())  # its engine may release the room's pages now

    def give_up_unannounced(
        self, local: LocalRank, room_id: int, peer_replica: int, reason: str, peer_dp: int = 0
    ) -> int:
        """The engine gave up a room before submitting it (SGLang aborted the request while it
        waited for its prefill side): each prefill rank it was to come from is told, so its engine's
        request fails now instead of at its bootstrap deadline. Nothing was announced or written,
        so nothing waits for the answers. Returns the prefill ranks told."""
        ctx = self.ctx
        replicas = ctx.ranks.peer_replicas(Role.PREFILL)
        if not 0 <= peer_replica < replicas:
            raise out_of_range(f"peer_replica {peer_replica} is outside 0..{replicas - 1}")
        if not 0 <= peer_dp < ctx.spec.prefill.dp:
            raise out_of_range(f"peer_dp {peer_dp} is outside 0..{ctx.spec.prefill.dp - 1}")
        sources = expected_sources(ctx.spec, local.rank.tp_rank, local.rank.pp_rank)
        for p, c, s in sources:
            prefill_rank = Rank(Role.PREFILL, peer_replica, p, c, s, dp_rank=peer_dp).rank_id
            msg = RoomCancel(room_id, local.rank.rank_id, prefill_rank, reason)
            ctx.tasks.spawn(self._post_cancel(ctx.ranks.agent_for(prefill_rank), msg))
        return len(sources)

    async def _post_cancel(self, agent_name: str, msg: RoomCancel) -> CancelAnswer | None:
        """Send one cancel: the source's answer, or None when it did not take it (a room it may
        still write into stays held; an unannounced room's engine learns at its deadline)."""
        try:
            return await self.ctx.peers.post(agent_name, msg, CANCEL_TIMEOUT_S)
        except PEER_ERRORS as exc:
            log.info("room %s: %s did not take the cancel (%s)", msg.room, agent_name, exc)
            return None

    async def _cancel_sources(self, room: DecodeRoom, reason: str) -> None:
        ctx = self.ctx

        async def cancel(prefill_rank: str, agent_name: str) -> None:
            answer = await self._post_cancel(agent_name, RoomCancel(room.room, room.rank, prefill_rank, reason))
            if answer is not None and answer.fenced:
                self._quiet(room, prefill_rank)

        await asyncio.gather(
            *(
                cancel(r, a)
                for r, a in sorted(room.expected.items())
                if r not in room.quiet and not ctx.peers.is_blacklisted(a)
            )
        )
