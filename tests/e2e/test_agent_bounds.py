"""Slow and partial clients against real agents (issue 10, item 4): slowloris heads, chunked bodies
that never end, bodies shorter than declared and a connection flood are cut off and counted, while a
good room on the same agents still succeeds and the agent's descriptors stay bounded."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pdfabric_agent.process import main as agent_main
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.transfer import transfer_room

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not hasattr(agent_main, "GuardedTCPSite"),
        reason="main.py does not serve its listeners through guard.GuardedTCPSite yet",
    ),
]

SMALL = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 5},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "auxRowBytes": [8, 8]},
}
MAX_CONNECTIONS = 48
BOUNDS = {
    "PDFABRIC_HEADER_TIMEOUT_S": "2",
    "PDFABRIC_BODY_TIMEOUT_S": "2",
    "PDFABRIC_IDLE_TIMEOUT_S": "5",
    "PDFABRIC_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
}


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def lc(request: pytest.FixtureRequest) -> Iterator[LocalFabric]:
    """The agents over each byte mover: the bounds are the agent's, the room moves on either."""
    with LocalFabric({**SMALL, "backend": request.param}, env=BOUNDS) as fabric:
        yield fabric


def fds(lc: LocalFabric, name: str) -> int:
    proc = lc.agents[name].proc
    assert proc is not None
    return len(os.listdir(f"/proc/{proc.pid}/fd"))


def cut_off_count(lc: LocalFabric) -> float:
    return sum(lc.metric_sum("pdfabric_api_refusals_total", reason=r) for r in ("timeout", "too_many_connections"))


def attackers(lc: LocalFabric, name: str, stop: threading.Event, opened: list[int]) -> None:
    """Keep opening bad connections until ``stop``: slow heads, endless chunked bodies (with and
    without the token), bodies shorter than declared."""
    host, port = lc.agents[name].address.split(":")
    heads = [
        b"GET /v1/info HTTP/1.1\r\nHo",
        b"POST /v1/send HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n \r\n",
        f"POST /v1/send HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {lc.token}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n1\r\n \r\n".encode(),
        f"POST /v1/send HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {lc.token}\r\n"
        'Content-Length: 1000\r\n\r\n{"cluster": '.encode(),
    ]
    socks: list[socket.socket] = []
    i = 0
    while not stop.is_set():
        with contextlib.suppress(OSError):
            s = socket.create_connection((host, int(port)), timeout=1)
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.send(heads[i % len(heads)])
            socks.append(s)
            opened[0] += 1
        i += 1
        for s in list(socks):  # trickle: one more byte of head or chunk now and then
            with contextlib.suppress(OSError):
                s.send(b"1\r\n \r\n" if i % 4 else b"s")
        if len(socks) > 3 * MAX_CONNECTIONS:
            for s in socks[:MAX_CONNECTIONS]:
                s.close()
            del socks[:MAX_CONNECTIONS]
        time.sleep(0.01)
    for s in socks:
        s.close()


def test_a_good_room_succeeds_while_slow_clients_flood_both_agents(lc: LocalFabric) -> None:
    names = sorted(lc.agents)
    baseline = {n: fds(lc, n) for n in names}
    cut_off = cut_off_count(lc)
    stop = threading.Event()
    opened = [0]
    threads = [threading.Thread(target=attackers, args=(lc, n, stop, opened), daemon=True) for n in names]
    for t in threads:
        t.start()
    peak = dict(baseline)
    try:
        time.sleep(3)  # past the head and body timeouts: the flood is at its steady state
        for room in range(1, 4):
            result = transfer_room(lc, room, pages=8, state_slots=0, timeout_s=30)
            assert {v.state.title for v in result.decode.values()} == {"Success"}, result
            assert {v.state.title for v in result.prefill.values()} == {"Success"}, result
            assert not any(result.errors.values())
            peak = {n: max(peak[n], fds(lc, n)) for n in names}
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert opened[0] > 2 * MAX_CONNECTIONS  # the flood was past the bound
    for n in names:  # API listener bounded; metrics listener, peers and engines take a few more
        assert peak[n] <= baseline[n] + MAX_CONNECTIONS + 24, (n, baseline[n], peak[n])
    # More were cut off (evicted at the bound or timed out) and counted than the bound could ever hold.
    assert cut_off_count(lc) > cut_off + MAX_CONNECTIONS
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(fds(lc, n) > baseline[n] + 4 for n in names):
        time.sleep(0.2)
    assert all(fds(lc, n) <= baseline[n] + 4 for n in names), {n: fds(lc, n) for n in names}
    assert all(lc.agents[n].alive() for n in names)
