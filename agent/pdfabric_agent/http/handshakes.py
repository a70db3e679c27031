"""The peer door's TLS handshake phase, bounded in count and time like a request head.

asyncio's TLS server hands a connection to its protocol only once the handshake is done, so the
listener's connection bound (``guard``) never sees handshakes in progress: clients that connect
and never finish a ClientHello each hold a descriptor for the whole handshake timeout, and 1,500
of them exhaust a process limited to 1,024. Here the peer door accepts plain TCP (``TlsGate``) and
starts TLS itself (``loop.start_tls``), so every connection is counted from its accept:

- at most ``max_handshakes`` handshakes at once. Past it, a new connection takes the place of the
  oldest handshake of the address holding the most when that is another address, else of the
  oldest still running after ``slow_handshake_s`` (a peer agent's takes a round trip or two), else
  it is reset at once. The descriptor goes at once, with no TLS shutdown to wait for.
- each handshake within ``header_timeout_s`` (then reset).
- a TLS connection this agent closes waits ``tls_shutdown_s`` for the client's close_notify, then
  its descriptor goes (asyncio's default waits 30 s).

Only a completed handshake (a certificate of the cluster's CA) reaches ``guard.GuardedHandler``.
Refusals are counted in ``pdfabric_api_refusals_total``: ``tls_handshake`` for a handshake that
failed or took too long, ``too_many_connections`` for one reset at the bound.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING

from pdfabric_agent.protocol.labels import Refusal

if TYPE_CHECKING:
    from pdfabric_agent.http.guard import Guard

HANDSHAKE_ERRORS = (ssl.SSLError, OSError, TimeoutError, EOFError)


class Handshakes:
    """One TLS listener's handshakes in progress, in accept order, and by source address."""

    def __init__(self, guard: Guard, context: ssl.SSLContext) -> None:
        self.guard = guard
        self.context = context
        self.pending: dict[TlsGate, None] = {}
        self.by_source: dict[str, dict[TlsGate, None]] = {}

    def protocol(self) -> TlsGate:
        """The protocol factory for ``loop.create_server`` (plain TCP)."""
        return TlsGate(self)

    def admit(self, gate: TlsGate) -> bool:
        """Room for `gate`'s handshake, made when needed: see ``victim``."""
        if len(self.pending) >= self.guard.limits.max_handshakes:
            victim = self.victim(gate.source)
            self.guard.refused(Refusal.TOO_MANY_CONNECTIONS)
            if victim is None:
                return False
            victim.reset()
        self.pending[gate] = None
        self.by_source.setdefault(gate.source, {})[gate] = None
        return True

    def victim(self, source: str) -> TlsGate | None:
        """The handshake a new one from `source` replaces at the bound: the oldest of the source
        holding the most, when that is another source (a peer agent holds one or two; a flood from
        one address cannot keep another address out); else the oldest handshake still running
        after ``slow_handshake_s``; else none, and the new connection is reset."""
        busiest = max(self.by_source, key=lambda s: len(self.by_source[s]))
        if busiest != source and len(self.by_source[busiest]) > len(self.by_source.get(source, ())) + 1:
            return next(iter(self.by_source[busiest]))
        oldest = next(iter(self.pending))
        if self.guard.loop.time() - oldest.since >= self.guard.limits.slow_handshake_s:
            return oldest
        return None

    def done(self, gate: TlsGate) -> None:
        if self.pending.pop(gate, None) is None:
            return
        mine = self.by_source.get(gate.source)
        if mine is not None:
            mine.pop(gate, None)
            if not mine:
                del self.by_source[gate.source]

    def close(self) -> None:
        for gate in list(self.pending):
            gate.reset()


class _Early(asyncio.Protocol):
    """Holds what the TLS connection delivers between the handshake's end and the hand-over (the
    client's first request may come in the same segment as its Finished)."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True  # the request handler decides, once it has the connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True


class TlsGate(asyncio.Protocol):
    """One peer-door connection from its accept to the end of its TLS handshake."""

    def __init__(self, handshakes: Handshakes) -> None:
        self.handshakes = handshakes
        self.since = handshakes.guard.loop.time()
        self.raw: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.source = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.raw = transport
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        transport.pause_reading()  # nothing is read before start_tls takes the connection over
        if not self.handshakes.admit(self):
            transport.abort()
            return
        self.task = self.handshakes.guard.loop.create_task(self._upgrade(transport))

    def connection_lost(self, exc: BaseException | None) -> None:
        # Only before start_tls took the transport over (a client that reset at once).
        self.handshakes.done(self)
        if self.task is not None:
            self.task.cancel()

    def reset(self) -> None:
        self.handshakes.done(self)
        if self.raw is not None:
            self.raw.abort()

    async def _upgrade(self, raw: asyncio.Transport) -> None:
        guard = self.handshakes.guard
        limits = guard.limits
        early = _Early()
        try:
            tls = await guard.loop.start_tls(
                raw,
                early,
                self.handshakes.context,
                server_side=True,
                ssl_handshake_timeout=limits.header_timeout_s,
                ssl_shutdown_timeout=limits.tls_shutdown_s,
            )
        except asyncio.CancelledError:
            raw.abort()
            return
        except HANDSHAKE_ERRORS:
            # start_tls closed the connection: its alert (a missing certificate) still goes out.
            guard.refused(Refusal.TLS_HANDSHAKE)
            return
        finally:
            self.handshakes.done(self)
        if tls is None or early.lost or tls.is_closing():
            raw.abort()
            return
        handler = guard.protocol()
        tls.set_protocol(handler)
        handler.connection_made(tls)
        for data in early.data:
            handler.data_received(data)
        if early.eof:
            handler.eof_received()
