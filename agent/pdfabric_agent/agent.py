"""The agent's core: the rooms of its ranks, the request state machine, the peer protocol.

Protocol between agents (all over the token-protected API, JSON):
1. decode client -> decode agent ``receive``: the room's destination pages/state slots/aux row.
   The decode agent pushes its room info (engine endpoint, pool bases and layout, indices) to the
   agent of every prefill (tp, cp) rank it expects (``expected_sources``): POST /v1/peer/dst.
2. prefill client -> prefill agent ``send``: source pages/state/aux. When the room info of every
   target decode rank is there (else Bootstrapping until the bootstrap deadline), the agent plans
   blocks (``plan``), writes them through the rank's backend in chunks, then reports
   POST /v1/peer/done (bytes that landed, aux rows when they travel over the TCP side channel).
3. The decode room turns Success when every expected source reported; the prefill room turns
   Success when every report was acknowledged. That acknowledgement is "confirmed completion".
Either order of 1 and 2 works: early room info waits in ``_early_dst``.

Kernel path (a backend that launches and names completion marks, see fastpath/): when all of a
target's data went into kernel launches, the prefill agent posts /v1/peer/launched with the
launches' completion marks right after launching, while the kernels run; the decode agent watches
the marks in shared memory (``completion.CompletionWatcher``) and takes the source as arrived the
moment the last word is there. No done report follows; a failure after the notice still sends
one (``ok: false``). If the notice is refused, the done report goes as above.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdfabric_agent import metrics
from pdfabric_agent.backend import TransferBackend, TransferError
from pdfabric_agent.completion import CompletionMark, CompletionWatcher
from pdfabric_agent.config import AgentConfig
from pdfabric_agent.metrics import Completion, Kind, Outcome, Refusal
from pdfabric_agent.peers import PeerHealth
from pdfabric_agent.plan import (
    Bases,
    Block,
    TransferPlan,
    decode_targets,
    expected_sources,
    plan_transfer,
    sender_duties,
)
from pdfabric_agent.pools import PoolLayout, RankPools
from pdfabric_agent.rooms import (
    ApiError,
    DecodeRoom,
    PrefillRoom,
    Room,
    RoomState,
    Target,
    check_index,
    field_indices,
    field_int,
    field_str,
    malformed,
    pack_indices,
)
from pdfabric_core.policy.chunking import chunk_batch
from pdfabric_core.policy.rank_mapping import decode_pp_stage, sending_cp_ranks
from pdfabric_core.rankmap import Rank, RankMap
from pdfabric_core.spec import PDClusterSpec

log = logging.getLogger("pdfabric.agent")

TCP_SIDE_CHANNEL = "tcp-side-channel"  # `path` label of aux rows sent in the done report
# Block lists up to this size are launched from the event loop (a table built in microseconds);
# larger ones are planned in a worker thread.
LOOP_SUBMIT_BLOCKS = 256


@dataclass
class LocalRank:
    rank: Rank
    backend: TransferBackend
    pools: RankPools

    @property
    def layout(self) -> PoolLayout:
        return self.pools.layout

    @property
    def bases(self) -> Bases:
        return Bases(self.pools.kv.addr, self.pools.state.addr, self.pools.aux.addr)


@dataclass(frozen=True)
class RoomRequest:
    """A send or receive request after validation."""

    rank_id: str
    local: LocalRank
    room_id: int
    pages: list[int]
    state: list[int]
    aux: int | None
    peer_replica: int


@dataclass
class Launch:
    """One target's kernel batches, launched without waiting (``Agent._start_target``)."""

    plan: TransferPlan
    peer: str
    by_path: dict[str, dict[str, int]] = field(default_factory=dict)
    launched: list[tuple[Any, Kind, int, int]] = field(default_factory=list)  # (handle, kind, bytes, units)
    later: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # what the kernel did not take
    notice: asyncio.Future[dict[str, Any]] | None = None  # the completion marks on their way to decode
    error: Exception | None = None  # a launch failed after others went: raised once they landed


def refuse_active_room(old: Room | None, room_id: int, rank_id: str) -> None:
    """A room id is reusable once finished; while active a second submit is a conflict."""
    if old is not None and not old.state.finished:
        raise ApiError(409, Refusal.CONFLICT, f"room {room_id} is already {old.state.title} on {rank_id}")


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        rankmap: RankMap,
        spec: PDClusterSpec,
        ranks: Mapping[str, LocalRank],
        transport: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rankmap = rankmap
        self.spec = spec
        self.ranks = dict(ranks)
        self.transport = transport
        self.cluster = rankmap.cluster
        self.entry = rankmap.agent_for_node(cfg.node_name)
        self.clock = clock
        self.health = PeerHealth(cfg.probe_backoff_s, cfg.probe_backoff_max_s, clock)
        self.prefill_rooms: dict[tuple[str, int], PrefillRoom] = {}
        self.decode_rooms: dict[tuple[str, int], DecodeRoom] = {}
        self._early_dst: dict[tuple[str, int], dict[str, tuple[float, dict[str, Any]]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="pdfabric-engine")
        self._http: aiohttp.ClientSession | None = None
        # Rooms not yet final, scanned every tick; finished ones wait in finish order for their TTL,
        # so the tick never walks the (large) history of finished rooms.
        self._open: dict[tuple[str, str, int], PrefillRoom | DecodeRoom] = {}
        self._finished: collections.deque[tuple[float, str, tuple[str, int], PrefillRoom | DecodeRoom]] = (
            collections.deque()
        )
        self._gc_due = 0.0
        self._probing: set[str] = set()
        self._heartbeat_due = clock() + cfg.heartbeat_s
        self._heartbeat_running = False
        self._missed: dict[str, int] = {}  # prefill agent -> consecutive missed heartbeats
        self.backend_name = spec.backend
        self.completions = CompletionWatcher(cfg.shm_dir)  # kernel senders' completion words

    # ---------------------------------------------------------------- identity and peers
    def check_token(self, header: str | None) -> None:
        expected = f"Bearer {self.cfg.token}"
        if header is None or not hmac.compare_digest(header.encode(), expected.encode()):
            raise ApiError(401, Refusal.UNAUTHORIZED, "missing or wrong cluster token")

    def check_cluster(self, body: Mapping[str, Any]) -> None:
        cluster = body.get("cluster")
        if cluster != self.rankmap.cluster_uid:
            raise ApiError(
                403,
                Refusal.WRONG_CLUSTER,
                f"request is for cluster {cluster!r}; this agent serves {self.rankmap.namespace}/"
                f"{self.rankmap.cluster} (uid {self.rankmap.cluster_uid})",
            )

    def peer_address(self, agent_name: str) -> str:
        if agent_name in self.cfg.peers:
            return self.cfg.peers[agent_name]
        host = self.cfg.peer_host_template.format(
            name=agent_name, cluster=self.rankmap.cluster, namespace=self.rankmap.namespace
        )
        return f"{host}:{self.spec.agent.api_port}"

    def _local(self, rank_id: str, role: str) -> LocalRank:
        local = self.ranks.get(rank_id)
        if local is None:
            raise ApiError(404, Refusal.UNKNOWN_RANK, f"rank {rank_id!r} is not served by agent {self.entry.name}")
        if local.rank.role != role:
            raise malformed(f"rank {rank_id!r} is a {local.rank.role} rank, not {role}")
        return local

    def _agent_for(self, rank_id: str) -> str:
        try:
            return self.rankmap.agent_for_rank(rank_id).name
        except LookupError as exc:
            raise ApiError(404, Refusal.UNKNOWN_RANK, str(exc)) from None

    async def _http_session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.cfg.token}"})
        return self._http

    async def _post_peer(self, agent_name: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        session = await self._http_session()
        url = f"http://{self.peer_address(agent_name)}{path}"
        body = {**body, "cluster": self.rankmap.cluster_uid}
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"{agent_name} refused {path}: HTTP {resp.status} {data.get('error', '')}")
            return data

    async def probe_peer(self, agent_name: str, timeout_s: float = 2.0) -> bool:
        session = await self._http_session()
        try:
            url = f"http://{self.peer_address(agent_name)}/v1/peer/ping"
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _labels(self, role: str, path: str) -> tuple[str, str, str, str, str]:
        return (self.cluster, role, self.backend_name, self.transport, path)

    def _finish(
        self,
        room: PrefillRoom | DecodeRoom,
        role: str,
        state: RoomState,
        reason: str = "",
        *,
        outcome: Outcome | None = None,
    ) -> None:
        if room.state.finished:
            return
        room.state = state
        room.reason = reason
        self._retire(role, room)
        if state is RoomState.SUCCESS:
            duration = room.finished_at - room.submitted

            def count() -> None:
                metrics.requests.labels(self.cluster, role, Outcome.SUCCESS.value).inc()
                metrics.request_duration.labels(self.cluster, role, self.backend_name, self.transport).observe(duration)

            self._later(count)
        else:
            metrics.requests.labels(self.cluster, role, (outcome or Outcome.FAILED).value).inc()
            log.warning("%s room %s on %s failed: %s", role, room.room, room.rank, reason)

    def _track(self, role: str, room: PrefillRoom | DecodeRoom) -> None:
        self._open[(role, room.rank, room.room)] = room

    def _retire(self, role: str, room: PrefillRoom | DecodeRoom) -> None:
        """The room is final: wake long polls, stop scanning it, queue it for forgetting."""
        room.finished_at = self.clock()
        room.finished_event.set()
        if self._open.get((role, room.rank, room.room)) is room:
            del self._open[(role, room.rank, room.room)]
        self._finished.append((room.finished_at, role, (room.rank, room.room), room))

    def _blacklist(self, agent_name: str, reason: str) -> None:
        self.health.fail(agent_name, reason)
        metrics.peers_blacklisted.labels(self.cluster).set(len(self.health.blacklisted))

    # ---------------------------------------------------------------- client API: shared
    def _room_request(self, body: Mapping[str, Any], role: str, *, unique: bool) -> RoomRequest:
        """Validate what send and receive share; the peer replica is the other role's."""
        self.check_cluster(body)
        rank_id = field_str(body, "rank")
        local = self._local(rank_id, role)
        room_id = field_int(body, "room")
        assert room_id is not None
        layout = local.layout
        pages = field_indices(body, "kv_pages", layout.kv_pages, what="KV pages", unique=unique)
        state = field_indices(body, "state_indices", layout.state_slots, what="state slots", unique=unique)
        aux = field_int(body, "aux_index", optional=True)
        check_index(aux, layout.aux_slots, name="aux_index")
        peer_role, peer_replicas = (
            ("decode", self.spec.decode.replicas) if role == "prefill" else ("prefill", self.spec.prefill.replicas)
        )
        replica = field_int(body, f"{peer_role}_replica")
        assert replica is not None
        if replica >= peer_replicas:
            raise ApiError(400, Refusal.OUT_OF_RANGE, f"{peer_role}_replica {replica} outside 0..{peer_replicas - 1}")
        return RoomRequest(rank_id, local, room_id, pages, state, aux, replica)

    # ---------------------------------------------------------------- client API: prefill
    def submit_send(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Validate everything first; only a request that passes creates a room."""
        req = self._room_request(body, "prefill", unique=False)
        rank_id, local, room_id, replica = req.rank_id, req.local, req.room_id, req.peer_replica
        src_pages, src_state, src_aux = req.pages, req.state, req.aux
        feeds = self.rankmap.feeds.get(local.rank.replica)
        if feeds is not None and replica not in feeds:
            raise ApiError(
                400,
                Refusal.OUT_OF_RANGE,
                f"prefill replica {local.rank.replica} does not feed decode replica {replica}",
            )
        key = (rank_id, room_id)
        refuse_active_room(self.prefill_rooms.get(key), room_id, rank_id)
        targets: dict[str, Target] = {}
        for route in decode_targets(self.spec, local.rank.tp_rank):
            decode_rank = Rank("decode", replica, route.decode_tp_rank, 0, self._decode_stage(local)).rank_id
            agent = self._agent_for(decode_rank)
            targets[decode_rank] = Target(decode_rank, route.decode_tp_rank, agent)
        now = self.clock()
        room = PrefillRoom(
            rank=rank_id,
            room=room_id,
            submitted=now,
            deadline=now + self.cfg.bootstrap_timeout_s,
            src_pages=src_pages,
            src_state=src_state,
            src_aux=src_aux,
            targets=targets,
        )
        self.prefill_rooms[key] = room
        self._track("prefill", room)
        if not self._sends_anything(local):
            # Without all-CP-ranks transfer only CP rank 0 sends; the other ranks have no work.
            room.state = RoomState.SUCCESS
            room.reason = f"CP rank {local.rank.cp_rank} sends nothing for this spec"
            self._retire("prefill", room)
            return room.view()
        for agent_name in {t.agent for t in targets.values()}:
            if self.health.is_blacklisted(agent_name):
                self._finish(
                    room,
                    "prefill",
                    RoomState.FAILED,
                    f"peer agent {agent_name} is blacklisted: {self.health.reason(agent_name)}",
                )
                return room.view()
        for decode_rank, (_, info) in self._early_dst.pop(key, {}).items():
            if decode_rank in targets:
                targets[decode_rank].dst = info
        self._maybe_start(room)
        return room.view()

    def _decode_stage(self, local: LocalRank) -> int:
        return decode_pp_stage(local.rank.pp_rank, self.spec.prefill.pp, self.spec.decode.pp)

    def _sends_anything(self, local: LocalRank) -> bool:
        p = self.spec.prefill
        return local.rank.cp_rank in sending_cp_ranks(
            p.cp, all_cp_ranks_transfer=p.all_cp_ranks_transfer, dsa_cache_layer_split=p.dsa_cache_layer_split
        )

    def _maybe_start(self, room: PrefillRoom) -> None:
        if room.state is RoomState.BOOTSTRAPPING and all(t.dst is not None for t in room.targets.values()):
            room.state = RoomState.TRANSFERRING
            room.marks["transferring"] = self.clock()
            room.deadline = self.clock() + self.spec.transfer.timeout_seconds
            local = self.ranks[room.rank]
            started: dict[str, Launch | Exception] = {}
            if hasattr(local.backend, "submit_pages"):
                # A kernel backend launches here, inside the API call that made the room ready,
                # so the GPU starts before that call answers; the task below only waits.
                for t in room.targets.values():
                    try:
                        started[t.decode_rank] = self._start_target(room, local, t)
                    except Exception as exc:  # raised where the task would have raised it
                        started[t.decode_rank] = exc
            self._spawn(self._run_prefill(room, started))

    # ---------------------------------------------------------------- peer API: prefill side
    def accept_dst(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.check_cluster(body)
        rank_id = field_str(body, "prefill_rank")
        local = self._local(rank_id, "prefill")
        room_id = field_int(body, "room")
        assert room_id is not None
        decode_rank = field_str(body, "decode_rank")
        for name in ("endpoint", "layout", "bases", "kv_pages", "state_indices"):
            if name not in body:
                raise malformed(f"peer room info lacks {name!r}")
        try:
            dst_layout = PoolLayout.from_dict(body["layout"])
            bases = Bases(**body["bases"])
        except (TypeError, KeyError) as exc:
            raise malformed(f"peer room info has a bad layout or bases: {exc}") from None
        if not all(isinstance(v, int) and v > 0 for v in (bases.kv, bases.state, bases.aux)):
            raise malformed("peer room info bases must be positive integers")
        if not isinstance(body["endpoint"], str) or not body["endpoint"]:
            raise malformed("peer room info endpoint must be a non-empty string")
        dst_pages = field_indices(body, "kv_pages", dst_layout.kv_pages, what="KV pages", unique=True)
        dst_state = field_indices(body, "state_indices", dst_layout.state_slots, what="state slots", unique=True)
        check_index(field_int(body, "aux_index", optional=True), dst_layout.aux_slots, name="aux_index")
        valid = {
            Rank("decode", r, route.decode_tp_rank, 0, self._decode_stage(local)).rank_id
            for r in range(self.spec.decode.replicas)
            for route in decode_targets(self.spec, local.rank.tp_rank)
        }
        if decode_rank not in valid:
            raise malformed(f"{decode_rank} is not fed by {rank_id}")
        key = (rank_id, room_id)
        info = dict(body)
        # Parsed once, here, not on the send path.
        info.update(layout=dst_layout, bases=bases, kv_pages=dst_pages, state_indices=dst_state)
        room = self.prefill_rooms.get(key)
        if room is not None and room.state is RoomState.BOOTSTRAPPING and decode_rank in room.targets:
            room.targets[decode_rank].dst = info
            self._maybe_start(room)
            return {"accepted": "room"}
        # The decode side was first (or the previous use of this room id finished): keep it.
        self._early_dst.setdefault(key, {})[decode_rank] = (self.clock(), info)
        return {"accepted": "early"}

    async def _run_prefill(self, room: PrefillRoom, started: Mapping[str, Launch | Exception]) -> None:
        local = self.ranks[room.rank]
        try:
            remaining = max(0.0, room.deadline - self.clock())
            sends = [self._send_target(room, local, t, started.get(t.decode_rank)) for t in room.targets.values()]
            await asyncio.wait_for(sends[0] if len(sends) == 1 else asyncio.gather(*sends), timeout=remaining)
        except TimeoutError:
            agents = sorted({t.agent for t in room.targets.values() if not t.done})
            for agent_name in agents:
                self._blacklist(agent_name, f"room {room.room} timed out")
            self._finish(
                room,
                "prefill",
                RoomState.FAILED,
                f"transfer did not complete within {self.spec.transfer.timeout_seconds:g} s "
                f"(peers {', '.join(agents)})",
                outcome=Outcome.TIMEOUT,
            )
            self._spawn(self._notify_failure(room, "transfer timed out"))
            return
        except Exception as exc:
            self._finish(room, "prefill", RoomState.FAILED, str(exc))
            self._spawn(self._notify_failure(room, str(exc)))
            return
        self._finish(room, "prefill", RoomState.SUCCESS)

    async def _notify_failure(self, room: PrefillRoom, reason: str) -> None:
        for t in room.targets.values():
            if t.done or self.health.is_blacklisted(t.agent):
                continue
            with contextlib.suppress(Exception):
                await self._post_peer(
                    t.agent,
                    "/v1/peer/done",
                    {
                        "room": room.room,
                        "decode_rank": t.decode_rank,
                        "prefill_rank": room.rank,
                        "ok": False,
                        "reason": reason,
                    },
                    2.0,
                )

    def _prepare(self, room: PrefillRoom, local: LocalRank, target: Target) -> tuple[TransferPlan, str]:
        """Before any write to a target, kernel or engine: its peer is admitted, its room planned."""
        if self.health.is_blacklisted(target.agent):
            raise TransferError(f"peer agent {target.agent} is blacklisted: {self.health.reason(target.agent)}")
        try:
            planned = self._plan_target(room, local, target)
        except ValueError as exc:
            raise ValueError(f"cannot plan {room.rank} -> {target.decode_rank}: {exc}") from None
        room.marks[f"planned:{target.decode_rank}"] = self.clock()
        return planned

    def _plan_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> tuple[TransferPlan, str]:
        dst = target.dst
        assert dst is not None
        route = next(r for r in decode_targets(self.spec, local.rank.tp_rank) if r.decode_tp_rank == target.decode_tp)
        duties = sender_duties(self.spec, route, local.rank.cp_rank, len(dst["kv_pages"]), local.rank.pp_rank)
        assert duties is not None  # _sends_anything already filtered non-sending CP ranks
        plan = plan_transfer(
            duties,
            src_layout=local.layout,
            dst_layout=dst["layout"],
            src=local.bases,
            dst=dst["bases"],
            src_pages=room.src_pages,
            dst_pages=dst["kv_pages"],
            src_state=room.src_state if duties.state_layers or duties.state_skipped else [],
            dst_state=dst["state_indices"] if duties.state_layers or duties.state_skipped else [],
            src_aux=room.src_aux,
            dst_aux=dst.get("aux_index"),
            coalesce=self.cfg.coalesce,
            kv_blocks=False,  # page runs once per request, blocks only if the engine moves the KV
        )
        return plan, dst["endpoint"]

    def _count(
        self,
        room: PrefillRoom,
        by_path: dict[str, dict[str, int]],
        path: str,
        kind: Kind,
        moved: int,
        blocks: int,
    ) -> None:
        """Count one confirmed batch under the path that really moved it: a room that fails later
        still shows what moved."""
        labels = self._labels("prefill", path)
        metrics.transfer_bytes.labels(*labels, kind.value).inc(moved)
        metrics.transfer_blocks.labels(*labels).inc(blocks)
        metrics.transfer_batches.labels(*labels).inc()
        room.moved[kind.value] += moved
        per_kind = by_path.setdefault(path, {"kv": 0, "state": 0, "aux": 0})
        per_kind[kind.value] += moved

    async def _write(
        self,
        local: LocalRank,
        peer: str,
        blocks: Sequence[Block],
        kind: Kind,
        room: PrefillRoom,
        by_path: dict[str, dict[str, int]],
    ) -> None:
        if not blocks:
            return
        loop = asyncio.get_running_loop()
        backend = local.backend
        kernel = getattr(backend, "try_write_blocks", None)
        if kernel is not None:
            # A kernel path takes any number of blocks in one launch; None: it moved nothing.
            used = await loop.run_in_executor(self._pool, kernel, peer, blocks)
            if used is not None:
                self._count(room, by_path, used, kind, sum(b.length for b in blocks), len(blocks))
                return
        # The engine's batch limit (the tcp engine fails oversized batches) applies from here on.
        for chunk in chunk_batch(blocks, min(backend.max_batch_entries, self.spec.transfer.max_batch_entries)):
            used = await loop.run_in_executor(self._pool, backend.write_batch, peer, chunk)
            # A backend with several paths (GPU kernel with engine fallback) names the one it used.
            path = used if isinstance(used, str) else backend.path
            self._count(room, by_path, path, kind, sum(b.length for b in chunk), len(chunk))

    async def _write_kv(
        self, local: LocalRank, peer: str, plan: TransferPlan, room: PrefillRoom, by_path: dict[str, dict[str, int]]
    ) -> None:
        kvp = plan.kv_pages
        if kvp is None or not kvp.num_pages:
            await self._write(local, peer, plan.kv, Kind.KV, room, by_path)
            return
        loop = asyncio.get_running_loop()
        pages = getattr(local.backend, "try_write_pages", None)
        if pages is not None:
            # The route's page lists as they are: every layer and K/V in one kernel launch.
            used = await loop.run_in_executor(self._pool, pages, peer, kvp)
            if used is not None:
                self._count(room, by_path, used, Kind.KV, kvp.nbytes, kvp.units)
                return
        blocks = plan.kv or await loop.run_in_executor(self._pool, kvp.blocks, self.cfg.coalesce)
        await self._write(local, peer, blocks, Kind.KV, room, by_path)

    def _start_target(self, room: PrefillRoom, local: LocalRank, target: Target) -> Launch:
        """Kernel backend: plan the target and launch its KV (whole pages: a table of the page
        list) and its small state and aux batches back to back on the sender's stream, without
        waiting; what the kernel does not take goes the usual way in ``_await_launch``. When the
        kernels took everything, the decode agent is told their completion marks while they run.
        A launch that fails is kept in ``error``: whatever went before it is waited for first."""
        plan, peer = self._prepare(room, local, target)
        launch = Launch(plan, peer)
        backend = local.backend
        by_path = launch.by_path
        try:
            kvp = plan.kv_pages
            if kvp is not None and kvp.num_pages:
                h = backend.submit_pages(peer, kvp) if kvp.whole_page else None  # type: ignore[attr-defined]
                if h is not None:
                    launch.launched.append((h, Kind.KV, kvp.nbytes, kvp.units))
                else:
                    launch.later.append(lambda: self._write_kv(local, peer, plan, room, by_path))
            elif plan.kv:
                launch.later.append(lambda: self._write(local, peer, plan.kv, Kind.KV, room, by_path))
            for kind, blocks in ((Kind.STATE, plan.state), (Kind.AUX, plan.aux)):
                if not blocks:
                    continue
                h = backend.submit_blocks(peer, blocks) if len(blocks) <= LOOP_SUBMIT_BLOCKS else None  # type: ignore[attr-defined]
                if h is not None:
                    launch.launched.append((h, kind, sum(b.length for b in blocks), len(blocks)))
                else:
                    launch.later.append(lambda b=blocks, k=kind: self._write(local, peer, b, k, room, by_path))
            room.marks[f"launched:{target.decode_rank}"] = self.clock()
            mark = getattr(backend, "completion_mark", None)
            if launch.launched and not launch.later and not plan.aux_tcp and mark is not None:
                marks = [mark(h) for h, *_ in launch.launched]
                # While the kernels run: the decode agent watches the marks instead of awaiting a report.
                launch.notice = asyncio.ensure_future(
                    self._post_launched(room, target, marks, backend.path, launch.launched)
                )
        except Exception as exc:  # raised by `_await_launch` once what did go has landed
            launch.error = exc
        return launch

    async def _await_launch(self, local: LocalRank, room: PrefillRoom, target: Target, launch: Launch) -> bool:
        """Wait for a target's launches (one worker call), count them, run what the kernel did not
        take; True when the decode agent took the completion marks and counts the bytes itself."""
        backend = local.backend
        notice = launch.notice
        try:
            # Launched batches are always waited for (their receiver reservations are released on
            # completion) and counted, also when a later launch was refused.
            if launch.launched:
                loop = asyncio.get_running_loop()
                paths = await loop.run_in_executor(
                    self._pool,
                    lambda: [backend.wait(h) for h, *_ in launch.launched],  # type: ignore[attr-defined]
                )
                for path, (_, kind, moved, units) in zip(paths, launch.launched, strict=True):
                    self._count(room, launch.by_path, path, kind, moved, units)
            if launch.error is not None:
                raise launch.error
        except BaseException:
            if notice is not None:
                notice.cancel()
            raise
        for write in launch.later:
            await write()
        if notice is None:
            return False
        try:
            await notice
        except (aiohttp.ClientError, TimeoutError, OSError, RuntimeError) as exc:
            log.info(
                "room %s: %s did not take the completion marks (%s); sending the done report",
                room.room,
                target.agent,
                exc,
            )
            return False
        room.marks[f"notified:{target.decode_rank}"] = self.clock()
        return True

    async def _post_launched(
        self,
        room: PrefillRoom,
        target: Target,
        marks: list[CompletionMark],
        path: str,
        launched: Sequence[tuple[Any, Kind, int, int]],
    ) -> dict[str, Any]:
        sent = {"kv": 0, "state": 0, "aux": 0}
        for _, kind, moved, _ in launched:
            sent[kind.value] += moved
        return await self._post_peer(
            target.agent,
            "/v1/peer/launched",
            {
                "room": room.room,
                "decode_rank": target.decode_rank,
                "prefill_rank": room.rank,
                "marks": [m.to_json() for m in marks],
                "bytes_by_path": {path: sent},
            },
            max(0.1, min(5.0, room.deadline - self.clock())),
        )

    async def _send_target(
        self, room: PrefillRoom, local: LocalRank, target: Target, started: Launch | Exception | None = None
    ) -> None:
        if isinstance(started, Exception):
            raise started
        if started is None and hasattr(local.backend, "submit_pages"):
            started = self._start_target(room, local, target)
        if started is None:
            plan, peer = self._prepare(room, local, target)
            by_path: dict[str, dict[str, int]] = {}
        else:
            plan, by_path = started.plan, started.by_path
        watched = False
        try:
            if started is not None:
                watched = await self._await_launch(local, room, target, started)
            else:
                await self._write_kv(local, peer, plan, room, by_path)
                await self._write(local, peer, plan.state, Kind.STATE, room, by_path)
                # Aux rows go as one batch of their own through the engine (upstream send_aux).
                await self._write(local, peer, plan.aux, Kind.AUX, room, by_path)
        except (TransferError, OSError) as exc:
            self._blacklist(target.agent, str(exc))
            raise TransferError(f"{room.rank} -> {target.decode_rank}: {exc}") from None
        room.marks[f"written:{target.decode_rank}"] = self.clock()
        if plan.state_skipped_bytes:
            metrics.state_bytes_skipped.labels(self.cluster, self.backend_name).inc(plan.state_skipped_bytes)
            room.skipped_state += plan.state_skipped_bytes
        if watched:
            # The decode agent took the completion marks and counted the bytes when it saw them.
            target.done = True
            room.marks[f"acknowledged:{target.decode_rank}"] = self.clock()
            return
        aux_rows = []
        for src_off, dst_off, size in plan.aux_tcp:
            aux_rows.append([dst_off, base64.b64encode(local.pools.aux.read(src_off, size)).decode()])
        aux_tcp_bytes = sum(size for _, _, size in plan.aux_tcp)
        if aux_tcp_bytes:
            by_path[TCP_SIDE_CHANNEL] = {"kv": 0, "state": 0, "aux": aux_tcp_bytes}
        try:
            await self._post_peer(
                target.agent,
                "/v1/peer/done",
                {
                    "room": room.room,
                    "decode_rank": target.decode_rank,
                    "prefill_rank": room.rank,
                    "ok": True,
                    "bytes_by_path": by_path,
                    "aux_rows": aux_rows,
                },
                max(0.1, room.deadline - self.clock()),
            )
        except (aiohttp.ClientError, TimeoutError, OSError, RuntimeError) as exc:
            self._blacklist(target.agent, f"done report failed: {exc}")
            raise TransferError(f"{target.agent} did not acknowledge room {room.room}: {exc}") from None
        if aux_tcp_bytes:
            labels = self._labels("prefill", TCP_SIDE_CHANNEL)
            metrics.transfer_bytes.labels(*labels, Kind.AUX.value).inc(aux_tcp_bytes)
            room.moved["aux"] += aux_tcp_bytes
        target.done = True
        room.marks[f"acknowledged:{target.decode_rank}"] = self.clock()

    # ---------------------------------------------------------------- client API: decode
    async def submit_receive(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # Destination pages must be distinct: two sources writing one page would corrupt it.
        req = self._room_request(body, "decode", unique=True)
        rank_id, local, room_id, replica = req.rank_id, req.local, req.room_id, req.peer_replica
        dst_pages, dst_state, dst_aux = req.pages, req.state, req.aux
        if not dst_pages:
            raise malformed("kv_pages is empty: a room moves at least one page")
        key = (rank_id, room_id)
        refuse_active_room(self.decode_rooms.get(key), room_id, rank_id)
        expected = {}
        for p, c, s in expected_sources(self.spec, local.rank.tp_rank, local.rank.pp_rank):
            prefill_rank = Rank("prefill", replica, p, c, s).rank_id
            expected[prefill_rank] = self._agent_for(prefill_rank)
        now = self.clock()
        room = DecodeRoom(
            rank=rank_id,
            room=room_id,
            submitted=now,
            deadline=now + self.cfg.bootstrap_timeout_s,
            dst_pages=dst_pages,
            dst_state=dst_state,
            dst_aux=dst_aux,
            expected=expected,
        )
        self.decode_rooms[key] = room
        self._track("decode", room)
        info = {
            "room": room_id,
            "decode_rank": rank_id,
            "endpoint": local.backend.endpoint(),
            "layout": local.layout.to_dict(),
            "bases": {"kv": local.pools.kv.addr, "state": local.pools.state.addr, "aux": local.pools.aux.addr},
            "kv_pages": pack_indices(dst_pages),
            "state_indices": dst_state,
            "aux_index": dst_aux,
        }
        self._spawn(self._bootstrap_decode(room, info))
        return room.view()

    async def _bootstrap_decode(self, room: DecodeRoom, info: dict[str, Any]) -> None:
        async def push(prefill_rank: str, agent_name: str) -> None:
            if self.health.is_blacklisted(agent_name):
                raise RuntimeError(f"peer agent {agent_name} is blacklisted: {self.health.reason(agent_name)}")
            try:
                await self._post_peer(agent_name, "/v1/peer/dst", {**info, "prefill_rank": prefill_rank}, 5.0)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._blacklist(agent_name, f"room info push failed: {exc}")
                raise RuntimeError(f"prefill agent {agent_name} unreachable: {exc}") from None

        try:
            await asyncio.gather(*(push(r, a) for r, a in room.expected.items()))
        except Exception as exc:
            self._finish(room, "decode", RoomState.FAILED, str(exc))
            return
        if room.state is RoomState.BOOTSTRAPPING:
            room.state = RoomState.WAITING_FOR_INPUT

    def _source_report(self, body: Mapping[str, Any]) -> tuple[DecodeRoom, LocalRank, str]:
        """What a done report and a launch notice share: the decode room and which source speaks."""
        self.check_cluster(body)
        rank_id = field_str(body, "decode_rank")
        local = self._local(rank_id, "decode")
        room_id = field_int(body, "room")
        assert room_id is not None
        prefill_rank = field_str(body, "prefill_rank")
        room = self.decode_rooms.get((rank_id, room_id))
        if room is None:
            raise ApiError(404, Refusal.UNKNOWN_ROOM, f"room {room_id} is unknown on {rank_id}")
        if prefill_rank not in room.expected:
            raise malformed(f"{prefill_rank} is not a source of room {room_id} on {rank_id}")
        return room, local, prefill_rank

    @staticmethod
    def _bytes_by_path(body: Mapping[str, Any]) -> dict[str, dict[str, int]]:
        by_path = body.get("bytes_by_path") or {}
        if not isinstance(by_path, dict) or not all(
            isinstance(v, dict) and all(isinstance(n, int) and n >= 0 for n in v.values()) for v in by_path.values()
        ):
            raise malformed("bytes_by_path must map paths to {kind: bytes}")
        return by_path

    def accept_done(self, body: Mapping[str, Any]) -> dict[str, Any]:
        room, local, prefill_rank = self._source_report(body)
        if room.state.finished or prefill_rank in room.arrived:
            # Late or repeated reports change nothing (and count no bytes twice).
            return {"state": room.state.title}
        if not body.get("ok"):
            self._finish(room, "decode", RoomState.FAILED, f"{prefill_rank} failed: {body.get('reason', 'unknown')}")
            return {"state": room.state.title}
        by_path = self._bytes_by_path(body)
        rows = self._aux_rows(body.get("aux_rows") or [], local, room)
        self._source_arrived(room, local, prefill_rank, by_path, rows, Completion.DONE_REPORT)
        return {"state": room.state.title}

    def accept_launched(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A source's kernels are on their way: watch their completion marks; the source has arrived
        (its bytes counted, the room Success when it was the last) once every mark is reached."""
        room, local, prefill_rank = self._source_report(body)
        if room.state.finished or prefill_rank in room.arrived:
            return {"state": room.state.title}
        by_path = self._bytes_by_path(body)
        raw = body.get("marks")
        if not isinstance(raw, list) or not raw:
            raise malformed("marks must be a non-empty list of {board, slot, seq}")
        try:
            marks = [CompletionMark.from_json(m) for m in raw]
            self.completions.watch(
                marks,
                lambda: self._source_arrived(room, local, prefill_rank, by_path, [], Completion.COMPLETION_BOARD),
                cancelled=lambda: room.state.finished or prefill_rank in room.arrived,
            )
        except ValueError as exc:
            raise malformed(f"cannot watch the completion of room {room.room}: {exc}") from None
        if room.state is not RoomState.FAILED:
            room.state = RoomState.TRANSFERRING
        room.marks[f"notified:{prefill_rank}"] = self.clock()
        return {"state": room.state.title, "watching": len(marks)}

    def _source_arrived(
        self,
        room: DecodeRoom,
        local: LocalRank,
        prefill_rank: str,
        by_path: Mapping[str, Mapping[str, int]],
        rows: Sequence[tuple[int, bytes]],
        how: Completion,
    ) -> None:
        if room.state.finished or prefill_rank in room.arrived:
            return  # a done report and a completion mark of one source: counted once
        room.marks[f"arrived:{prefill_rank}"] = self.clock()
        for dst_off, raw in rows:
            local.pools.aux.write(dst_off, raw)
        sent = {"kv": 0, "state": 0, "aux": 0}
        for per_kind in by_path.values():
            for kind in Kind:
                n = per_kind.get(kind.value, 0)
                room.moved[kind.value] += n
                sent[kind.value] += n
        room.senders[prefill_rank] = sent
        room.arrived.add(prefill_rank)
        if room.state is not RoomState.FAILED:
            room.state = RoomState.TRANSFERRING
        if room.arrived == set(room.expected):
            self._finish(room, "decode", RoomState.SUCCESS)
        self._later(lambda: self._count_arrival(by_path, how))

    def _count_arrival(self, by_path: Mapping[str, Mapping[str, int]], how: Completion) -> None:
        metrics.decode_completions.labels(self.cluster, how.value).inc()
        for path, per_kind in sorted(by_path.items()):
            for kind in Kind:
                n = per_kind.get(kind.value, 0)
                if n:
                    metrics.transfer_bytes.labels(*self._labels("decode", path), kind.value).inc(n)

    @staticmethod
    def _later(fn: Callable[[], None]) -> None:
        """Run `fn` after what is ready now (a long poll woken by a room's end answers first);
        at once when no event loop runs here."""
        try:
            asyncio.get_running_loop().call_soon(fn)
        except RuntimeError:
            fn()

    @staticmethod
    def _aux_rows(rows: Any, local: LocalRank, room: DecodeRoom) -> list[tuple[int, bytes]]:
        """Side-channel aux rows, checked before any is written: each must be exactly one item
        of this room's own aux row, so a report cannot write elsewhere in the pool."""
        lay = local.layout
        allowed = (
            {lay.aux_offset(i, room.dst_aux): size for i, size in enumerate(lay.aux_items)}
            if room.dst_aux is not None
            else {}
        )
        out: list[tuple[int, bytes]] = []
        if not isinstance(rows, list):
            raise malformed("aux_rows must be a list of [offset, base64] pairs")
        for row in rows:
            try:
                dst_off, data = row
                raw = base64.b64decode(data, validate=True)
            except (TypeError, ValueError):
                raise malformed("aux_rows must be a list of [offset, base64] pairs") from None
            if allowed.get(dst_off) != len(raw):
                raise ApiError(400, Refusal.OUT_OF_RANGE, f"aux row at {dst_off} is not an item of this room's aux row")
            out.append((dst_off, raw))
        return out

    # ---------------------------------------------------------------- polling and upkeep
    async def poll(self, rank_id: str, room_id: int, wait_s: float = 0.0) -> dict[str, Any]:
        """The room's view; with wait_s > 0, answer as soon as it is final or wait_s passed (a
        long poll: a serving engine learns completion without polling the agent's CPU away)."""
        early = self._early_view(rank_id, room_id)
        if early is not None:
            return early
        room = self._room(rank_id, room_id)
        if wait_s > 0 and not room.state.finished:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await room.finished_event.wait()
        return room.view()

    def _early_view(self, rank_id: str, room_id: int) -> dict[str, Any] | None:
        """A prefill room not sent yet whose decode side already announced itself: upstream's
        Bootstrapping / WaitingForInput, so a prefill engine can see decode is ready."""
        key = (rank_id, room_id)
        infos = self._early_dst.get(key)
        room = self.prefill_rooms.get(key)
        if not infos or (room is not None and not room.state.finished):
            return None
        local = self.ranks[rank_id]
        needed = len(decode_targets(self.spec, local.rank.tp_rank))
        state = RoomState.WAITING_FOR_INPUT if len(infos) >= needed else RoomState.BOOTSTRAPPING
        return {
            "rank": rank_id,
            "room": room_id,
            "state": state.title,
            "code": int(state),
            "reason": "",
            "decode_ranks_ready": sorted(infos),
        }

    def _room(self, rank_id: str, room_id: int) -> PrefillRoom | DecodeRoom:
        local = self.ranks.get(rank_id)
        if local is None:
            raise ApiError(404, Refusal.UNKNOWN_RANK, f"rank {rank_id!r} is not served by agent {self.entry.name}")
        rooms: Mapping[tuple[str, int], PrefillRoom | DecodeRoom] = (
            self.prefill_rooms if local.rank.role == "prefill" else self.decode_rooms
        )
        room = rooms.get((rank_id, room_id))
        if room is None:
            raise ApiError(404, Refusal.UNKNOWN_ROOM, f"room {room_id} is unknown on {rank_id}")
        return room

    HEARTBEAT_MISSES = 2  # upstream: two missed heartbeats fail the rooms

    async def _heartbeat(self) -> None:
        """Decode side: ping the prefill agents that waiting rooms still expect data from; an
        agent that misses twice fails those rooms now instead of at the waiting deadline."""
        try:
            waiting: dict[str, list[DecodeRoom]] = {}
            for room in list(self._open.values()):
                if isinstance(room, DecodeRoom) and not room.state.finished:
                    for prefill_rank, agent_name in room.expected.items():
                        if prefill_rank not in room.arrived:
                            waiting.setdefault(agent_name, []).append(room)
            names = sorted(waiting)
            results = await asyncio.gather(
                *(self.probe_peer(n, timeout_s=min(2.0, self.cfg.heartbeat_s)) for n in names)
            )
            for name, ok in zip(names, results, strict=True):
                self._missed[name] = 0 if ok else self._missed.get(name, 0) + 1
                if self._missed[name] >= self.HEARTBEAT_MISSES:
                    self._missed[name] = 0
                    self._blacklist(name, f"missed {self.HEARTBEAT_MISSES} heartbeats")
                    for room in waiting[name]:
                        self._finish(room, "decode", RoomState.FAILED, f"prefill agent {name} stopped answering")
        finally:
            self._heartbeat_running = False

    async def tick(self) -> None:
        """Deadlines, heartbeats, probes of blacklisted peers, forgetting old rooms; called
        periodically."""
        now = self.clock()
        if now >= self._heartbeat_due and not self._heartbeat_running:
            self._heartbeat_due = now + self.cfg.heartbeat_s
            self._heartbeat_running = True
            self._spawn(self._heartbeat())
        for (role, _, _), room in list(self._open.items()):
            if now < room.deadline or room.state.finished:
                continue
            if isinstance(room, PrefillRoom):
                if room.state is RoomState.BOOTSTRAPPING:  # Transferring has its own deadline task
                    missing = sorted(t.decode_rank for t in room.targets.values() if t.dst is None)
                    reason = f"no room info from {', '.join(missing)} in time"
                    self._finish(room, role, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)
            else:
                missing = sorted(set(room.expected) - room.arrived)
                reason = f"no data from {', '.join(missing)} in time"
                self._finish(room, role, RoomState.FAILED, reason, outcome=Outcome.TIMEOUT)
        for agent_name in self.health.due():
            if agent_name not in self._probing:  # probes run beside the tick, never inside it
                self._probing.add(agent_name)
                self._spawn(self._probe(agent_name))
        if now >= self._gc_due:
            self._gc_due = now + 1.0
            self._forget(now)

    async def _probe(self, agent_name: str) -> None:
        try:
            ok = await self.probe_peer(agent_name)
            metrics.peer_probes.labels(self.cluster, "ok" if ok else "failed").inc()
            if self.health.probe_result(agent_name, ok):
                metrics.session_recoveries.labels(self.cluster).inc()
                log.info("peer agent %s answers again; re-admitted", agent_name)
            metrics.peers_blacklisted.labels(self.cluster).set(len(self.health.blacklisted))
        finally:
            self._probing.discard(agent_name)

    def _forget(self, now: float) -> None:
        """Drop finished rooms after their TTL and room info nobody claimed in time."""
        ttl = self.cfg.room_ttl_s
        while self._finished and now - self._finished[0][0] > ttl:
            _, role, key, room = self._finished.popleft()
            rooms: dict[tuple[str, int], Any] = self.prefill_rooms if role == "prefill" else self.decode_rooms
            if rooms.get(key) is room:  # a newer use of the same room id stays
                del rooms[key]
        for key, infos in list(self._early_dst.items()):
            for decode_rank, (at, _) in list(infos.items()):
                if now - at > self.cfg.bootstrap_timeout_s:
                    del infos[decode_rank]
            if not infos:
                del self._early_dst[key]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._http is not None:
            await self._http.close()
        self.completions.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
