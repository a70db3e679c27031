"""This agent's stream to one peer agent (``GET /v1/peer/stream`` on its peer door, the same mutual
TLS and host-name check as every peer call): peer messages go as frames on one open WebSocket
instead of one HTTPS request each (http/peer_stream.py says why). Calls wait for the frame that
answers their id; a stream that closes fails the calls still waiting (``ConnectionResetError``,
as a reset connection fails a POST) and the next call opens a new one."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

import aiohttp

log = logging.getLogger("pdfabric.agent")


class PeerStream:
    def __init__(self, agent_name: str, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.agent_name, self.ws = agent_name, ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[int, dict[str, Any]]]] = {}
        self._reader = asyncio.ensure_future(self._read())

    @property
    def open(self) -> bool:
        return not self.ws.closed and not self._reader.done()

    @property
    def busy(self) -> bool:
        """A call waits for its answer on it."""
        return bool(self._waiting)

    async def call(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
        """The peer's (status, answer body) for the POST of ``path`` with ``body``."""
        frame_id = next(self._ids)
        answer: asyncio.Future[tuple[int, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._waiting[frame_id] = answer
        try:
            async with asyncio.timeout(timeout_s):
                await self.ws.send_str(json.dumps({"id": frame_id, "path": path, "body": body}))
                return await answer
        finally:
            self._waiting.pop(frame_id, None)

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                doc = json.loads(msg.data)
                if not isinstance(doc, dict) or type(doc.get("id")) is not int:
                    continue  # an answer to no call of ours
                answer = self._waiting.get(doc["id"])
                status, body = doc.get("status"), doc.get("body")
                if answer is not None and not answer.done():
                    if type(status) is int and isinstance(body, dict):
                        answer.set_result((status, body))
                    else:
                        answer.set_exception(ValueError(f"{self.agent_name} answered a frame with no status or body"))
        except (aiohttp.ClientError, ValueError, OSError) as exc:
            log.info("peer stream to %s closed: %s", self.agent_name, exc)
        finally:
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(ConnectionResetError(f"the stream to {self.agent_name} closed"))

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
