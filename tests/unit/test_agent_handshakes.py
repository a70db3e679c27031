"""The peer door's TLS handshake phase (issue 27, item 1), in-process: a real mutual-TLS listener
served by ``GuardedTCPSite`` on a loopback socket, clients with real certificates and raw sockets
that connect and never finish a handshake. Handshakes in progress are bounded in count (the oldest
slow one makes room) and time, and a closed TLS connection's descriptor goes within the TLS
shutdown bound."""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from pdfabric_agent.http.guard import Limits
from pdfabric_agent.http.handshakes import HELLO_BYTES
from pdfabric_agent.protocol import tls
from pdfabric_agent.runtime import metrics
from pdfabric_devcluster.agents import write_tls_dir
from pdfabric_operator import pki
from tests.deadlines import wait_until
from tests.unit.served import Served

CLUSTER = "handshakes"
HOST = "agent-0.test"


@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the server's, a client agent's) peer TLS directories, of one cluster CA."""
    base = tmp_path_factory.mktemp("tls")
    ca = pki.new_ca("ns", CLUSTER, "uid-handshakes")
    server = pki.issue_agent(ca, namespace="ns", cluster=CLUSTER, agent="agent-0", dns_name=HOST)
    client = pki.issue_agent(ca, namespace="ns", cluster=CLUSTER, agent="agent-1", dns_name="agent-1.test")
    return str(write_tls_dir(base / "server", server, ca)), str(write_tls_dir(base / "client", client, ca))


def tls_served(server_tls: str, limits: Limits) -> Served:
    """A one-route app (GET /ping answers the caller's agent name) behind a guarded TLS listener."""

    async def ping(request: web.Request) -> web.Response:
        peer = tls.peer_agent(request.transport.get_extra_info("peercert") if request.transport else None)
        return web.json_response({"peer": peer})

    app = web.Application()
    app.router.add_get("/ping", ping)
    return Served(app, limits, CLUSTER, tls.server_context(server_tls))


LIMITS = Limits(header_timeout_s=1.5, idle_timeout_s=1.0, max_handshakes=8, slow_handshake_s=0.2, tls_shutdown_s=0.5)


@pytest.fixture
def served(tls_dirs: tuple[str, str]) -> Iterator[Served]:
    s = tls_served(tls_dirs[0], LIMITS)
    yield s
    s.close()


def good_get(port: int, client_tls: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """One HTTPS GET /ping as a peer agent would (its certificate, the server's name verified)."""
    ctx = tls.client_context(client_tls)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw,
        ctx.wrap_socket(raw, server_hostname=HOST) as s,
    ):
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


# A handshake record header announcing 16 KiB, then a ClientHello's worth of its bytes: the TLS
# server waits for the rest of the record, and the client has spoken (handshakes.HELLO_BYTES).
SPOKEN = b"\x16\x03\x01\x40\x00" + b"\x01" + b"\x00" * (HELLO_BYTES + 32)


def half_open(port: int, n: int, source: str = "127.0.0.1", *, spoken: bool = False) -> list[socket.socket]:
    """`n` connections from `source` that start a ClientHello and never finish it: with its first
    three bytes (silent), or `spoken`, a ClientHello's worth of it."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        s.sendall(SPOKEN if spoken else b"\x16\x03\x01")
        socks.append(s)
    return socks


def at_the_bound(served: Served, limits: Limits) -> None:
    """Wait until the served door holds as many handshakes as its bound allows."""
    wait_until(lambda: served.handshaking == limits.max_handshakes, timeout=2, what="the handshake bound reached")


def refusals(reason: str) -> float:
    return metrics.api_refusals.labels(CLUSTER, reason)._value.get()


def test_a_peer_with_its_certificate_is_served(served: Served, tls_dirs: tuple[str, str]) -> None:
    assert good_get(served.port, tls_dirs[1]) == (200, b'{"peer": "agent-1"}')
    wait_until(lambda: served.handshaking == 0, timeout=2, what="served.handshaking == 0")


def test_a_client_without_a_certificate_is_refused_in_the_handshake_and_counted(served: Served) -> None:
    before = refusals("tls_handshake")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=HOST) as s:
                s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = s.recv(100)  # TLS 1.3: the client learns of the refusal on its first read
        except (ssl.SSLError, OSError):
            answer = b""
    assert answer == b""  # no HTTP answer: the connection ended in the handshake
    wait_until(lambda: refusals("tls_handshake") == before + 1, timeout=2, what="tls_handshake refusals counted")
    assert served.open_connections == 0 and served.handshaking == 0


def ended_by_peer(s: socket.socket, timeout_s: float = 2.0) -> bool:
    """The agent closed the connection (a reset when bytes it never read were left, else EOF)."""
    s.settimeout(timeout_s)
    try:
        return s.recv(10) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_open_handshakes_are_bounded_and_a_peer_still_gets_through(
    served: Served, tls_dirs: tuple[str, str]
) -> None:
    socks = half_open(served.port, 40)
    try:
        at_the_bound(served, LIMITS)
        time.sleep(LIMITS.slow_handshake_s)  # the held ones are now slow: a new connection evicts one
        assert good_get(served.port, tls_dirs[1]) == (200, b'{"peer": "agent-1"}')
        assert served.handshaking <= LIMITS.max_handshakes
        ended = sum(ended_by_peer(s, 0.2) for s in socks)
        assert ended >= 40 - LIMITS.max_handshakes  # each one past the bound, and the one evicted
    finally:
        for s in socks:
            s.close()


def test_at_the_bound_a_new_connection_is_reset_while_every_handshake_is_young_and_spoke(
    tls_dirs: tuple[str, str],
) -> None:
    patient = Limits(header_timeout_s=10, max_handshakes=4, slow_handshake_s=5)
    served = tls_served(tls_dirs[0], patient)
    before = refusals("too_many_connections")
    socks = half_open(served.port, patient.max_handshakes, spoken=True)
    try:
        at_the_bound(served, patient)
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as extra:
            extra.sendall(b"\x16\x03\x01")
            assert ended_by_peer(extra)
        assert refusals("too_many_connections") == before + 1
        assert served.handshaking == patient.max_handshakes
        assert not any(ended_by_peer(s, 0.1) for s in socks)  # the young ones kept their place
    finally:
        for s in socks:
            s.close()
        served.close()


def test_a_flood_from_one_address_cannot_keep_a_peer_at_another_out(tls_dirs: tuple[str, str]) -> None:
    """Every handshake slot young and held by 127.0.0.2: a peer at 127.0.0.1 takes the place of
    the flood's oldest, and the flood cannot take it back (its own connections are reset)."""
    patient = Limits(header_timeout_s=10, max_handshakes=4, slow_handshake_s=5)
    served = tls_served(tls_dirs[0], patient)
    flood = half_open(served.port, patient.max_handshakes, source="127.0.0.2")
    try:
        at_the_bound(served, patient)
        assert good_get(served.port, tls_dirs[1]) == (200, b'{"peer": "agent-1"}')
        assert ended_by_peer(flood[0], 1.0)  # the oldest of the flood made room
        # The free slot, then one too many: every slot young and spoken (the flood's silent ones
        # would make room for a client that speaks, below), so the flood's new one is reset.
        for s in flood[1:]:
            s.sendall(SPOKEN[3:])
        refill, more = half_open(served.port, 2, source="127.0.0.2", spoken=True)
        with refill, more:
            assert ended_by_peer(more) and not ended_by_peer(refill, 0.1)
    finally:
        for s in flood:
            s.close()
        served.close()


def test_a_silent_flood_from_the_peers_own_address_cannot_keep_the_peer_out(tls_dirs: tuple[str, str]) -> None:
    """Every slot young and held from 127.0.0.1, the peer's own address, by clients that sent three
    bytes: the peer's connection (its ClientHello came with its connect) takes the place of the
    oldest silent one and is served; a new client that spoke takes the next; a new silent one is
    reset at once, as before; a spoken one's place is never taken while it is young."""
    patient = Limits(header_timeout_s=10, max_handshakes=4, slow_handshake_s=5)
    served = tls_served(tls_dirs[0], patient)
    (spoke,) = half_open(served.port, 1, spoken=True)
    silent = half_open(served.port, patient.max_handshakes - 1)
    try:
        at_the_bound(served, patient)
        assert good_get(served.port, tls_dirs[1]) == (200, b'{"peer": "agent-1"}')
        assert ended_by_peer(silent[0], 1.0)  # the oldest silent one made room
        (refill,) = half_open(served.port, 1)  # the slot the peer's finished handshake freed
        (quiet,) = half_open(served.port, 1)
        with refill, quiet:
            assert ended_by_peer(quiet, 1.0) and not ended_by_peer(silent[1], 0.1)
            (speaking,) = half_open(served.port, 1, spoken=True)
            with speaking:
                assert ended_by_peer(silent[1], 1.0) and not ended_by_peer(speaking, 0.1)
        assert not ended_by_peer(spoke, 0.1)  # the oldest of all, but it spoke
    finally:
        for s in (spoke, *silent):
            s.close()
        served.close()


def test_a_handshake_that_never_finishes_is_reset_at_the_head_timeout(served: Served) -> None:
    before = refusals("tls_handshake")
    (s,) = half_open(served.port, 1)
    with s:
        started = time.monotonic()
        assert ended_by_peer(s, LIMITS.header_timeout_s + 3)
        took = time.monotonic() - started
    assert LIMITS.header_timeout_s - 0.3 <= took <= LIMITS.header_timeout_s + 2
    wait_until(lambda: served.handshaking == 0, timeout=2, what="served.handshaking == 0")
    assert refusals("tls_handshake") == before + 1


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_closed_tls_connection_releases_its_descriptor_within_the_shutdown_bound(
    served: Served, tls_dirs: tuple[str, str]
) -> None:
    """Idle TLS connections the agent closes, from clients that never answer its close_notify (they
    do not read): the agent's side is released after tls_shutdown_s, not asyncio's 30 s."""
    ctx = tls.client_context(tls_dirs[1])
    before = open_fds()
    clients = []
    for _ in range(10):
        raw = socket.create_connection(("127.0.0.1", served.port), timeout=5)
        clients.append(ctx.wrap_socket(raw, server_hostname=HOST))
    wait_until(lambda: served.open_connections == 10, timeout=3, what="served.open_connections == 10")
    opened = open_fds()  # relative to this count: a descriptor of an earlier test may close meanwhile
    assert opened >= before + 20  # each connection: the client's socket and the agent's
    try:
        # idle timeout, then the shutdown bound, with margin for the 0.25 s sweep
        wait_until(
            lambda: open_fds() <= opened - 10,
            timeout=LIMITS.idle_timeout_s + LIMITS.tls_shutdown_s + 2,
            what="the agent's 10 descriptors released",
        )
        assert served.open_connections == 0
    finally:
        for c in clients:
            c.close()


def test_limits_read_the_handshake_bound_from_the_environment() -> None:
    assert Limits.from_env({"PDFABRIC_MAX_HANDSHAKES": "12"}).max_handshakes == 12
    with pytest.raises(ValueError, match="PDFABRIC_MAX_HANDSHAKES must be positive"):
        Limits.from_env({"PDFABRIC_MAX_HANDSHAKES": "0"})
    with pytest.raises(ValueError, match="not a number"):
        Limits.from_env({"PDFABRIC_MAX_HANDSHAKES": "1.5"})
