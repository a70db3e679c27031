"""The agent: the rooms of its ranks and the protocol between agents, behind the HTTP API.

Protocol between agents (every message a typed class in ``wire``):
1. decode client -> decode agent ``receive``: the room's destination pages/state slots/aux row.
   The decode agent pushes a ``RoomInfo`` (engine endpoint, pool bases and layout, indices) to the
   agent of every prefill (tp, cp, pp) rank it expects: POST /v1/peer/dst (``arrivals``).
2. prefill client -> prefill agent ``send``: source pages/state/aux. When the room info of every
   target decode rank is there (else Bootstrapping until the bootstrap deadline), the agent plans
   the targets, writes them through the rank's backend, then reports a ``DoneReport`` (bytes that
   landed, aux rows when they travel over the TCP side channel): POST /v1/peer/done (``sender``).
3. The decode room turns Success when every expected source reported; the prefill room turns
   Success when every report was acknowledged. That acknowledgement is "confirmed completion".
4. A room that fails on the decode side is cancelled at its sources (``RoomCancel``: POST
   /v1/peer/cancel); each answers whether its writes are over, and the room's destinations are
   free for the next room once all are (``claims``).
Either order of 1 and 2 works: early room info waits in the room registry.

Kernel path (a backend whose ``kernel`` is set, see fastpath/): when all of a target's data went
into kernel launches, the prefill agent posts a ``LaunchNotice`` with the launches' completion
marks while the kernels run: POST /v1/peer/launched; the decode agent watches the marks in shared
memory (``completion.CompletionWatcher``) and takes the source as arrived the moment the last word
is there. No done report follows; a failure after the notice still sends one (``ok: false``).

An engine learns its rooms' ends from its room feed and, where it offered one, its room board in
shared memory (``ranks/engine_board``). This class only wires the modules (docs/agent.md's code map).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdfabric_agent.memory.completion import CompletionWatcher
from pdfabric_agent.peers.client import PeerClient
from pdfabric_agent.peers.metadata import MetadataLoader
from pdfabric_agent.protocol.errors import ApiError, malformed, unknown_rank, unknown_room
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.peer_answers import CancelAnswer, RoomInfoTaken, SourceAnswer, TransferMetadata
from pdfabric_agent.protocol.peer_wire import DoneReport, LaunchNotice, RoomCancel, RoomInfo
from pdfabric_agent.protocol.views import FeedHello, MemoryAnswer, RoomState, RoomView
from pdfabric_agent.protocol.wire import AbortRequest, ReceiveRequest, SendRequest
from pdfabric_agent.ranks.engine_board import FEED_AFTER_BOARD_S, write_end
from pdfabric_agent.ranks.engine_memory import MemoryRules
from pdfabric_agent.ranks.local import LocalRank, NodeRanks
from pdfabric_agent.rooms.context import AgentContext
from pdfabric_agent.rooms.decode import DecodeArrivals
from pdfabric_agent.rooms.prefill import PrefillSender
from pdfabric_agent.rooms.registry import MetricLabels, RoomRegistry
from pdfabric_agent.rooms.room import DecodeRoom, PrefillRoom
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.config import AgentConfig
from pdfabric_agent.runtime.peer_series import PEERS
from pdfabric_agent.runtime.tasks import Liveness, TaskSet
from pdfabric_agent.service.membership import Adopted, check_adoptable
from pdfabric_agent.service.registration import register_engine_memory
from pdfabric_core.policy.types import Device, Role, Transport
from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec

log = logging.getLogger("pdfabric.agent")

FORGET_EVERY_S = 1.0  # finished rooms are forgotten in sweeps, not on every tick


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        rankmap: RankMap,
        spec: PDClusterSpec,
        ranks: Mapping[str, LocalRank],
        transport: Transport | str,
        clock: Callable[[], float] = time.monotonic,
        *,
        requested: Transport | str | None = None,
    ) -> None:
        """``transport``: what the agent carries KV over; ``requested``: what the rank map asked
        for, when the agent fell back from it (placement.fallback)."""
        self.cfg = cfg
        self.transport = Transport(transport)
        self.cluster = rankmap.cluster
        self.backend_name = spec.backend
        self.entry = rankmap.own_entry(cfg.pod_name, cfg.node_name)
        self.clock = clock
        labels = MetricLabels(rankmap.cluster, spec.backend, transport)
        liveness = Liveness(clock())
        peers = PeerClient(cfg, rankmap, spec.agent.peer_port, clock, liveness)
        workers = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="pdfabric-engine")
        self.ctx = AgentContext(
            cfg=cfg,
            ranks=NodeRanks(rankmap, spec, self.entry.name, ranks),
            rooms=RoomRegistry(labels, clock),
            peers=peers,
            tasks=TaskSet(),
            workers=workers,
            clock=clock,
            labels=labels,
            liveness=liveness,
            metadata=MetadataLoader(peers.get_json, workers),
        )
        self.rooms = self.ctx.rooms
        self.peers = self.ctx.peers
        self.peers.is_leaving = self.ctx.ranks.leaving.__contains__
        self.requested = self.transport if requested is None else Transport(requested)
        PEERS.limit = cfg.peer_series_max
        self.publish_peers()  # every (rank, peer agent) pair at zero, up to the bound
        self.ctx.rooms.on_retire.append(self._room_ended)
        self.sender = PrefillSender(self.ctx)
        self.arrivals = DecodeArrivals(self.ctx, CompletionWatcher(cfg.shm_dir))
        self._forget_due = 0.0
        self._heartbeat_due = clock() + cfg.heartbeat_s
        self._heartbeat_running = False
        self.probe_regions: dict[str, Any] = {}  # GET /v1/peer/probe: the ranks' link-check regions (probe.py)

    @property
    def ranks(self) -> dict[str, LocalRank]:
        return self.ctx.ranks.by_id

    @property
    def rankmap(self) -> RankMap:
        return self.ctx.rankmap

    @property
    def spec(self) -> PDClusterSpec:
        return self.ctx.spec

    # ---------------------------------------------------------------- membership
    def pair_paths(self) -> dict[str, tuple[str, str]]:
        """Per local rank: (path to a peer on this node, path to a peer on another node), as its
        backend declares them."""
        return {rid: lr.backend.pair_paths for rid, lr in self.ranks.items()}

    def publish_peers(self) -> None:
        """The per-peer series of every pair the rank map names, and how many agents it lists."""
        rankmap, spec, me = self.rankmap, self.spec, self.entry.name
        PEERS.publish(rankmap, spec, me, self.requested.value, self.transport.value, self.pair_paths())
        metrics.rankmap_peers.labels(self.cluster, "current").set(len(rankmap.agents))
        metrics.rankmap_peers.labels(self.cluster, "leaving").set(len(self.ctx.ranks.leaving))

    @property
    def leave_grace_s(self) -> float:
        """How long an agent a newer rank map dropped stays a peer: the longest a room may take."""
        return self.cfg.bootstrap_timeout_s + self.spec.transfer.timeout_seconds

    def adopt(self, rankmap: RankMap) -> Adopted:
        """Run on a newer rank map from now on (``membership``); MembershipRefused, and the map
        in use unchanged, when this agent cannot."""
        spec = check_adoptable(self.rankmap, self.spec, rankmap, self.entry.name)
        added, dropped = self.ctx.ranks.adopt(rankmap, spec, self.clock() + self.leave_grace_s)
        for name in added:  # a name seen before is a new pod now: no old record holds against it
            self.peers.forget(name)
        self.publish_peers()
        return Adopted(rankmap.digest, tuple(added), tuple(dropped))

    def _forget_left(self, now: float) -> None:
        """Agents whose leave is over: rooms still waiting on them fail, saying so; they are forgotten."""
        for entry in self.ctx.ranks.left(now):
            reason = f"agent {entry.name} left the cluster's rank map (its replica was scaled away)"
            failed = 0
            for _, room in self.rooms.open_rooms():
                if room.state.finished:
                    continue
                if isinstance(room, PrefillRoom) and entry.name in room.agents_not_done():
                    self.sender.abort(room, reason)
                    failed += 1
                elif isinstance(room, DecodeRoom) and entry.name in room.sources_not_arrived().values():
                    self.arrivals.give_up(room, reason)
                    failed += 1
            self.peers.forget(entry.name)
            PEERS.forget_peer(entry.name)
            metrics.rankmap_peers.labels(self.cluster, "leaving").set(len(self.ctx.ranks.leaving))
            log.info("%s: forgotten%s", reason, f"; {failed} rooms still waiting on it failed" if failed else "")

    # ---------------------------------------------------------------- identity
    def check_token(self, header: str | None) -> None:
        expected = f"Bearer {self.cfg.token}"
        if header is None or not hmac.compare_digest(header.encode(), expected.encode()):
            raise ApiError(401, Refusal.UNAUTHORIZED, "missing or wrong engine token")

    def check_cluster(self, body: Mapping[str, Any]) -> None:
        cluster = body.get("cluster")
        if cluster != self.rankmap.cluster_uid:
            rm = self.rankmap
            raise ApiError(
                403,
                Refusal.WRONG_CLUSTER,
                f"request is for cluster {cluster!r}; this agent serves {rm.namespace}/{rm.cluster} "
                f"(uid {rm.cluster_uid})",
            )

    # ---------------------------------------------------------------- the API
    def register_memory(self, msg: MemoryRegistration) -> MemoryAnswer:
        """An engine's own buffers become the rank's memory (``registration``)."""
        backend = self.ctx.ranks.served(msg.rank).backend
        rules = MemoryRules.of(
            self.spec, self.transport, self.requested, backend.device_memory, backend.host_memory_only_because
        )
        return register_engine_memory(self.ctx, msg, rules, shm_dir=self.cfg.shm_dir, cluster=self.cluster)

    async def abort(self, msg: AbortRequest) -> RoomView:
        """The engine gave the room up: it fails now (its peers are told: a decode room answers
        once its sources said whether they stopped writing); a finished room stays as it ended. A
        prefill room not sent yet is given up too: decode sides that announced it are told at once,
        and later ones are refused (``PrefillSender.give_up_unsent``); so is a decode room not
        submitted yet whose prefill replica the engine names (``DecodeArrivals.give_up_unannounced``).
        404 for another decode room the agent does not hold."""
        local = self.ctx.ranks.served(msg.rank)
        if local.rank.role is Role.PREFILL and self.rooms.get(Role.PREFILL, msg.rank, msg.room) is None:
            self.sender.give_up_unsent(msg.rank, msg.room, msg.reason)
            view = self.sender.early_view(msg.rank, msg.room)  # Failed, with the reason
            if view is None:
                raise unknown_room(msg.room, msg.rank)
            return view
        decode_unannounced = local.rank.role is Role.DECODE and self.rooms.get(Role.DECODE, msg.rank, msg.room) is None
        if decode_unannounced and msg.peer_replica is not None:
            told = self.arrivals.give_up_unannounced(local, msg.room, msg.peer_replica, msg.reason, msg.peer_dp)
            return RoomView(rank=msg.rank, room=msg.room, state=RoomState.FAILED, reason=msg.reason, told=told)
        room = self.rooms.lookup(local.rank.role, msg.rank, msg.room)
        if isinstance(room, DecodeRoom):
            await self.arrivals.abort(room, msg.reason)
        elif isinstance(room, PrefillRoom):
            self.sender.abort(room, msg.reason)
        return room.view()

    def engine_exited(self, rank_ids: Sequence[str], reason: str) -> int:
        """The serving engine of these ranks exited (the supervisor says so before restarting
        it): every open room of theirs fails now with ``reason``, peers told as for ``abort``, so a
        decode engine waiting on a dead prefill engine's KV is Failed without waiting out the
        bootstrap deadline. Then the shared-memory files of the ranks' engine registrations are
        unlinked (only files in the shm directory): a crash loop cannot fill /dev/shm. This
        process's mappings stay valid until the restarted engine registers again, which
        ``register_memory`` takes once the rank has no open rooms. Room info that waited for a
        prefill rank's sends is dropped and its decode sides told, fenced
        (``PrefillSender.forget_room_info``). Returns the rooms failed or told."""
        ranks = set(rank_ids)
        failed = 0
        for _, room in self.rooms.open_rooms():
            if room.rank not in ranks or room.state.finished:
                continue
            if isinstance(room, DecodeRoom):
                self.arrivals.give_up(room, reason)
            elif isinstance(room, PrefillRoom):
                self.sender.abort(room, reason)
            failed += 1
        failed += self.sender.forget_room_info(ranks, reason)
        shm_dir = os.path.realpath(self.cfg.shm_dir)
        for rank_id in sorted(ranks):
            local = self.ranks.get(rank_id)
            if local is None or local.engine is None:
                continue
            paths = {r.handle for r in local.engine.regions() if r.device is Device.CPU and r.handle}
            for path in sorted(paths):
                if os.path.dirname(os.path.realpath(path)) != shm_dir:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    log.info("unlinked %s of the exited engine of %s", path, rank_id)
        if failed:
            log.warning("%s: %d open rooms failed (%s)", ", ".join(sorted(ranks)), failed, reason)
        return failed

    def submit_send(self, msg: SendRequest) -> RoomView:
        return self.sender.submit_send(msg)

    def submit_receive(self, msg: ReceiveRequest) -> RoomView:
        return self.arrivals.submit_receive(msg)

    # Peer messages: `sender_agent` is the agent the peer door authenticated (its certificate).
    def accept_dst(self, msg: RoomInfo, sender_agent: str | None = None) -> RoomInfoTaken:
        return self.sender.accept_dst(msg, sender_agent)

    async def accept_done(self, msg: DoneReport, sender_agent: str | None = None) -> SourceAnswer:
        return await self.arrivals.accept_done(msg, sender_agent)

    def accept_launched(self, msg: LaunchNotice, sender_agent: str | None = None) -> SourceAnswer:
        return self.arrivals.accept_launched(msg, sender_agent)

    def accept_cancel(self, msg: RoomCancel, sender_agent: str | None = None) -> CancelAnswer:
        return self.sender.accept_cancel(msg, sender_agent)

    def transfer_metadata(self, rank_id: str) -> TransferMetadata:
        """A local rank's transfer metadata, for a peer's backend to load before writing there
        (GET /v1/peer/metadata: peers.metadata)."""
        local = self.ctx.ranks.by_id.get(rank_id)
        if local is None:
            raise unknown_rank(f"{rank_id!r} is not a rank of agent {self.entry.name}")
        described = local.backend.local_metadata()
        if described is None:
            raise malformed(
                f"{rank_id} runs backend {local.backend.name}, whose engines handshake on their own: it hands out "
                "no transfer metadata"
            )
        return TransferMetadata(rank_id, *described)

    async def poll(self, rank_id: str, room_id: int, wait_s: float = 0.0) -> RoomView:
        """The room's view; with wait_s > 0, answer as soon as it is final or wait_s passed (a
        long poll: a serving engine learns completion without polling the agent's CPU away)."""
        early = self.sender.early_view(rank_id, room_id)
        if early is not None:
            return early
        local = self.ctx.ranks.served(rank_id)
        room = self.rooms.lookup(local.rank.role, rank_id, room_id)
        if wait_s > 0 and not room.state.finished:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await room.finished_event.wait()
        return room.view()

    # ---------------------------------------------------------------- the room feed
    def feed_hello(self, rank_id: str) -> FeedHello:
        """What holds for every room of a rank its engine subscribes for (404 for a rank this
        agent does not serve)."""
        local = self.ctx.ranks.served(rank_id)
        if local.rank.role is Role.PREFILL and not self.sender.sends_anything(local):
            return FeedHello(rank_id, sends=False, reason=self.sender.why_nothing(local))
        return FeedHello(rank_id)

    def feed_snapshot(self, rank_id: str) -> list[RoomView]:
        """Every room of the rank the agent holds (open, or ended and still remembered), and for a
        prefill rank its rooms not sent yet that decode announced or gave up."""
        local = self.ctx.ranks.served(rank_id)
        views = [room.view() for room in self.rooms.rooms_of(local.rank.role, rank_id)]
        if local.rank.role is Role.PREFILL:
            views += self.sender.unsent_views(rank_id)
        return views

    def _room_ended(self, room: DecodeRoom | PrefillRoom) -> None:
        local, watched = self.ranks.get(room.rank), self.ctx.feed.watched(room.rank)
        view = room.view() if watched or (room.board_slot is not None and local is not None) else None
        if view is not None:
            on_board = write_end(local.board if local is not None else None, room.board_slot, view)  # next poll's
            if watched:
                self.ctx.feed.publish(view, after_s=FEED_AFTER_BOARD_S if on_board else 0.0)

    # ---------------------------------------------------------------- upkeep
    async def tick(self) -> None:
        """Deadlines, heartbeats, probes of blacklisted peers, forgetting old rooms; called
        periodically."""
        now = self.clock()
        self.ctx.liveness.tick(now)
        if self.ctx.ranks.leaving:
            self._forget_left(now)
        if now >= self._heartbeat_due and not self._heartbeat_running:
            self._heartbeat_due = now + self.cfg.heartbeat_s
            self._heartbeat_running = True
            self.ctx.tasks.spawn(self._heartbeat())
        for _, room in self.rooms.open_rooms():
            if not room.expired(now) or room.state.finished:
                continue
            if isinstance(room, PrefillRoom):
                self.sender.expire(room)
            elif isinstance(room, DecodeRoom):
                self.arrivals.expire(room)
        for agent_name in self.peers.due_probes():  # probes run beside the tick, never inside it
            self.ctx.tasks.spawn(self.peers.reprobe(agent_name))
        self.arrivals.claims.sweep(now)
        if now >= self._forget_due:
            self._forget_due = now + FORGET_EVERY_S
            self.rooms.forget(now, self.cfg.room_ttl_s, self.cfg.bootstrap_timeout_s)
            for stream in self.peers.idle_streams(now):  # a 60 s bound: once a sweep is enough
                self.ctx.tasks.spawn(stream.close())

    async def _heartbeat(self) -> None:
        try:
            await self.arrivals.heartbeat(min(2.0, self.cfg.heartbeat_s))
        finally:
            self._heartbeat_running = False

    async def close(self) -> None:
        self.ctx.tasks.cancel_all()
        await self.peers.close()
        self.arrivals.completions.close()
        self.ctx.workers.shutdown(wait=False, cancel_futures=True)
