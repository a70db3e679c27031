"""The peer door's TLS handshake phase, bounded in count and time like a request head.

asyncio's TLS server hands a connection to its protocol only once the handshake is done, so the
listener's connection bound (``guard``) never sees handshakes in progress: clients that connect
and never finish a ClientHello each hold a descriptor for the whole handshake timeout, and 1,500
of them exhaust a process limited to 1,024. Here the peer door accepts plain TCP (``TlsGate``) and
starts TLS itself (``loop.start_tls``), so every connection is counted from its accept:

- at most ``max_handshakes`` handshakes at once. Past it, a new connection takes the place of
  (``Handshakes.victim``): the oldest handshake of the address holding the most, when that is
  another address; else, when the new client has spoken (sent a ClientHello's worth of bytes,
  ``HELLO_BYTES``, read from the kernel's TCP_INFO, nothing consumed), the oldest whose client has
  not; else the oldest still running after ``slow_handshake_s`` (a peer agent's takes a round trip
  or two). A new connection that found no place before its client spoke waits up to
  ``LOBBY_WAIT_S`` for its ClientHello in a lobby as large as the bound (no TLS started, the
  oldest waiter makes room), then tries again; else it is reset. The descriptor goes at once, with
  no TLS shutdown to wait for.

  Why the ClientHello: a source address cannot tell a peer agent from a stranger (another process
  of the peer's node, or behind the same NAT, dials from the same address), and TLS 1.3 shows the
  client's certificate only at the end of the handshake. What it shows at once is whether the client
  speaks: a peer's ClientHello follows its connect within a round trip, while the cheapest flood
  (connect, a few bytes, wait) never sends one, so it can never keep a speaking client out, from
  any address (issue 40), and its own connections cost no TLS to refuse. A flood of complete
  ClientHellos must send real bytes per connection and makes the agent do a key exchange for each;
  it meets the age rule, as before.
- each handshake within ``header_timeout_s`` (then reset).
- a TLS connection this agent closes waits ``tls_shutdown_s`` for the client's close_notify, then
  its descriptor goes (asyncio's default waits 30 s).

Only a completed handshake (a certificate of the cluster's CA) reaches ``guard.GuardedHandler``.
Refusals are counted in ``pdfabric_api_refusals_total``: ``tls_handshake`` for a handshake that
failed or took too long, ``too_many_connections`` for one reset at the bound.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from typing import Protocol

from pdfabric_agent.protocol.labels import Refusal

HANDSHAKE_ERRORS = (ssl.SSLError, OSError, TimeoutError, EOFError)

# Fewer bytes than this from a client is not a ClientHello yet: a TLS 1.3 one carries a 32-byte
# random, a 32-byte key share and its extensions, well over 100 bytes; Python's is about 500.
HELLO_BYTES = 96
# A connection that finds the bound full before its client spoke waits this long for its ClientHello,
# checked this often, in a lobby as large as the bound (the oldest waiter makes room, checked once
# more): a peer's comes within a round trip, a silent flood's never.
LOBBY_WAIT_S = 0.1
LOBBY_CHECK_S = 0.005
# struct tcp_info (linux/tcp.h): tcpi_bytes_received, a u64 at offset 128 (Linux 4.1 and later).
_TCPI_BYTES_RECEIVED = struct.Struct("=Q")
_TCPI_BYTES_RECEIVED_AT = 128
_TCP_INFO_LEN = 232


def bytes_received(transport: asyncio.BaseTransport) -> int | None:
    """Bytes the kernel received on the transport's socket so far, whoever read them; None when
    the system does not say (then every client counts as one that spoke)."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _TCPI_BYTES_RECEIVED_AT + _TCPI_BYTES_RECEIVED.size:
        return None
    return int(_TCPI_BYTES_RECEIVED.unpack_from(info, _TCPI_BYTES_RECEIVED_AT)[0])


class HandshakeLimits(Protocol):
    """The listener's bounds a handshake is held to (``guard.Limits``)."""

    @property
    def max_handshakes(self) -> int: ...

    @property
    def slow_handshake_s(self) -> float: ...

    @property
    def header_timeout_s(self) -> float: ...

    @property
    def tls_shutdown_s(self) -> float: ...


class Listener(Protocol):
    """What the handshakes use of their listener's connection bound (``guard.Guard``): stated here
    because the guard starts the handshakes, so this module must not import it."""

    @property
    def limits(self) -> HandshakeLimits: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def refused(self, reason: Refusal) -> None: ...

    def protocol(self) -> asyncio.Protocol:
        """The request handler a completed handshake hands its TLS connection to."""
        ...


class Handshakes:
    """One TLS listener's handshakes in progress, in accept order, and by source address; and the
    lobby: new connections that found the bound full before their client spoke."""

    def __init__(self, guard: Listener, context: ssl.SSLContext) -> None:
        self.guard = guard
        self.context = context
        self.pending: dict[TlsGate, None] = {}
        self.by_source: dict[str, dict[TlsGate, None]] = {}
        self.lobby: dict[TlsGate, float] = {}  # -> when it came in

    def protocol(self) -> TlsGate:
        """The protocol factory for ``loop.create_server`` (plain TCP)."""
        return TlsGate(self)

    def arrive(self, gate: TlsGate) -> None:
        """A new connection: its handshake starts now, or it waits in the lobby for its
        ClientHello (no TLS, no handshake slot), or it is reset."""
        if self.admit(gate):
            gate.start()
            return
        if gate.spoke():  # it spoke, and every handshake spoke and is young: no place for it
            self._refuse(gate)
            return
        if len(self.lobby) >= self.guard.limits.max_handshakes:
            # The oldest waiter, checked once more: by now a peer's ClientHello has come.
            self._leave_lobby(next(iter(self.lobby)))
        self.lobby[gate] = self.guard.loop.time()
        self.guard.loop.call_later(LOBBY_CHECK_S, self._recheck, gate)

    def _recheck(self, gate: TlsGate) -> None:
        came = self.lobby.get(gate)
        if came is None:  # gone, or it moved on
            return
        if gate.spoke() or len(self.pending) < self.guard.limits.max_handshakes:
            self._leave_lobby(gate)
        elif self.guard.loop.time() - came >= LOBBY_WAIT_S:
            self.lobby.pop(gate, None)
            self._refuse(gate)
        else:
            self.guard.loop.call_later(LOBBY_CHECK_S, self._recheck, gate)

    def _leave_lobby(self, gate: TlsGate) -> None:
        self.lobby.pop(gate, None)
        if gate.spoke() and self.admit(gate):
            gate.start()
        else:
            self._refuse(gate)

    def _refuse(self, gate: TlsGate) -> None:
        self.guard.refused(Refusal.TOO_MANY_CONNECTIONS)
        gate.reset()

    def admit(self, gate: TlsGate) -> bool:
        """Room for `gate`'s handshake, made when needed: see ``victim``."""
        if len(self.pending) >= self.guard.limits.max_handshakes:
            victim = self.victim(gate)
            if victim is None:
                return False
            self._refuse(victim)
        self.pending[gate] = None
        self.by_source.setdefault(gate.source, {})[gate] = None
        return True

    def victim(self, gate: TlsGate) -> TlsGate | None:
        """The handshake `gate` replaces at the bound: the oldest of the source holding the most,
        when that is another source (a peer agent holds one or two; a flood from one address
        cannot keep another address out); else, when `gate`'s client has spoken (sent a
        ClientHello's worth of bytes), the oldest whose client has not (a silent flood from the
        peer's own address cannot keep the peer out); else the oldest handshake still running
        after ``slow_handshake_s``; else none."""
        source = gate.source
        busiest = max(self.by_source, key=lambda s: len(self.by_source[s]))
        if busiest != source and len(self.by_source[busiest]) > len(self.by_source.get(source, ())) + 1:
            return next(iter(self.by_source[busiest]))
        if gate.spoke():
            for held in self.pending:  # oldest first; a flood's oldest is silent, so this ends at once
                if not held.spoke():
                    return held
        oldest = next(iter(self.pending))
        if self.guard.loop.time() - oldest.since >= self.guard.limits.slow_handshake_s:
            return oldest
        return None

    def done(self, gate: TlsGate) -> None:
        self.lobby.pop(gate, None)
        if self.pending.pop(gate, None) is None:
            return
        mine = self.by_source.get(gate.source)
        if mine is not None:
            mine.pop(gate, None)
            if not mine:
                del self.by_source[gate.source]

    def close(self) -> None:
        for gate in [*self.pending, *self.lobby]:
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
        self._spoke = False

    def spoke(self) -> bool:
        """Whether the client sent a ClientHello's worth of bytes (once it has, it stays so)."""
        if not self._spoke and self.raw is not None:
            received = bytes_received(self.raw)
            self._spoke = received is None or received >= HELLO_BYTES
        return self._spoke

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.raw = transport
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        transport.pause_reading()  # nothing is read before start_tls takes the connection over
        self.handshakes.arrive(self)

    def start(self) -> None:
        """Its handshake, now that it holds a place."""
        assert self.raw is not None
        self.task = self.handshakes.guard.loop.create_task(self._upgrade(self.raw))

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
