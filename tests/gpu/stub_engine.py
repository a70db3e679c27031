"""The engine under a FastPathBackend in GPU tests: the kernel path is what is tested, so the
engine only records the batches that would have gone its way."""

from __future__ import annotations

from typing import Any

from pdfabric_core.policy.types import Transport


class StubEngine:
    name, path, transport, max_batch_entries = "mooncake", "mooncake", Transport.NVLINK_INTRA, 1024

    def __init__(self, port: int) -> None:
        self.port = port
        self.batches: list[tuple[str, int]] = []  # (peer, blocks) handed to the engine

    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def register(self, pool: Any) -> None:
        pass

    def write_batch(self, peer: str, blocks: Any) -> None:
        self.batches.append((peer, len(blocks)))

    def probe(self, peer: str) -> bool:
        return True

    def close(self) -> None:
        pass
