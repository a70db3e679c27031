"""Attackers for e2e tests: clients that hold an agent's doors without ever speaking properly."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class HandshakeFlood:
    """`n` connections to a peer door from another loopback address (another pod, as the agent sees
    it), each sending the first bytes of a ClientHello and nothing more; a connection the agent
    closes is opened again at once, so the flood stays at `n` for as long as it runs."""

    def __init__(self, address: str, n: int, source: str = "127.0.0.2") -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.n, self.source = n, source
        self.stop = threading.Event()
        self.opened = 0
        self.ended = 0
        self.sel = selectors.DefaultSelector()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((self.source, 0))
        with contextlib.suppress(BlockingIOError):
            s.connect(self.target)
        with contextlib.suppress(OSError):  # not connected yet: a connection that sends nothing, as bad
            s.send(b"\x16\x03\x01")
        self.sel.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        for _ in range(self.n):
            self._open()
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.1):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    gone = s.recv(16) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.sel.unregister(s)
                    s.close()
                    self.ended += 1
                    self._open()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def __enter__(self) -> HandshakeFlood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
