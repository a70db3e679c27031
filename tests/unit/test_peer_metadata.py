"""A peer rank's transfer metadata: its answer on the peer door parsed once, and the loader that
fetches it once per (backend, endpoint) and refuses one for another endpoint."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdfabric_agent.peers.metadata import MetadataLoader
from pdfabric_agent.protocol.peer_answers import TransferMetadata
from pdfabric_agent.transfer.base import TransferError


def test_the_answer_round_trips_and_refuses_what_is_not_one() -> None:
    answer = TransferMetadata("decode-0-tp0", "host/1/0/ab#0123456789abcdef", b"\x00\x01blob")
    assert TransferMetadata.parse(answer.to_json()) == answer
    with pytest.raises(ValueError, match="must be strings"):
        TransferMetadata.parse({"rank": "r", "endpoint": 1, "metadata": ""})
    with pytest.raises(ValueError, match="not base64"):
        TransferMetadata.parse({"rank": "r", "endpoint": "e", "metadata": "@@@"})
    with pytest.raises(ValueError, match="over 1048576 bytes"):
        TransferMetadata.parse({"rank": "r", "endpoint": "e", "metadata": "A" * (1 << 21)})


class Backend:
    """What the loader asks of a backend (needs_metadata, load_metadata), recording the loads."""

    name = "nixl"

    def __init__(self) -> None:
        self.loaded: dict[str, bytes] = {}
        self.forgotten: list[str] = []

    def needs_metadata(self, peer: str) -> bool:
        return peer not in self.loaded

    def load_metadata(self, peer: str, metadata: bytes) -> None:
        self.loaded[peer] = metadata

    def forget_peer(self, peer: str) -> None:
        self.forgotten.append(peer)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_rooms_to_one_new_endpoint_share_one_fetch_and_a_loaded_one_fetches_nothing() -> None:
    fetched: list[tuple[str, str]] = []

    async def fetch(agent: str, path: str, timeout_s: float) -> dict[str, Any]:
        fetched.append((agent, path))
        await asyncio.sleep(0.01)
        return TransferMetadata("decode-0-tp0", "ep#1", b"meta").to_json()

    backend = Backend()

    async def main() -> None:
        loader = MetadataLoader(fetch, ThreadPoolExecutor(1))
        await asyncio.gather(*(loader.ensure(backend, "agent-d0", "decode-0-tp0", "ep#1") for _ in range(5)))  # type: ignore[arg-type]
        await loader.ensure(backend, "agent-d0", "decode-0-tp0", "ep#1")  # type: ignore[arg-type]

    run(main())
    assert fetched == [("agent-d0", "/v1/peer/metadata?rank=decode-0-tp0")]
    assert backend.loaded == {"ep#1": b"meta"}


def test_a_ranks_new_endpoint_is_loaded_and_its_old_one_forgotten() -> None:
    """The rank's agent restarted (or its engine registered again): the new endpoint is fetched and
    loaded, then the backend forgets the rank's old one; another rank's endpoint is left alone."""
    endpoints = {"decode-0-tp0": "ep#1", "decode-1-tp0": "ep#9"}

    async def fetch(agent: str, path: str, timeout_s: float) -> dict[str, Any]:
        rank = path.rsplit("=", 1)[1]
        return TransferMetadata(rank, endpoints[rank], b"meta").to_json()

    backend = Backend()

    async def main() -> None:
        loader = MetadataLoader(fetch, ThreadPoolExecutor(1))
        await loader.ensure(backend, "agent-d0", "decode-0-tp0", "ep#1")  # type: ignore[arg-type]
        await loader.ensure(backend, "agent-d1", "decode-1-tp0", "ep#9")  # type: ignore[arg-type]
        endpoints["decode-0-tp0"] = "ep#2"
        await loader.ensure(backend, "agent-d0", "decode-0-tp0", "ep#2")  # type: ignore[arg-type]

    run(main())
    assert set(backend.loaded) == {"ep#1", "ep#2", "ep#9"}
    assert backend.forgotten == ["ep#1"]


def test_metadata_of_another_endpoint_is_refused_and_nothing_is_loaded() -> None:
    async def fetch(agent: str, path: str, timeout_s: float) -> dict[str, Any]:
        return {"rank": "decode-0-tp0", "endpoint": "ep#2", "metadata": base64.b64encode(b"m").decode()}

    backend = Backend()
    loader = MetadataLoader(fetch, ThreadPoolExecutor(1))
    with pytest.raises(TransferError, match="is at endpoint ep#2 now, not ep#1"):
        run(loader.ensure(backend, "agent-d0", "decode-0-tp0", "ep#1"))  # type: ignore[arg-type]
    assert backend.loaded == {}


def test_an_answer_that_is_not_one_fails_with_the_agent_named() -> None:
    async def fetch(agent: str, path: str, timeout_s: float) -> dict[str, Any]:
        return {"rank": "decode-0-tp0"}

    loader = MetadataLoader(fetch, ThreadPoolExecutor(1))
    with pytest.raises(TransferError, match="agent-d0 answered no usable transfer metadata"):
        run(loader.ensure(Backend(), "agent-d0", "decode-0-tp0", "ep#1"))  # type: ignore[arg-type]
