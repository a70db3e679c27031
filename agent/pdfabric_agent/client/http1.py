"""A small HTTP/1.1 keep-alive client connection for the agent's JSON API (standard library only).

Why not http.client: on the transfer path each call counts, and http.client spends most of a
loopback round trip in Python (its header parsing goes through the email package): ~0.1 ms of a
0.23 ms round trip here, two to three times that on a busy GPU host, and a room's critical path
has two calls (``send`` in, the long poll's answer out). This speaks what an HTTP/1.1 server
answers (the agent's aiohttp, or any other): a status line, headers, a body framed by
Content-Length, chunked transfer coding or the connection's end; keep-alive unless the server
says ``Connection: close``. Sizes are bounded so a bad peer cannot make it hang or grow without end.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

MAX_HEAD = 64 << 10  # status line + headers
MAX_BODY = 256 << 20


class StaleConnection(ConnectionError):
    """A reused keep-alive connection was closed by the server before any byte of an answer:
    the request was not processed, so it may be sent again on a fresh connection."""


class ProtocolError(ConnectionError):
    """The answer is not HTTP/1.x as this client reads it."""


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]  # names lowercased
    body: bytes


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.sock: socket.socket | None = None
        self._buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._buf = b""

    def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Response:
        """Send one request and read its answer; raises StaleConnection (safe to resend), OSError
        (TimeoutError, refused, reset) or ProtocolError. The connection is closed on any error."""
        reused = self.send(method, path, body, headers, timeout_s)
        return self.receive(method, reused, timeout_s)

    def send(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float) -> bool:
        """The first half of ``request``: write the request (on a connection with no answer still
        unread) and say whether the connection was reused; ``receive`` reads the answer, on this
        thread or another, before anything else is sent here."""
        reused = self.sock is not None
        try:
            if self.sock is None:
                self.sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.settimeout(timeout_s)
            lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host_header}"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            if body is not None or method in ("POST", "PUT"):
                lines.append(f"Content-Length: {len(body or b'')}")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            try:
                self.sock.sendall(head + (body or b""))
            except (BrokenPipeError, ConnectionResetError) as exc:
                if reused:
                    raise StaleConnection(f"connection closed by the server: {exc}") from None
                raise
        except BaseException:
            self.close()
            raise
        return reused

    def receive(self, method: str, reused: bool, timeout_s: float) -> Response:
        """The second half of ``request``: the answer to what ``send`` wrote."""
        try:
            if self.sock is None:
                raise ProtocolError("no request is waiting for an answer on this connection")
            self.sock.settimeout(timeout_s)
            resp = self._read_response(reused, head_only=method == "HEAD")
        except BaseException:
            self.close()
            raise
        if resp.headers.get("connection", "").lower() == "close":
            self.close()
        return resp

    def _recv(self) -> bytes:
        assert self.sock is not None
        return self.sock.recv(1 << 16)

    def _read_response(self, reused: bool, head_only: bool) -> Response:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0 or len(self._buf) > MAX_HEAD:
                if not 0 <= end <= MAX_HEAD:
                    raise ProtocolError(f"answer headers exceed {MAX_HEAD} bytes")
                break
            if len(self._buf) > MAX_HEAD:
                raise ProtocolError(f"answer headers exceed {MAX_HEAD} bytes")
            try:
                chunk = self._recv()
            except ConnectionResetError:
                if reused and not self._buf:
                    raise StaleConnection("connection reset by the server before an answer") from None
                raise
            if not chunk:
                if not self._buf:
                    if reused:
                        raise StaleConnection("connection closed by the server before an answer")
                    raise ProtocolError("connection closed by the server before an answer")
                raise ProtocolError("connection closed in the middle of an answer")
            self._buf += chunk
        head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4 :]
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        headers: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if head_only or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body = self._read_chunked()
        elif "content-length" in headers:
            try:
                n = int(headers["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {headers['content-length']!r}") from None
            if not 0 <= n <= MAX_BODY:
                raise ProtocolError(f"answer body of {n} bytes is outside 0..{MAX_BODY}")
            body = self._read_exactly(n)
        else:  # framed by the connection's end
            while chunk := self._recv():
                self._buf += chunk
                if len(self._buf) > MAX_BODY:
                    raise ProtocolError(f"answer body exceeds {MAX_BODY} bytes")
            body, self._buf = self._buf, b""
            headers["connection"] = "close"
        return Response(status, reason, headers, body)

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._recv()
            if not chunk:
                raise ProtocolError(f"connection closed after {len(self._buf)} of {n} body bytes")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _read_line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > MAX_HEAD:
                raise ProtocolError("chunk size line too long")
            chunk = self._recv()
            if not chunk:
                raise ProtocolError("connection closed inside a chunked body")
            self._buf += chunk
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size_field = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(size_field, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_field[:20]!r}") from None
            if size == 0:
                while self._read_line():  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            total += size
            if total > MAX_BODY:
                raise ProtocolError(f"answer body exceeds {MAX_BODY} bytes")
            parts.append(self._read_exactly(size))
            if self._read_exactly(2) != b"\r\n":
                raise ProtocolError("chunk not followed by CRLF")
