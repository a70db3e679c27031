"""A peer rank's transfer metadata, loaded into a local backend before its first write there.

A backend whose engines do not handshake on their own (NIXL) must hold the peer rank's metadata
(its NIXL agent metadata and regions) before it can write to that rank's endpoint. The peer's
agent hands it out on its peer door (``GET /v1/peer/metadata``, mutual TLS), never through the
library's own listener or a metadata server. It is fetched once per (backend, endpoint): rooms to
an endpoint not yet loaded wait on the one fetch under way; a new endpoint of the same rank (its
engine registered memory, or its agent restarted) is a new fetch, after which the backend forgets
the rank's old endpoint (``forget_peer``: a restarted peer's old NIXL agent is not kept loaded)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any
from urllib.parse import quote

from pdfabric_agent.protocol.peer_answers import TransferMetadata
from pdfabric_agent.protocol.peer_wire import METADATA_PATH
from pdfabric_agent.transfer.base import TransferBackend, TransferError

FETCH_TIMEOUT_S = 5.0

Fetch = Callable[[str, str, float], Awaitable[dict[str, Any]]]  # (agent, path, timeout) -> JSON body


class MetadataLoader:
    def __init__(self, fetch: Fetch, workers: Executor) -> None:
        self._fetch = fetch
        self._workers = workers
        self._loading: dict[tuple[int, str], asyncio.Future[None]] = {}
        self._loaded: dict[tuple[int, str], str] = {}  # (backend, peer rank) -> the endpoint loaded last

    async def ensure(self, backend: TransferBackend, agent_name: str, rank_id: str, endpoint: str) -> None:
        """Return once ``backend`` can write to ``endpoint`` (the peer rank ``rank_id`` of agent
        ``agent_name``); raises ``TransferError`` with the reason when its metadata cannot be had
        (the peer unreachable or refusing: ``PEER_ERRORS`` as they were raised)."""
        if not backend.needs_metadata(endpoint):
            return
        key = (id(backend), endpoint)
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.ensure_future(self._load(backend, agent_name, rank_id, endpoint))
            self._loading[key] = loading
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(loading)

    async def _load(self, backend: TransferBackend, agent_name: str, rank_id: str, endpoint: str) -> None:
        body = await self._fetch(agent_name, f"{METADATA_PATH}?rank={quote(rank_id)}", FETCH_TIMEOUT_S)
        try:
            answer = TransferMetadata.parse(body)
        except ValueError as exc:
            raise TransferError(f"{agent_name} answered no usable transfer metadata for {rank_id}: {exc}") from None
        if answer.rank != rank_id or answer.endpoint != endpoint:
            raise TransferError(
                f"{rank_id} of {agent_name} is at endpoint {answer.endpoint} now, not {endpoint} (its memory "
                "registration changed since it sent its room info)"
            )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._workers, backend.load_metadata, endpoint, answer.metadata)
        old = self._loaded.get((id(backend), rank_id))
        self._loaded[id(backend), rank_id] = endpoint
        if old is not None and old != endpoint:
            await loop.run_in_executor(self._workers, backend.forget_peer, old)
