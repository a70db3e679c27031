"""The agent client's HTTP/1.1 connection against canned answers from a raw socket server: every
framing an HTTP/1.1 server may use, keep-alive, stale and broken connections, bounded sizes, and
a timeout instead of a hang."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from pdfabric_agent.client import http1
from pdfabric_agent.client.http1 import Connection, ProtocolError, StaleConnection

Answer = bytes | tuple[bytes, str] | None


class Server:
    """Accepts connections; for each request (read up to the blank line and Content-Length body)
    sends what `answer(n)` returns for the n-th request overall: bytes; None: close the
    connection instead; (bytes, "close"): send them, then close."""

    def __init__(self, answer: Callable[[int], Answer]) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(buf) < length:
                    buf += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + buf[:length])
                buf = buf[length:]
                out = self.answer(len(self.requests) - 1)
                if out is None:
                    return
                if isinstance(out, tuple):
                    conn.sendall(out[0])
                    return
                conn.sendall(out)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[int], Answer]], Server]]:
    servers: list[Server] = []

    def make(answer: Callable[[int], Answer]) -> Server:
        servers.append(Server(answer))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def ok(body: bytes = b'{"a":1}', extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_content_length_keep_alive_and_the_request_sent(serve) -> None:
    srv = serve(lambda n: ok())
    c = Connection("127.0.0.1", srv.port)
    for _ in range(3):
        r = c.request("POST", "/v1/send", b'{"x":2}', {"Authorization": "Bearer t"}, 5)
        assert (r.status, r.reason, r.body) == (200, "OK", b'{"a":1}')
    assert srv.connections == 1
    first = srv.requests[0]
    assert first.startswith(b"POST /v1/send HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nAuthorization: Bearer t\r\n" in first and b"\r\nContent-Length: 7\r\n" in first
    assert first.endswith(b'\r\n\r\n{"x":2}')
    c.close()


def test_chunked_answer_with_trailer(serve) -> None:
    body = b'HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n3;ext=1\r\n:1}\r\n0\r\nX-T: 1\r\n\r\n'
    srv = serve(lambda n: body)
    c = Connection("127.0.0.1", srv.port)
    r = c.request("GET", "/x", None, {}, 5)
    assert (r.status, r.reason, r.body) == (404, "Not Found", b'{"a":1}')
    assert c.request("GET", "/x", None, {}, 5).body == b'{"a":1}'  # the connection stays usable


def test_connection_close_and_close_framed_body(serve) -> None:
    answers: list[Answer] = [ok(extra="Connection: close\r\n"), (b"HTTP/1.1 200 OK\r\n\r\nuntil-the-end", "close")]
    srv = serve(lambda n: answers[n])
    c = Connection("127.0.0.1", srv.port)
    assert c.request("GET", "/", None, {}, 5).body == b'{"a":1}'
    assert c.sock is None  # closed as the server said; the next request reconnects
    assert c.request("GET", "/", None, {}, 5).body == b"until-the-end"
    assert c.sock is None and srv.connections == 2


def test_stale_keep_alive_connection_is_reported_as_safe_to_resend(serve) -> None:
    srv = serve(lambda n: ok() if n == 0 else None)  # answers once, then drops the connection
    c = Connection("127.0.0.1", srv.port)
    c.request("GET", "/", None, {}, 5)
    with pytest.raises(StaleConnection):
        c.request("GET", "/", None, {}, 5)
    assert c.sock is None


def test_first_request_on_a_fresh_connection_is_never_called_stale(serve) -> None:
    srv = serve(lambda n: None)
    with pytest.raises(ProtocolError, match="closed by the server before an answer"):
        Connection("127.0.0.1", srv.port).request("GET", "/", None, {}, 5)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SMTP ready\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "close"), "closed after 3 of 10"),
        ((b"HTTP/1.1 200 OK\r\nContent-Le", "close"), "closed in the middle"),
    ],
)
def test_malformed_answers_are_refused(serve, answer: Answer, message: str) -> None:
    srv = serve(lambda n: answer)
    c = Connection("127.0.0.1", srv.port)
    with pytest.raises(ProtocolError, match=message):
        c.request("GET", "/", None, {}, 5)
    assert c.sock is None


def test_oversized_head_and_body_are_refused(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "MAX_HEAD", 1024)
    monkeypatch.setattr(http1, "MAX_BODY", 100)
    big_head = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX: " + b"y" * 4096 + b"\r\n\r\n"
    srv = serve(lambda n: big_head if n == 0 else ok(b"z" * 101))
    c = Connection("127.0.0.1", srv.port)
    with pytest.raises(ProtocolError, match="exceed"):
        c.request("GET", "/", None, {}, 5)
    with pytest.raises(ProtocolError, match=r"outside 0\.\.100"):
        c.request("GET", "/", None, {}, 5)


def test_silent_server_times_out(serve) -> None:
    srv = serve(lambda n: b"")  # reads the request, never answers
    with pytest.raises(TimeoutError):
        Connection("127.0.0.1", srv.port).request("GET", "/", None, {}, 0.3)
