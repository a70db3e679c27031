"""Two doors, two credentials, on real agent processes: the peer door (mutual TLS from the
cluster's CA, the caller named by its certificate and found in the rank map) and the engine door
(loopback only, the engine token). Neither credential opens the other door, and neither door
serves the other's routes."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol import tls
from pdfabric_devcluster.agents import peer_request
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_operator import pki
from tests.e2e.specs import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC = TINY
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


@pytest.fixture(scope="module")
def lc() -> Iterator[LocalFabric]:
    with LocalFabric(SPEC) as fabric:
        yield fabric


def done_report(lc: LocalFabric, room: int) -> bytes:
    body = {"cluster": lc.uid, "room": room, "decode_rank": D, "prefill_rank": P, "ok": True}
    return json.dumps(body).encode()


def engine_get(address: str, path: str, token: str | None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://{address}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---------------------------------------------------------------- the peer door


def test_a_rank_map_agent_with_its_certificate_is_admitted(lc: LocalFabric) -> None:
    decode = lc.agents[lc.agent_of(D)]
    status, doc = peer_request(decode, "GET", "/v1/peer/ping", tls_dir=lc.agents[lc.agent_of(P)].tls_dir)
    assert (status, doc) == (200, {"agent": decode.name})
    # ... and its message reaches the handler (which refuses a room it does not know).
    status, doc = lc.peer_post(decode.name, "/v1/peer/done", done_report(lc, 1), as_agent=lc.agent_of(P))
    assert (status, doc["reason"]) == (404, "unknown_room")


def test_transfer_metadata_is_the_peer_doors_and_refused_where_no_backend_needs_it(lc: LocalFabric) -> None:
    """Mooncake's engines handshake on their own: a peer asking for a rank's transfer metadata is
    told so (400), an unknown rank is 404, and the engine door has no such route."""
    decode, caller = lc.agents[lc.agent_of(D)], lc.agents[lc.agent_of(P)].tls_dir
    status, doc = peer_request(decode, "GET", f"/v1/peer/metadata?rank={D}", tls_dir=caller)
    assert (status, doc["reason"]) == (400, "malformed") and "hands out no transfer metadata" in doc["error"]
    status, doc = peer_request(decode, "GET", "/v1/peer/metadata?rank=decode-9-tp0", tls_dir=caller)
    assert (status, doc["reason"]) == (404, "unknown_rank")
    assert engine_get(decode.address, f"/v1/peer/metadata?rank={D}", lc.token)[0] == 404


def test_a_nixl_ranks_metadata_is_handed_to_a_peer_with_its_endpoint() -> None:
    """On NIXL the decode rank's metadata (what a writer loads before its first write) comes from its
    agent, for the endpoint its room info names, to a rank map agent only."""
    with LocalFabric({**SPEC, "backend": "nixl"}) as nixl:
        decode, caller = nixl.agents[nixl.agent_of(D)], nixl.agents[nixl.agent_of(P)].tls_dir
        status, doc = peer_request(decode, "GET", f"/v1/peer/metadata?rank={D}", tls_dir=caller)
        assert status == 200 and doc["rank"] == D
        assert doc["endpoint"] == nixl.client(D).info().rank(D).endpoint
        assert len(base64.b64decode(doc["metadata"])) > 100
        with pytest.raises((ssl.SSLError, ConnectionError)):
            peer_request(decode, "GET", f"/v1/peer/metadata?rank={D}")  # no client certificate


def test_a_peer_call_without_a_client_certificate_is_refused_in_the_handshake(lc: LocalFabric) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError)):
        lc.peer_post(lc.agent_of(D), "/v1/peer/done", done_report(lc, 2), as_agent=None)


def test_a_certificate_from_another_clusters_ca_is_refused(lc: LocalFabric, tmp_path: Path) -> None:
    # The same agent name and DNS name as a real peer, signed by another PDCluster's CA.
    other_ca = pki.new_ca(lc.rankmap.namespace, lc.rankmap.cluster, "uid-of-another-cluster")
    forged = lc.issue_peer_tls(lc.agent_of(P), tmp_path / "forged", ca=other_ca)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        lc.peer_post(lc.agent_of(D), "/v1/peer/done", done_report(lc, 3), as_agent=None, tls_dir=forged)


def test_a_certificate_of_an_agent_not_in_the_rank_map_is_refused(lc: LocalFabric, tmp_path: Path) -> None:
    stranger = lc.issue_peer_tls("agent-not-in-the-rank-map", tmp_path / "stranger")
    status, doc = lc.peer_post(lc.agent_of(D), "/v1/peer/done", done_report(lc, 4), as_agent=None, tls_dir=stranger)
    assert (status, doc["reason"]) == (403, "unauthorized")
    assert "agent-not-in-the-rank-map" in doc["error"]


def test_the_engine_token_does_not_open_the_peer_door(lc: LocalFabric) -> None:
    decode = lc.agents[lc.agent_of(D)]
    # Plain HTTP with the token: the door speaks TLS only, nothing is answered.
    conn = http.client.HTTPConnection(decode.host, decode.peer_port, timeout=5)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        conn.request("POST", "/v1/peer/done", done_report(lc, 5), {"Authorization": f"Bearer {lc.token}"})
        conn.getresponse()
    conn.close()
    # TLS without a client certificate, with the token: refused in the handshake.
    ctx = ssl.create_default_context(cafile=str(Path(decode.tls_dir) / tls.CA_FILE))
    with socket.create_connection((decode.host, decode.peer_port), timeout=5) as raw:
        sock = ctx.wrap_socket(raw, server_hostname=decode.peer_host)
        conn = http.client.HTTPConnection(decode.host, decode.peer_port, timeout=5)
        conn.sock = sock
        with pytest.raises((ssl.SSLError, ConnectionError)):
            conn.request("GET", "/v1/peer/ping", headers={"Authorization": f"Bearer {lc.token}"})
            conn.getresponse()
        conn.close()


def test_the_peer_door_serves_no_engine_route(lc: LocalFabric) -> None:
    decode = lc.agents[lc.agent_of(D)]
    prefill_tls = lc.agents[lc.agent_of(P)].tls_dir
    for method, path in (("GET", "/v1/info"), ("POST", "/v1/receive"), ("GET", f"/v1/rooms/{D}/1")):
        body = b"{}" if method == "POST" else None
        status, doc = peer_request(decode, method, path, body, tls_dir=prefill_tls)
        assert (status, doc["reason"]) == (404, "malformed"), path


def test_a_peer_verifies_the_servers_name(lc: LocalFabric) -> None:
    """The client side checks the server's certificate names the agent it dials: the decode
    agent's door, reached as if it were the prefill agent, fails verification."""
    decode, prefill = lc.agents[lc.agent_of(D)], lc.agents[lc.agent_of(P)]
    ctx = tls.client_context(prefill.tls_dir)
    with (
        socket.create_connection((decode.host, decode.peer_port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(raw, server_hostname=prefill.peer_host)


# ---------------------------------------------------------------- the engine door


def test_the_engine_door_wants_the_engine_token(lc: LocalFabric) -> None:
    decode = lc.agents[lc.agent_of(D)]
    assert engine_get(decode.address, "/v1/info", None)[1]["reason"] == "unauthorized"
    assert engine_get(decode.address, "/v1/info", "x" * 32)[0] == 401
    assert engine_get(decode.address, "/v1/info", lc.token)[0] == 200


def test_a_peer_certificate_is_not_enough_on_the_engine_door(lc: LocalFabric) -> None:
    decode, prefill = lc.agents[lc.agent_of(D)], lc.agents[lc.agent_of(P)]
    # The engine door speaks no TLS: a peer's client certificate has nothing to present to.
    ctx = tls.client_context(prefill.tls_dir)
    with (
        socket.create_connection(("127.0.0.1", decode.api_port), timeout=5) as raw,
        pytest.raises((ssl.SSLError, ConnectionError)),
    ):
        ctx.wrap_socket(raw, server_hostname=decode.peer_host)
    # Without the engine token, whoever calls is refused.
    assert engine_get(decode.address, "/v1/info", None)[0] == 401


def test_the_engine_door_serves_no_peer_route_even_with_the_token(lc: LocalFabric) -> None:
    decode = lc.agents[lc.agent_of(D)]
    client = lc.client(D)
    for path in ("/v1/peer/done", "/v1/peer/dst", "/v1/peer/launched", "/v1/peer/cancel"):
        with pytest.raises(AgentRefused) as info:
            client._call("POST", path, {"room": 1})
        assert (info.value.status, info.value.reason) == (404, "malformed"), path
    assert engine_get(decode.address, "/v1/peer/ping", lc.token)[0] == 404


def test_a_tls_handshake_that_never_comes_is_cut_off() -> None:
    """A client that connects to the peer door and sends nothing (or half a ClientHello) holds the
    connection no longer than the head timeout: the handshake is bounded like a request head."""
    import time

    with LocalFabric(SPEC, env={"PDFABRIC_HEADER_TIMEOUT_S": "1"}) as fabric:
        agent = next(iter(fabric.agents.values()))
        host, port = agent.peer_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then silence
            started = time.monotonic()
            assert s.recv(1024) == b""  # closed by the agent
            assert time.monotonic() - started < 5


def _presented_serial(agent: Any, client_tls_dir: str) -> int:
    ctx = tls.client_context(client_tls_dir)
    with (
        socket.create_connection((agent.host, agent.peer_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=agent.peer_host) as sock,
    ):
        return int(sock.getpeercert()["serialNumber"], 16)


def test_a_running_agent_takes_its_renewed_certificate() -> None:
    """The operator renews an agent's certificate in place (Secret files rewritten): the running
    agent presents the new one to new connections within its 10 s check, and rooms still move."""
    with LocalFabric(SPEC) as fabric:
        decode, prefill = fabric.agents[fabric.agent_of(D)], fabric.agents[fabric.agent_of(P)]
        first = _presented_serial(decode, prefill.tls_dir)
        fabric.issue_peer_tls(decode.name, Path(decode.tls_dir))  # rewritten in place, file by file
        cert_pem = (Path(decode.tls_dir) / tls.CERT_FILE).read_bytes()
        renewed = x509.load_pem_x509_certificate(cert_pem).serial_number
        assert renewed != first
        deadline = time.monotonic() + 30
        while _presented_serial(decode, prefill.tls_dir) != renewed:
            assert time.monotonic() < deadline, "the agent did not load its renewed certificate"
            time.sleep(0.5)
        loaded = fabric.metric_sum("pdfabric_peer_certificate_reloads_total", names=[decode.name], outcome="loaded")
        assert loaded >= 1  # (a check between the file writes may also have counted a refusal)
        fabric.client(D).receive(D, 5, [0, 1])
        fabric.client(P).send(P, 5, [2, 3])
        assert fabric.client(D).wait(D, 5, 10).state.title == "Success"
        assert fabric.client(P).wait(P, 5, 10).state.title == "Success"
