"""The transfer backend interface: the one seam between PD policy and a byte-moving engine.

A backend owns one rank's engine. The agent registers the rank's pools, then hands it batches of
absolute (src, dst, length) blocks for a peer session; batches are already coalesced and chunked
under ``max_batch_entries`` by the agent, so a backend never sees an oversized batch.
A GPU kernel path (gather/scatter into a peer's mapped pool) implements the same protocol; its
``path`` label keeps its traffic apart from the engine's in the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pdfabric_agent.plan import Block
from pdfabric_agent.pools import Pool
from pdfabric_core.policy.types import Transport


class TransferError(RuntimeError):
    """The engine reported failure for a batch; the peer session is suspect from now on."""


@runtime_checkable
class TransferBackend(Protocol):
    name: str  # "mooncake" | "mori" | ...: the `backend` metric label
    path: str  # the code path that moves bytes: the `path` metric label
    transport: Transport
    max_batch_entries: int  # the most blocks one write_batch may carry

    def endpoint(self) -> str:
        """Session id peers write to (Mooncake: "host:rpc_port")."""
        ...

    def register(self, pool: Pool) -> None:
        """Make pool.addr .. pool.addr + pool.size a valid source and destination."""
        ...

    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        """Write every block to the peer session and return once all landed; raise TransferError.

        Returns the `path` label of the route the batch took when a backend has more than one
        (e.g. a GPU kernel with the engine as fallback); None means ``self.path``."""
        ...

    def probe(self, peer: str) -> bool:
        """Cheap liveness check of a peer session (no data moved)."""
        ...

    def close(self) -> None: ...
