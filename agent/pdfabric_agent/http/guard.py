"""Bounds on the agent's HTTP listeners, below aiohttp's request handling.

aiohttp reads headers and bodies without deadlines of its own and accepts every connection. A
listener started with ``GuardedTCPSite`` (instead of ``web.TCPSite``) serves each connection with ``GuardedHandler``, aiohttp's ``RequestHandler`` plus:

- a phase per connection: HEAD (from the accept, or from the first byte after a response, until
  aiohttp hands the parsed request to the application), BUSY (the application runs and writes its
  answer; its body reads have their own deadline, ``server._body``), IDLE (keep-alive, between
  requests). A watchdog sweeps the listener's connections a few times a second: HEAD past
  ``header_timeout_s`` answers 408 ``{error, reason}`` and closes; IDLE past ``idle_timeout_s``
  closes. Nothing is armed or cancelled per request: a phase change is an attribute write.
- at most ``max_connections`` at once: a new connection past the bound first takes the place of
  the oldest that is slow (in HEAD for ``slow_head_s``, 0.1 s: a good client sends its head in one
  write right after connecting; the slow one is answered 408), or whose body is that slow, or
  idle (for two seconds or more), else it is refused at once with 429. Connections whose
  request is being handled are never touched.
- parser errors (bad request line, header too long, too many headers, bad chunk framing) answer
  JSON ``{error, reason}`` (400, 431) instead of aiohttp's text/plain, and are counted.

Every refusal is counted in ``pdfabric_api_refusals_total{reason}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from pdfabric_agent.http.handshakes import Handshakes
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.runtime import metrics

log = logging.getLogger("pdfabric.guard")

HEAD, BUSY, IDLE, BODY, CLOSED = 0, 1, 2, 3, 4  # BODY: the application waits for the rest of a body
EVICT_IDLE_S = 2.0  # an idle keep-alive connection this old may make room for a new one


@dataclass(frozen=True)
class Limits:
    """One listener's bounds (docs/agent.md, "Limits")."""

    header_timeout_s: float = 10.0  # accept (or first byte after an answer) to a parsed head
    body_timeout_s: float = 30.0  # a parsed head to the whole body read
    idle_timeout_s: float = 60.0  # keep-alive between requests (clients keep theirs shorter: aiohttp 15 s)
    max_connections: int = 256  # per listener; the peer door's grows with the rank map (peer_door_bound)
    max_line_bytes: int = 8190  # request line, and each header line
    max_headers: int = 32
    lingering_s: float = 2.0  # reading what is left of a refused body, so the answer is not lost to a reset
    # A head still incomplete after this long is a slow client's (a good one sends its head in one
    # write right after connecting): at the bound, the oldest such connection makes room.
    slow_head_s: float = 0.1
    # A TLS listener's handshakes in progress (handshakes.py): at most this many, and one still
    # running after slow_handshake_s makes room for a new connection at the bound.
    max_handshakes: int = 64
    slow_handshake_s: float = 0.5
    tls_shutdown_s: float = 1.0  # a closed TLS connection waits this long for the client's close_notify

    ENV = {
        "header_timeout_s": "PDFABRIC_HEADER_TIMEOUT_S",
        "body_timeout_s": "PDFABRIC_BODY_TIMEOUT_S",
        "idle_timeout_s": "PDFABRIC_IDLE_TIMEOUT_S",
        "max_connections": "PDFABRIC_MAX_CONNECTIONS",
        "max_handshakes": "PDFABRIC_MAX_HANDSHAKES",
    }
    COUNTS = ("max_connections", "max_handshakes")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Limits:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field, name in cls.ENV.items():
            raw = env.get(name)
            if not raw:
                continue
            try:
                value: float = int(raw) if field in cls.COUNTS else float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {raw}")
            values[field] = value
        return cls(**values)

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's own per-connection settings (``web.Application(handler_args=...)``)."""
        return {
            # aiohttp's keep-alive timer backs the watchdog's idle bound up (it also runs from the accept).
            "keepalive_timeout": self.idle_timeout_s + self.header_timeout_s,
            "max_line_size": self.max_line_bytes,
            "max_field_size": self.max_line_bytes,
            "max_headers": self.max_headers,
            "lingering_time": self.lingering_s,
        }


# The peer door holds, per peer agent at once, its stream (peers/stream.py) and a pooled connection
# or two of its GETs and POSTs; every agent of the rank map may talk to this one (a decode agent of
# 512 prefill replicas hears from 512), so the door's bound follows the map, never below the setting.
CONNECTIONS_PER_PEER = 3
PEER_DOOR_SPARE = 64


def peer_door_bound(peer_agents: int, limits: Limits) -> int:
    """The peer door's connection bound for a rank map of ``peer_agents`` agents."""
    return max(limits.max_connections, CONNECTIONS_PER_PEER * peer_agents + PEER_DOOR_SPARE)


LIMITS = web.AppKey("pdfabric_limits", Limits)
CLUSTER = web.AppKey("pdfabric_cluster", str)


def count(cluster: str, reason: Refusal) -> None:
    metrics.api_refusals.labels(cluster, reason.value).inc()


def raw_refusal(status: int, phrase: str, reason: Refusal, message: str) -> bytes:
    """A whole HTTP/1.1 answer, for a connection aiohttp has no request on."""
    body = json.dumps({"error": message, "reason": reason.value}).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """One listener's connections, their bound and the watchdog over them."""

    def __init__(self, server: Server, limits: Limits, cluster: str, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.limits = limits
        self.cluster = cluster
        self.loop = loop
        self.conns: dict[GuardedHandler, None] = {}  # in accept order
        self.max_connections = limits.max_connections  # the peer door's follows the rank map
        self._sweep: asyncio.TimerHandle | None = None
        self.sweep_s = max(0.05, min(0.5, limits.header_timeout_s / 4))

    def protocol(self) -> GuardedHandler:
        """The protocol factory for ``loop.create_server``."""
        return GuardedHandler(self.server, self, loop=self.loop, **self.server._kwargs)

    def refused(self, reason: Refusal) -> None:
        count(self.cluster, reason)

    # ---------------------------------------------------------------- admission
    def admit(self, conn: GuardedHandler) -> bool:
        if len(self.conns) >= self.max_connections and not self._evict_one():
            count(self.cluster, Refusal.TOO_MANY_CONNECTIONS)
            conn.refuse(
                raw_refusal(
                    429,
                    "Too Many Requests",
                    Refusal.TOO_MANY_CONNECTIONS,
                    f"this listener holds {self.max_connections} connections, all busy",
                )
            )
            return False
        self.conns[conn] = None
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.sweep_s, self.sweep)
        return True

    def release(self, conn: GuardedHandler) -> None:
        self.conns.pop(conn, None)

    def _evict_one(self) -> bool:
        now = self.loop.time()
        idle: GuardedHandler | None = None
        for conn in self.conns:
            age = now - conn.guard_since
            if conn.guard_state == BODY and age >= self.limits.slow_head_s:
                conn.refuse(b"")  # its body read fails: the handler answers and counts (jsonbody.read_body)
                return True
            if conn.guard_state == HEAD and age >= self.limits.slow_head_s:
                count(self.cluster, Refusal.TOO_MANY_CONNECTIONS)
                conn.refuse(
                    raw_refusal(
                        408,
                        "Request Timeout",
                        Refusal.TOO_MANY_CONNECTIONS,
                        f"request head incomplete after {age:.1f} s while the listener is full",
                    )
                )
                return True
            if idle is None and conn.guard_state == IDLE and age >= EVICT_IDLE_S:
                idle = conn
        if idle is not None:
            idle.refuse(b"")  # an idle keep-alive connection: its client opens a new one
            return True
        return False

    # ---------------------------------------------------------------- watchdog
    def sweep(self) -> None:
        self._sweep = None
        now = self.loop.time()
        head_before = now - self.limits.header_timeout_s
        idle_before = now - self.limits.idle_timeout_s
        for conn in list(self.conns):
            if conn.guard_state == HEAD and conn.guard_since < head_before:
                count(self.cluster, Refusal.TIMEOUT)
                conn.refuse(
                    raw_refusal(
                        408,
                        "Request Timeout",
                        Refusal.TIMEOUT,
                        f"no complete request head within {self.limits.header_timeout_s:g} s",
                    )
                )
            elif conn.guard_state == IDLE and conn.guard_since < idle_before:
                conn.refuse(b"")
        if self.conns:
            self._sweep = self.loop.call_later(self.sweep_s, self.sweep)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None


class GuardedHandler(RequestHandler):
    """aiohttp's connection protocol, with the phase the watchdog reads and JSON parser errors."""

    __slots__ = ("guard", "guard_since", "guard_state")

    def __init__(self, manager: Server, guard: Guard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.guard_state = HEAD
        self.guard_since = guard.loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.guard_since = self.guard.loop.time()
        self.guard.admit(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.guard_state == IDLE:
            self.guard_state = HEAD
            self.guard_since = self.guard.loop.time()
        super().data_received(data)

    async def _handle_request(self, request: BaseRequest, start_time: float | None, request_handler: Any) -> Any:
        self.guard_state = BUSY
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if self.guard_state != CLOSED:
                self.guard_state = IDLE
                self.guard_since = self.guard.loop.time()

    def reading_body(self) -> None:
        """The application waits for a body that has not all arrived (evictable when slow)."""
        if self.guard_state == BUSY:
            self.guard_state = BODY
            self.guard_since = self.guard.loop.time()

    def body_read(self) -> None:
        if self.guard_state == BODY:
            self.guard_state = BUSY

    @property
    def evicted(self) -> bool:
        return self.guard_state == CLOSED

    def refuse(self, answer: bytes) -> None:
        """Answer (when nothing else is queued to the client) and close now."""
        self.guard.release(self)
        self.guard_state = CLOSED
        transport = self.transport
        if (
            answer
            and isinstance(transport, asyncio.WriteTransport)
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0  # nothing of another answer queued
        ):
            transport.write(answer)
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what never reached the application (a head it could not parse) or
        escaped it: JSON and counted, like every refusal."""
        cluster = self.guard.cluster
        if status >= 500:
            log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
            reason, text = Refusal.INTERNAL, "internal error (logged by the agent)"
        elif isinstance(exc, LineTooLong):
            status, reason, text = 431, Refusal.TOO_LARGE, f"request head too large: {exc.message}"
        else:
            status, reason = (status if 400 <= status < 500 else 400), Refusal.MALFORMED
            detail = exc.message if isinstance(exc, HttpProcessingError) else None
            text = f"malformed request: {detail or message or 'bad HTTP'}"
        count(cluster, reason)
        resp = web.json_response({"error": text, "reason": reason.value}, status=status)
        resp.force_close()
        return resp


def _guard_for(runner: web.BaseRunner, limits: Limits | None, cluster: str | None) -> Guard:
    server = runner.server
    if server is None:
        raise RuntimeError("call runner.setup() before starting a guarded site")
    app = runner.app if isinstance(runner, web.AppRunner) else None
    if limits is None:
        limits = app.get(LIMITS) if app is not None else None
    if cluster is None:
        cluster = app.get(CLUSTER) if app is not None else None
    return Guard(server, limits or Limits.from_env(), cluster or "", asyncio.get_running_loop())


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections are guarded. Limits and the cluster label come from the
    app (``LIMITS``, ``CLUSTER``: ``server.build_api_app`` sets them) unless given here."""

    __slots__ = ("_guard", "_guard_cluster", "_guard_limits", "_handshakes")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None = None,
        port: int | None = None,
        *,
        limits: Limits | None = None,
        cluster: str | None = None,
        ssl_context: Any = None,
        backlog: int = 128,
        reuse_address: bool | None = None,
        reuse_port: bool | None = None,
    ) -> None:
        super().__init__(
            runner,
            host,
            port,
            ssl_context=ssl_context,
            backlog=backlog,
            reuse_address=reuse_address,
            reuse_port=reuse_port,
        )
        self._guard_limits, self._guard_cluster = limits, cluster
        self._guard: Guard | None = None
        self._handshakes: Handshakes | None = None

    @property
    def guard(self) -> Guard | None:
        return self._guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        self._guard = guard = _guard_for(self._runner, self._guard_limits, self._guard_cluster)
        factory: Callable[[], asyncio.Protocol] = guard.protocol
        if self._ssl_context is not None:
            # TLS is started per connection after its accept, so the handshake phase is bounded too.
            self._handshakes = Handshakes(guard, self._ssl_context)
            factory = self._handshakes.protocol
        self._server = await guard.loop.create_server(
            factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    async def stop(self) -> None:
        if self._guard is not None:
            self._guard.close()
        if self._handshakes is not None:
            self._handshakes.close()
        await super().stop()
