"""Bounded listeners and bodies (issue 10, items 4-6), in-process: the real API app served by
``GuardedTCPSite`` on a loopback socket, spoken to with raw sockets. Slow heads and bodies are cut
off and answered 408, the connection bound refuses or evicts, bad input of every kind is a counted
JSON 4xx, and nothing is created by a refusal."""

from __future__ import annotations

import inspect
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfabric_agent.http import server
from pdfabric_agent.http.guard import Limits, peer_door_bound
from pdfabric_agent.http.jsonbody import BODY_FLOOR, MAX_DEPTH, body_cap, check_shape, decode_json
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.peers.client import STREAM_IDLE_S
from pdfabric_agent.process.limits import size_peer_door
from pdfabric_agent.protocol.views import RoomView
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.config import AgentConfig
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from pdfabric_core.spec import parse_spec
from tests.deadlines import wait_until
from tests.unit.served import Served

TOKEN = "t" * 32
UID = "uid-bounds"
CLUSTER = "bounds"


def make_agent(tmp_path: Path) -> Agent:
    cfg = AgentConfig(
        node_name="n1", pod_name="a1", rankmap_path="unused", token=TOKEN, bind_address="127.0.0.1",
        api_port=None, metrics_port=None, engine_host="127.0.0.1", shm_dir=str(tmp_path), heartbeat_s=1000,
    )  # fmt: skip
    raw: dict[str, Any] = {"prefill": {"tp": 1}, "decode": {"tp": 1}}
    entries = (AgentEntry("a1", "n1", (Rank(Role.PREFILL, 0, 0),)), AgentEntry("a2", "n2", (Rank(Role.DECODE, 0, 0),)))
    rankmap = RankMap("ns", CLUSTER, UID, "tcp", raw, entries)
    return Agent(cfg, rankmap, parse_spec(raw), {}, "tcp")


def engine_app(agent: Agent) -> web.Application:
    """The engine-facing API app (the door argument, where the tree has one)."""
    build: Any = server.build_api_app
    door = getattr(server, "Door", None)
    if "door" in inspect.signature(build).parameters and door is not None:
        return build(agent, door.ENGINE)  # type: ignore[no-any-return]
    return build(agent)  # type: ignore[no-any-return]


FAST = Limits(header_timeout_s=0.4, body_timeout_s=0.4, idle_timeout_s=1.0, max_connections=8, lingering_s=0.2)


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    return make_agent(tmp_path)


@pytest.fixture
def served(agent: Agent) -> Iterator[Served]:
    s = Served(engine_app(agent), FAST, CLUSTER)
    yield s
    s.close()


def refusals(reason: str) -> float:
    value = metrics.REGISTRY.get_sample_value("pdfabric_api_refusals_total", {"pdcluster": CLUSTER, "reason": reason})
    return value or 0.0


def read_answer(sock: socket.socket, timeout_s: float = 5.0) -> tuple[int, dict[str, Any], bytes]:
    """(status, JSON body, raw bytes) of one answer; reads until the body is complete or EOF."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    assert headers.get("content-type", "").startswith("application/json"), data
    return int(lines[0].split()[1]), json.loads(rest[:length]), data


def closed_soon(sock: socket.socket, timeout_s: float = 3.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def request(method: str, path: str, body: bytes = b"", *, token: str = TOKEN, extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n{extra}"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def post_json(served: Served, path: str, body: bytes, *, extra: str = "") -> tuple[int, dict[str, Any]]:
    with served.connect() as sock:
        sock.sendall(request("POST", path, body, extra=extra))
        status, doc, _ = read_answer(sock)
        return status, doc


def no_rooms(agent: Agent) -> bool:
    return not (agent.rooms.prefill or agent.rooms.decode or agent.rooms.unsent)


# ---------------------------------------------------------------- slow clients
def test_a_head_sent_one_byte_at_a_time_is_cut_off_with_408(served: Served) -> None:
    before = refusals("timeout")
    with served.connect() as sock:
        start = time.monotonic()
        for byte in b"GET /v1/info HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
            if time.monotonic() - start > 2:
                break
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (408, "timeout")
        assert time.monotonic() - start < FAST.header_timeout_s + 1.0
        assert closed_soon(sock)
    assert refusals("timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(served: Served) -> None:
    with served.connect() as sock:
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (408, "timeout")
        assert closed_soon(sock)
    wait_until(lambda: served.open_connections == 0, timeout=3, what="connections closed")


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(request("GET", "/v1/info"))
        status, _, _ = read_answer(sock)
        assert status == 200
        start = time.monotonic()
        assert closed_soon(sock, 4.0)
        assert FAST.idle_timeout_s - 0.1 <= time.monotonic() - start < FAST.idle_timeout_s + 1.0


def test_a_body_shorter_than_declared_is_answered_408(served: Served) -> None:
    before = refusals("timeout")
    with served.connect() as sock:
        sock.sendall(
            request("POST", "/v1/send", b"")[: -len(b"\r\n")].replace(b"Content-Length: 0", b"Content-Length: 100")
        )
        sock.sendall(b'\r\n{"cluster": ')
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (408, "timeout")
        assert closed_soon(sock)
    assert refusals("timeout") == before + 1


def test_a_chunked_body_that_never_ends_is_cut_off(served: Served, agent: Agent) -> None:
    with served.connect() as sock:
        head = (
            f"POST /v1/send HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        deadline = time.monotonic() + 3
        try:
            while time.monotonic() < deadline:
                sock.sendall(b"1\r\n \r\n")
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (408, "timeout")
    assert no_rooms(agent)


def test_a_fast_chunked_body_past_the_cap_is_413(served: Served, agent: Agent) -> None:
    before = refusals("too_large")
    with served.connect() as sock:
        head = (
            f"POST /v1/send HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        try:
            for _ in range(BODY_FLOOR // 65536 + 4):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (413, "too_large")
    assert refusals("too_large") == before + 1
    assert no_rooms(agent)


def test_a_declared_length_past_the_cap_is_413_before_the_body(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(request("POST", "/v1/send").replace(b"Content-Length: 0", b"Content-Length: 999999999"))
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (413, "too_large")


def test_without_the_token_a_body_is_not_waited_for(agent: Agent) -> None:
    # A body timeout far above the bound: waiting for the (never ending) body would show as an
    # answer after it, however loaded the machine (the FAST 0.4 s left no room for a busy CI).
    patient = Limits(header_timeout_s=10, body_timeout_s=10, idle_timeout_s=30, max_connections=8, lingering_s=0.2)
    s = Served(engine_app(agent), patient, CLUSTER)
    try:
        with s.connect() as sock:
            head = "POST /v1/send HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n \r\n"
            sock.sendall(head.encode())
            start = time.monotonic()
            status, doc, _ = read_answer(sock)
            assert (status, doc["reason"]) == (401, "unauthorized")
            assert time.monotonic() - start < 5.0  # here ~3 ms
            assert closed_soon(sock)
    finally:
        s.close()


def test_the_connection_bound_refuses_at_once_and_spares_established_clients(agent: Agent) -> None:
    limits = Limits(
        header_timeout_s=5, body_timeout_s=5, idle_timeout_s=30, max_connections=8, lingering_s=0.2, slow_head_s=1.0
    )
    s = Served(engine_app(agent), limits, CLUSTER)
    try:
        good = s.connect()
        good.sendall(request("GET", "/v1/info"))
        assert read_answer(good)[0] == 200
        # Fill the rest with slow heads, young: nothing to evict, so the next one is refused.
        slow = [s.connect() for _ in range(7)]
        for sock in slow:
            sock.sendall(b"GET /v1/info HT")
        wait_until(lambda: s.open_connections == 8, timeout=3, what="8 connections held")
        before = refusals("too_many_connections")
        with s.connect() as extra:
            status, doc, _ = read_answer(extra)
            assert (status, doc["reason"]) == (429, "too_many_connections")
        assert refusals("too_many_connections") == before + 1
        # The established client keeps being served.
        good.sendall(request("GET", "/v1/info"))
        assert read_answer(good)[0] == 200
        # Once the slow heads are slow_head_s old, a new client takes the place of one of them.
        time.sleep(1.1)
        with s.connect() as newcomer:
            newcomer.sendall(request("GET", "/v1/info"))
            assert read_answer(newcomer)[0] == 200
        assert s.open_connections <= 8
        for sock in slow:
            sock.close()
        good.close()
    finally:
        s.close()


def test_the_peer_door_bound_follows_the_rank_map(agent: Agent) -> None:
    """Every agent of the rank map may hold a stream and pooled connections to the peer door: a
    decode agent of the largest PDCluster hears from 512 prefill agents, past the 256 a listener
    holds by default, which refused the 257th peer's stream and then every call of it (429)."""
    assert peer_door_bound(1024, Limits()) == 3 * 1024 + 64
    assert peer_door_bound(4, Limits()) == Limits().max_connections  # never below the setting
    assert peer_door_bound(4, Limits(max_connections=1000)) == 1000
    limits = Limits(header_timeout_s=5, max_connections=4, slow_head_s=5.0)
    s = Served(engine_app(agent), limits, CLUSTER)
    try:
        assert s.site is not None and s.site.guard is not None
        size_peer_door(s.site.guard, agent)
        assert s.site.guard.max_connections == peer_door_bound(len(agent.rankmap.agents), limits) > 4
        held = [s.connect() for _ in range(6)]
        for sock in held:
            sock.sendall(b"GET /v1/info HT")  # young slow heads: none would make room at a bound of 4
        wait_until(lambda: s.open_connections == 6, timeout=3, what="6 connections held past the setting's 4")
        for sock in held:
            sock.close()
    finally:
        s.close()


def test_streams_unused_for_a_minute_are_closed_by_their_opener(agent: Agent) -> None:
    """An agent holds streams to the peers it talks to now: one unused for STREAM_IDLE_S with no call
    waiting, or already closed, is taken out for closing; one in use or with a call waiting stays."""

    class Stream:
        def __init__(self, *, open_: bool = True, busy: bool = False) -> None:
            self.open, self.busy = open_, busy

    peers = agent.peers
    now = 1000.0
    streams = {"idle": Stream(), "busy": Stream(busy=True), "recent": Stream(), "closed": Stream(open_=False)}
    peers._streams.update(streams)  # type: ignore[arg-type]
    peers._stream_used.update(
        {"idle": now - STREAM_IDLE_S, "busy": now - 2 * STREAM_IDLE_S, "recent": now - 1, "closed": now}
    )
    assert sum(stream.open for stream in peers._streams.values()) == 3
    taken = peers.idle_streams(now)
    assert {id(t) for t in taken} == {id(streams["idle"]), id(streams["closed"])}
    assert set(peers._streams) == {"busy", "recent"} and set(peers._stream_used) == {"busy", "recent"}
    assert peers.idle_streams(now) == []
    peers._streams.clear()


# ---------------------------------------------------------------- malformed heads
def test_an_oversized_header_is_json_431_and_counted(served: Served) -> None:
    before = refusals("too_large")
    with served.connect() as sock:
        sock.sendall(request("GET", "/v1/info", extra=f"X-Big: {'a' * 10000}\r\n"))
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (431, "too_large")
    assert refusals("too_large") == before + 1


def test_too_many_headers_and_a_bad_request_line_are_json_400(served: Served) -> None:
    for raw in (
        request("GET", "/v1/info", extra="".join(f"X-{i}: v\r\n" for i in range(100))),
        b"BLAH\x00 / HTTP/1.1\r\n\r\n",
        b"GET /v1/info HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    ):
        with served.connect() as sock:
            sock.sendall(raw)
            status, doc, _ = read_answer(sock)
            assert (status, doc["reason"]) == (400, "malformed"), raw[:60]


def test_a_non_utf8_authorization_is_401(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (401, "unauthorized")


# ---------------------------------------------------------------- malformed bodies
def body(**fields: Any) -> bytes:
    return json.dumps({"cluster": UID, "rank": "prefill-0-tp0-cp0", "room": 1, "kv_pages": [1], **fields}).encode()


@pytest.mark.parametrize(
    ("what", "raw", "extra"),
    [
        ("charset", body(), "Content-Type: application/json; charset=bogus\r\n"),
        ("not-utf8", b'{"cluster": "\xff"}', ""),
        ("deep", b"[" * 200_000 + b"]" * 200_000, ""),
        ("deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, ""),
        ("5000-digit", b'{"cluster": "' + UID.encode() + b'", "room": ' + b"9" * 5000 + b"}", ""),
        ("25-digit", body()[:-1] + b', "aux_index": 1' + b"0" * 25 + b"}", ""),
        ("nan", b'{"cluster": "' + UID.encode() + b'", "room": NaN}', ""),
        ("not-object", b"[1, 2]", ""),
        ("truncated", b'{"cluster": "', ""),
        ("pages-as-string", body(kv_pages="0,1"), ""),
        ("packed-too-long", body(kv_pages={"int32le": "A" * (100_000)}), ""),
        ("rank-control-chars", body(rank="prefill\x00"), ""),
        ("rank-too-long", body(rank="p" * 5000), ""),
    ],
)
def test_bad_bodies_are_400_or_413_json_and_create_nothing(
    served: Served, agent: Agent, what: str, raw: bytes, extra: str
) -> None:
    start = time.monotonic()
    status, doc = post_json(served, "/v1/send", raw, extra=extra)
    assert status in (400, 404, 413), (what, status, doc)
    assert doc["reason"] in ("malformed", "out_of_range", "too_large", "unknown_rank"), (what, doc)
    assert time.monotonic() - start < 1.0, what
    assert no_rooms(agent)


def test_an_unexpected_error_is_a_logged_counted_json_500(served: Served, agent: Agent) -> None:
    def boom(msg: Any) -> RoomView:
        raise RuntimeError("a bug")

    agent.submit_send = boom  # type: ignore[method-assign]
    before = refusals("internal")
    status, doc = post_json(served, "/v1/send", body(decode_replica=0))
    assert (status, doc["reason"]) == (500, "internal")
    assert refusals("internal") == before + 1


def test_poll_with_a_5000_digit_room_is_400(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(request("GET", "/v1/rooms/prefill-0-tp0-cp0/" + "9" * 5000))
        status, doc, _ = read_answer(sock)
        assert (status, doc["reason"]) == (400, "malformed")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
FIELDS = st.sampled_from(
    ["cluster", "rank", "room", "kv_pages", "state_indices", "aux_index", "decode_replica", "prefill_replica"]
)


@settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/send", "/v1/receive"]),
    doc=st.dictionaries(FIELDS, JSON, max_size=8),
    keep_cluster=st.booleans(),
)
def test_random_shapes_over_http_get_only_4xx_and_create_nothing(
    served: Served, agent: Agent, path: str, doc: dict[str, Any], keep_cluster: bool
) -> None:
    if keep_cluster:
        doc["cluster"] = UID
    status, answer = post_json(served, path, json.dumps(doc).encode())
    assert 400 <= status < 500, (doc, status, answer)
    assert set(answer) == {"error", "reason"}
    assert no_rooms(agent)


@settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_random_bytes_over_http_get_only_4xx(served: Served, agent: Agent, raw: bytes) -> None:
    status, answer = post_json(served, "/v1/receive", raw)
    assert 400 <= status < 500, (raw, status, answer)
    assert no_rooms(agent)


# ---------------------------------------------------------------- the caps themselves
def test_the_body_cap_is_the_largest_legal_request_with_a_floor() -> None:
    small = PoolLayout(2, 2, 64, 256, 1, 64, 64, (8, 8), 64)
    big = PoolLayout(2, 2, 64, 1 << 20, 1, 64, 64, (8, 8), 64)
    assert body_cap([]) == BODY_FLOOR == body_cap([small])
    cap = body_cap([small, big])
    legal = json.dumps({"kv_pages": list(range(1 << 20)), "state_indices": list(range(64))}).encode()
    assert len(legal) < cap < 16 * len(legal)


def test_shape_checks_are_fast_and_spare_base64_digits() -> None:
    check_shape(b'{"kv_pages": {"int32le": "' + b"0123456789" * 10 + b'"}}')  # digits in a string
    decode_json(json.dumps({"a": [[[[1]]]], "b": {"c": {"d": 1}}}).encode())
    nested = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    for raw in (nested, b"[" * 1_000_000, b'["\\' * 100_000, b'{"a": 1' + b"2" * 30 + b"}"):
        start = time.perf_counter()
        with pytest.raises(Exception) as info:
            decode_json(raw)
        assert type(info.value).__name__ == "ApiError" and info.value.status == 400  # type: ignore[attr-defined]
        # 0.2 s alone; wide (a quadratic scan of 1 MB takes minutes): another worker may share the cores
        assert time.perf_counter() - start < 1.0, raw[:20]
