"""AgentClient's connection handling against a small local HTTP/1.1 server: calls share one
keep-alive connection per thread, a connection the server dropped while idle is replaced without
the caller noticing, refusals arrive as AgentRefused with the agent's reason."""

from __future__ import annotations

import itertools
import json
import threading
import types
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdfabric_agent.client.api import REGISTER_TIMEOUT_S, AgentClient, AgentRefused
from pdfabric_agent.protocol.info import AgentInfo
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest

INFO = AgentInfo("ns", "pd", "uid-1", "a1", "tcp", "mooncake", {})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1  # type: ignore[attr-defined]

    def _answer(self, status: int, doc: dict) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer tok":
            self._answer(401, {"error": "missing or wrong cluster token", "reason": "unauthorized"})
        elif self.path.startswith("/v1/rooms/bad/"):
            self._answer(200, {"rank": "bad", "room": 7, "state": "Done"})  # no room state of SGLang's
        elif self.path.startswith("/v1/rooms/"):
            rank, room = self.path.split("?")[0].split("/")[3:5]
            self._answer(200, {"rank": rank, "room": int(room), "state": "Success", "reason": self.path})
        elif getattr(self.server, "bad_info", False):
            self._answer(200, {**INFO.to_json(), "cluster": "pd"})
        else:
            self._answer(200, INFO.to_json())
        if self.server.drop_after_answer:  # type: ignore[attr-defined]
            self.close_connection = True  # the idle keep-alive connection goes away under the client

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/receive" and body["room"] != 13:
            self._answer(200, {"rank": body["rank"], "room": body["room"], "state": "Bootstrapping"})
        else:
            self._answer(409, {"error": f"room {body['room']} is already Transferring", "reason": "conflict"})
        if self.server.drop_after_answer:  # type: ignore[attr-defined]
            self.close_connection = True


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.connections = 0  # type: ignore[attr-defined]
    srv.drop_after_answer = False  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def client_for(srv: ThreadingHTTPServer, token: str = "tok") -> AgentClient:
    return AgentClient(f"127.0.0.1:{srv.server_address[1]}", token, "uid-1")


def test_calls_share_one_connection(server: ThreadingHTTPServer) -> None:
    c = client_for(server)
    for _ in range(5):
        assert c.info() == INFO
    assert c.poll("decode-0-tp0", 7, wait_s=0.5).reason == "/v1/rooms/decode-0-tp0/7?wait_s=0.5"
    assert server.connections == 1  # type: ignore[attr-defined]
    c.close()


def test_connection_dropped_while_idle_is_replaced(server: ThreadingHTTPServer) -> None:
    server.drop_after_answer = True  # type: ignore[attr-defined]
    c = client_for(server)
    for _ in range(3):
        assert c.info() == INFO
    assert server.connections == 3  # type: ignore[attr-defined]


def test_each_thread_has_its_own_connection(server: ThreadingHTTPServer) -> None:
    c = client_for(server)
    results: list[AgentInfo] = []
    threads = [threading.Thread(target=lambda: results.extend(c.info() for _ in range(3))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 9 and server.connections == 3  # type: ignore[attr-defined]


def test_refusals_carry_status_reason_and_message(server: ThreadingHTTPServer) -> None:
    c = client_for(server)
    with pytest.raises(AgentRefused) as info:
        c.send("prefill-0-tp0-cp0", 3, [1, 2])
    assert (info.value.status, info.value.reason) == (409, "conflict")
    assert "room 3 is already Transferring" in info.value.message
    with pytest.raises(AgentRefused) as info:
        client_for(server, token="wrong").info()
    assert (info.value.status, info.value.reason) == (401, "unauthorized")
    assert c.info() == INFO  # the connection survives a refusal
    server.bad_info = True  # type: ignore[attr-defined]
    with pytest.raises(AgentRefused) as info:
        c.info()
    assert (info.value.status, info.value.reason) == (200, "malformed")
    assert "/v1/info cluster is not a JSON object" in info.value.message


def test_unreachable_agent_raises_oserror() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(OSError):
        AgentClient(f"127.0.0.1:{port}", "tok", "uid-1", timeout_s=2).info()


def test_address_must_be_host_and_port() -> None:
    with pytest.raises(ValueError, match="host:port"):
        AgentClient("agent-without-port", "tok", "uid-1")


def test_wait_backs_off_while_polls_answer_at_once_without_an_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state the agent does not hold a long poll for (e.g. a prefill room whose decode side is
    ready) is answered at once: `wait` sleeps, doubling up to its maximum, instead of spinning."""
    import time as time_mod

    from pdfabric_agent.client import api as client_mod

    client = client_mod.AgentClient("127.0.0.1:1", "t", "uid")
    calls: list[float] = []

    def poll(rank: str, room: int, wait_s: float = 0.0) -> RoomView:
        calls.append(time_mod.monotonic())
        return RoomView(rank=rank, room=room, state=RoomState.WAITING_FOR_INPUT)

    monkeypatch.setattr(client, "poll", poll)
    with pytest.raises(TimeoutError):
        client.wait("prefill-0-tp0-cp0", 1, timeout_s=1.5)
    # 10, 20, 40, ... 500 ms pauses: about ten polls in 1.5 s, not thousands.
    assert 5 <= len(calls) <= 14, len(calls)
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert max(gaps) <= client_mod.WAIT_BACKOFF_MAX_S + 0.2


def test_an_answer_that_is_no_room_view_is_refused_as_malformed(server: ThreadingHTTPServer) -> None:
    """The client reads a typed view or raises: a state outside SGLang's KVPoll names never
    reaches the engine as a dictionary it has to second-guess."""
    c = client_for(server)
    with pytest.raises(AgentRefused) as err:
        c.poll("bad", 7)
    assert err.value.reason == "malformed" and "not a room state: 'Done'" in err.value.message
    view = c.poll("decode-0-tp0", 7)
    assert (view.rank, view.room, view.state, view.finished, view.succeeded) == (
        "decode-0-tp0",
        7,
        RoomState.SUCCESS,
        True,
        True,
    )


def test_a_submit_written_on_one_thread_is_answered_on_another(server: ThreadingHTTPServer) -> None:
    """The calls channel (pdfabric_agent.client.calls): one shared connection; the scheduler's
    thread writes the request, the worker reads the answer (a refusal arrives there)."""
    c = AgentClient(f"127.0.0.1:{server.server_address[1]}", "tok", "uid-1", shared=True)
    answers: list[object] = []
    for room in (7, 13, 8):
        answer = c.begin_submit(ReceiveRequest("decode-0-tp0", room, [1], [], None, 0))
        reader = threading.Thread(target=lambda a=answer: answers.append(_outcome(a)))
        reader.start()
        reader.join()
    assert [a.room if isinstance(a, RoomView) else a.reason for a in answers] == [7, "conflict", 8]  # type: ignore[union-attr]
    assert server.connections == 1  # type: ignore[attr-defined]


def test_a_submit_written_on_a_connection_the_agent_dropped_is_sent_again(server: ThreadingHTTPServer) -> None:
    server.drop_after_answer = True  # type: ignore[attr-defined]
    c = AgentClient(f"127.0.0.1:{server.server_address[1]}", "tok", "uid-1", shared=True)
    for room in (1, 2, 3):
        view = c.begin_submit(ReceiveRequest("decode-0-tp0", room, [1], [], None, 0))()
        assert view.room == room and view.state is RoomState.BOOTSTRAPPING


def _outcome(answer: Callable[[], RoomView]) -> object:
    try:
        return answer()
    except AgentRefused as exc:
        return exc


def test_a_registration_waits_longer_than_the_clients_call_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine plugins' clients time their calls out at 2 s (a scheduler step must not wait); a
    registration maps and registers every engine buffer, seconds on a busy node: it waits at least
    REGISTER_TIMEOUT_S."""
    client = AgentClient("127.0.0.1:1", "tok", "uid-1", 2.0)
    seen: list[float | None] = []

    def call(method: str, path: str, body: object = None, timeout_s: float | None = None) -> dict:
        seen.append(timeout_s)
        raise AgentRefused(409, "conflict", "busy")

    monkeypatch.setattr(client, "_call", call)
    registration = types.SimpleNamespace(PATH="/v1/memory", to_json=lambda: {"rank": "r"})
    with pytest.raises(AgentRefused):
        client.register_memory(registration)  # type: ignore[arg-type]
    assert seen == [REGISTER_TIMEOUT_S] and REGISTER_TIMEOUT_S >= 30
