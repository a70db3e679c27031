"""HTTP surfaces of the agent.

- Two doors into the transfer API, one app each (``Door``), every body naming the cluster uid;
  anything else is refused before it can change state. A refusal answers ``{"error", "reason"}``.
  - Engine door (apiPort, 127.0.0.1 only): the serving engines on the node (in the agent pod's
    network namespace) with ``Authorization: Bearer <engine token>``: /v1/info, /v1/send,
    /v1/receive, /v1/rooms/...
  - Peer door (peerPort, the pod address, mutual TLS): other agents, each by its certificate from
    the cluster CA; the name in it must be an agent of the rank map and is handed to the handlers
    as ``sender_agent``: /v1/peer/dst, /v1/peer/done, /v1/peer/launched, /v1/peer/cancel,
    /v1/peer/ping, /v1/peer/probe (the link check's probe regions, probe.py).
  A route of one door is not served on the other (404).
- Metrics port: /metrics, /healthz (liveness: the process serves), /readyz (ready: transport
  validated, engines up; otherwise 503 with the reason the operator surfaces). With serving
  engines supervised by the agent (spec.engine) the body lists them (``engines``,
  ``enginesReady``) and the answer is 200 only when they all serve too: the pod's readiness.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar

from aiohttp import ClientConnectionResetError, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdfabric_agent.http.guard import CLUSTER, LIMITS, Limits
from pdfabric_agent.http.jsonbody import BODY_CAP, body_cap, read_json
from pdfabric_agent.http.peer_stream import OPEN_STREAMS, close_streams, serve_stream
from pdfabric_agent.protocol import tls
from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_agent.protocol.errors import ApiError, internal_error, malformed
from pdfabric_agent.protocol.fields import field_opt_str
from pdfabric_agent.protocol.info import AgentInfo, RankInfo
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.peer_wire import (
    METADATA_PATH,
    PING_PATH,
    PROBE_PATH,
    STREAM_PATH,
    DoneReport,
    LaunchNotice,
    RoomCancel,
    RoomInfo,
)
from pdfabric_agent.protocol.wire import (
    EVENTS_ROUTE,
    FEED_HEARTBEAT_S,
    INFO_PATH,
    ROOM_ROUTE,
    AbortRequest,
    ReceiveRequest,
    SendRequest,
)
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.inputs import RereadInput, refused_inputs
from pdfabric_agent.service.agent import Agent
from pdfabric_core.engines.state import EngineState

log = logging.getLogger("pdfabric.server")

MAX_WAIT_S = 30.0  # long polls end well inside common proxy and client timeouts
MAX_BODY = 16 * 1024 * 1024  # a room of 1M pages still fits; anything bigger is not a PD request


@dataclass
class Readiness:
    ready: bool = False
    reason: str = "Starting"
    message: str = "the agent is starting"
    transport: str = ""  # the transport in use, once chosen; the operator reads it (a fallback: != requested)
    requested: str = ""  # the rank map's transport
    # The serving engines the agent supervises (supervisor.EngineSupervisor.states); None: none.
    engines: Callable[[], Sequence[EngineState]] | None = None
    rankmap: str = ""  # the digest of the rank map the agent runs on (the operator compares it)
    rankmap_refused: str = ""  # why the agent did not adopt the newest rank map it read, if it did not
    inputs: list[RereadInput] = field(default_factory=list)  # the files it re-reads (runtime/inputs.py)

    def body(self) -> tuple[dict[str, Any], bool]:
        """/readyz: the agent's own readiness (``ready``, which the operator reads) and, with
        supervised engines, theirs; the pod is ready (200) only when the agent and every engine are."""
        body: dict[str, Any] = {"ready": self.ready, "reason": self.reason, "message": self.message}
        if self.transport:
            body |= {"transport": self.transport, "requested": self.requested}
        if self.rankmap:
            body["rankmap"] = self.rankmap
        refused = refused_inputs(self.inputs)
        if refused:
            body["inputsRefused"] = refused
        # The operator reads rankmapRefused: a map that does not parse is one it did not take.
        rankmap_refused = refused.get("rankmap") or self.rankmap_refused
        if rankmap_refused:
            body["rankmapRefused"] = rankmap_refused
        if self.engines is None:
            return body, self.ready
        states = list(self.engines())
        engines_ready = all(e.ready for e in states)
        body |= {"engines": [e.to_json() for e in states], "enginesReady": engines_ready}
        return body, self.ready and engines_ready


def _line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _refuse(agent_cluster: str, exc: ApiError) -> web.Response:
    metrics.api_refusals.labels(agent_cluster, exc.reason.value).inc()
    return web.json_response(exc.body(), status=exc.status)


async def _body(request: web.Request) -> dict[str, Any]:
    """Bounded (jsonbody): the app's body cap and body deadline, strict UTF-8, bounded JSON."""
    app = request.app
    return await read_json(request, app[BODY_CAP], app[LIMITS].body_timeout_s)


def _authorization(request: web.Request) -> str | None:
    """The Authorization header; one that is not ASCII is no token (refused as unauthorized)."""
    value = request.headers.get("Authorization")
    return value if value is None or value.isascii() else ""


def _unexpected(cluster: str, request: web.Request, exc: Exception) -> web.Response:
    """An error no check anticipated: logged, counted, JSON 500 (bad input is always a 4xx)."""
    log.exception("unexpected error on %s %s", request.method, request.path, exc_info=exc)
    return _refuse(cluster, internal_error(exc))


def _http_refusal(exc: web.HTTPException) -> ApiError:
    if exc.status == 413:
        return ApiError(413, Refusal.TOO_LARGE, exc.reason)
    return ApiError(exc.status if 400 <= exc.status < 500 else 400, Refusal.MALFORMED, exc.reason)


class _Message(Protocol):
    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self: ...


M = TypeVar("M", bound=_Message)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Door(enum.Enum):
    ENGINE = "engine"  # 127.0.0.1:apiPort, the engine token
    PEER = "peer"  # pod address:peerPort, mutual TLS from the cluster CA


PEER_AGENT = web.RequestKey("peer_agent", str)  # the authenticated caller on the peer door


def peer_identity(agent: Agent, request: web.Request) -> str:
    """The calling agent, from its verified client certificate (the TLS handshake already refused
    a missing one or one from another CA): its name must be an agent of this cluster's rank map."""
    peercert = request.transport.get_extra_info("peercert") if request.transport else None
    name = tls.peer_agent(peercert)
    if name is None:
        raise ApiError(401, Refusal.UNAUTHORIZED, "the peer door needs a client certificate from the cluster CA")
    check_peer(agent, name, tls.peer_expiry(peercert), time.time())
    return name


def check_peer(agent: Agent, name: str, expires: float | None, now: float) -> None:
    """A caller the handshake admitted may still call: its certificate has not expired since (a
    kept-alive connection or a stream outlives the handshake) and the rank map still lists it."""
    if expires is not None and now >= expires:
        raise ApiError(401, Refusal.UNAUTHORIZED, f"the certificate of {name!r} expired; the connection must end")
    if name not in agent.ctx.ranks.peer_agents():
        raise ApiError(
            403, Refusal.UNAUTHORIZED, f"certificate of {name!r}, which is no agent of this cluster's rank map"
        )


def build_api_app(agent: Agent, door: Door) -> web.Application:
    cluster = agent.cluster

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if door is Door.ENGINE:
                agent.check_token(_authorization(request))
            else:
                request[PEER_AGENT] = caller = peer_identity(agent, request)
                agent.peers.heard_from(caller)  # alive, whatever its missed heartbeats said
            return await handler(request)
        except ApiError as exc:
            return _refuse(cluster, exc)
        except web.HTTPException as exc:  # aiohttp's own (413 past client_max_size): JSON, counted
            return _refuse(cluster, _http_refusal(exc))
        except Exception as exc:
            return _unexpected(cluster, request, exc)

    async def info(request: web.Request) -> web.Response:
        ranks = {
            # The engine's own buffers once registered; the pools stay for the synthetic engine.
            rank_id: RankInfo.of(
                lr.rank.role.value,
                lr.backend.endpoint(),
                lr.backend.path,
                lr.pools,
                lr.engine.answer(rank_id) if lr.engine is not None else None,
            )
            for rank_id, lr in agent.ranks.items()
        }
        rm = agent.rankmap
        answer = AgentInfo(
            rm.namespace,
            cluster,
            rm.cluster_uid,
            agent.entry.name,
            agent.transport.value,
            agent.backend_name.value,
            ranks,
        )
        return web.json_response(answer.to_json())

    async def parsed(request: web.Request, message: type[M]) -> M:
        """The boundary: a JSON object for this cluster, parsed into its typed message."""
        body = await _body(request)
        agent.check_cluster(body)
        return message.parse(body)

    async def send(request: web.Request) -> web.Response:
        return web.json_response(agent.submit_send(await parsed(request, SendRequest)).to_json())

    async def send_chunk(request: web.Request) -> web.Response:
        return web.json_response(agent.submit_send(await parsed(request, SendChunk)).to_json())

    async def receive(request: web.Request) -> web.Response:
        return web.json_response(agent.submit_receive(await parsed(request, ReceiveRequest)).to_json())

    async def memory(request: web.Request) -> web.Response:
        # On the loop, not in a worker: no room may be submitted between the check and the swap.
        return web.json_response(agent.register_memory(await parsed(request, MemoryRegistration)).to_json())

    async def abort(request: web.Request) -> web.Response:
        return web.json_response((await agent.abort(await parsed(request, AbortRequest))).to_json())

    async def poll(request: web.Request) -> web.Response:
        try:
            raw_room = request.match_info["room"]
            if len(raw_room) > 20:  # no int() of a 5000-digit path segment
                raise ValueError(raw_room)
            room = int(raw_room)
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            raise malformed("room must be an integer and wait_s a number of seconds") from None
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise malformed(f"wait_s must be within 0..{MAX_WAIT_S:g} seconds")
        return web.json_response((await agent.poll(request.match_info["rank"], room, wait_s)).to_json())

    async def events(request: web.Request) -> web.StreamResponse:
        """A rank's room feed (rooms/feed.py): the hello, a snapshot, then each view as it changes."""
        rank = request.match_info["rank"]
        hello = agent.feed_hello(rank)  # 404 for a rank this agent does not serve
        instance = field_opt_str(request.query, "instance")  # the engine's (registrants.py)

        def connected() -> bool:
            transport = request.transport
            return transport is not None and not transport.is_closing()

        # Subscribed and snapshotted in one step (no await between): every view queued after is newer.
        sub, snapshot = agent.ctx.feed.subscribe(rank, instance, connected), agent.feed_snapshot(rank)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"})
        metrics.feed_subscribers.labels(cluster).inc()
        try:
            await resp.prepare(request)
            await resp.write(_line(hello.to_json()) + b"".join(_line(v.to_json()) for v in snapshot) + b"\n")
            while True:
                try:
                    view = await sub.next(FEED_HEARTBEAT_S)
                except TimeoutError:
                    await resp.write(b"\n")
                    continue
                if view is None:  # dropped: the engine did not keep up, and resynchronises
                    metrics.feed_dropped.labels(cluster).inc()
                    break
                await resp.write(_line(view.to_json()))
        except (ConnectionError, ClientConnectionResetError):
            pass  # the engine went away
        finally:
            sub.close()
            metrics.feed_subscribers.labels(cluster).dec()
        return resp

    async def peer_call(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        """A peer message by its path, from a POST or a stream frame, for the authenticated caller."""
        agent.peers.heard_from(caller)  # alive (the guard says so once per request, a stream once)
        agent.check_cluster(body)
        if path == RoomInfo.PATH:
            return agent.accept_dst(RoomInfo.parse(body), sender_agent=caller).to_json()
        if path == DoneReport.PATH:
            return (await agent.accept_done(DoneReport.parse(body), sender_agent=caller)).to_json()
        if path == LaunchNotice.PATH:
            return agent.accept_launched(LaunchNotice.parse(body), sender_agent=caller).to_json()
        if path == RoomCancel.PATH:
            return agent.accept_cancel(RoomCancel.parse(body), sender_agent=caller).to_json()
        raise ApiError(404, Refusal.MALFORMED, f"no such peer message {path}")

    async def peer_post(request: web.Request) -> web.Response:
        return web.json_response(await peer_call(request.path, await _body(request), request[PEER_AGENT]))

    async def framed(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        metrics.peer_stream_frames.labels(cluster).inc()
        return await peer_call(path, body, caller)

    async def peer_stream(request: web.Request) -> web.StreamResponse:
        refused = lambda exc: metrics.api_refusals.labels(cluster, exc.reason.value).inc()  # noqa: E731
        caller = request[PEER_AGENT]
        expires = tls.peer_expiry(request.transport.get_extra_info("peercert") if request.transport else None)

        def still_admitted() -> ApiError | None:
            try:
                check_peer(agent, caller, expires, time.time())
            except ApiError as exc:
                return exc
            return None

        return await serve_stream(request, caller, framed, request.app[BODY_CAP], refused, still_admitted)

    async def ping(request: web.Request) -> web.Response:
        return web.json_response({"agent": agent.entry.name})

    async def probe_regions(request: web.Request) -> web.Response:
        return web.json_response(agent.probe_regions)  # only describes: the prober does the work

    async def transfer_metadata(request: web.Request) -> web.Response:
        rank_id = request.query.get("rank", "")
        return web.json_response(agent.transfer_metadata(rank_id).to_json())  # only describes, as the probe

    async def not_found(request: web.Request) -> web.Response:
        raise ApiError(404, Refusal.MALFORMED, f"no such endpoint {request.method} {request.path}")

    # Bounds (docs/agent.md, "Limits"): the largest legal request of these pools, the listener's limits.
    limits = Limits.from_env()
    cap = min(MAX_BODY, body_cap(lr.layout for lr in agent.ranks.values()))
    app = web.Application(middlewares=[guard], client_max_size=cap, handler_args=limits.handler_args())
    app[LIMITS], app[CLUSTER], app[BODY_CAP] = limits, cluster, cap
    if door is Door.ENGINE:
        app.router.add_get(INFO_PATH, info)
        app.router.add_post(SendRequest.PATH, send)
        app.router.add_post(SendChunk.PATH, send_chunk)
        app.router.add_post(ReceiveRequest.PATH, receive)
        app.router.add_post(MemoryRegistration.PATH, memory)
        app.router.add_post(AbortRequest.PATH, abort)
        app.router.add_get(ROOM_ROUTE, poll)
        app.router.add_get(EVENTS_ROUTE, events)
    else:
        for message in (RoomInfo, DoneReport, LaunchNotice, RoomCancel):
            app.router.add_post(message.PATH, peer_post)
        app.router.add_get(STREAM_PATH, peer_stream)
        app[OPEN_STREAMS] = set()
        app.on_shutdown.append(close_streams)
        app.router.add_get(PING_PATH, ping)
        app.router.add_get(PROBE_PATH, probe_regions)
        app.router.add_get(METADATA_PATH, transfer_metadata)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def build_metrics_app(readiness: Readiness) -> web.Application:
    async def metrics_view(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(metrics.REGISTRY))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"alive": True})

    async def readyz(request: web.Request) -> web.Response:
        body, ready = readiness.body()
        return web.json_response(body, status=200 if ready else 503)

    app = web.Application(handler_args=Limits.from_env().handler_args())
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
