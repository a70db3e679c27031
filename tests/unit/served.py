"""An aiohttp app served by the agent's ``GuardedTCPSite`` on a loopback port, its event loop in a
thread, for unit tests that speak to a guarded listener with raw sockets (plain or mutual TLS)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from typing import Any

from aiohttp import web

from pdfabric_agent.http.guard import LIMITS, GuardedTCPSite, Limits


class Served:
    def __init__(
        self, app: web.Application, limits: Limits, cluster: str, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app[LIMITS] = limits
        self.runner = web.AppRunner(app, access_log=None, **limits.handler_args())
        self.site: GuardedTCPSite | None = None
        self.call(self._start(limits, cluster, ssl_context))

    async def _start(self, limits: Limits, cluster: str, ssl_context: ssl.SSLContext | None) -> None:
        await self.runner.setup()
        self.site = GuardedTCPSite(self.runner, "127.0.0.1", 0, limits=limits, cluster=cluster, ssl_context=ssl_context)
        await self.site.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    @property
    def port(self) -> int:
        assert self.site is not None
        return self.site.port

    @property
    def open_connections(self) -> int:
        """Connections the guard holds (past the TLS handshake, on a TLS listener)."""
        assert self.site is not None and self.site.guard is not None
        return len(self.site.guard.conns)

    @property
    def handshaking(self) -> int:
        """TLS handshakes in progress (a TLS listener)."""
        assert self.site is not None and self.site._handshakes is not None
        return len(self.site._handshakes.pending)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
