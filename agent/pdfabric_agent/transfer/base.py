"""The transfer backend interface: the one seam between PD policy and a byte-moving engine.

A backend owns one rank's engine. The agent registers the rank's pools, then hands it batches of
absolute (src, dst, length) blocks for a peer session; batches are already coalesced and chunked
under ``max_batch_entries`` by the agent, so a backend never sees an oversized batch.

Optional capabilities are declared, never probed: ``kernel`` is None unless the backend can also
launch gather/scatter kernels into a peer's mapped pools (``KernelPath``, the intra-node NVLink
fast path); ``start_batch`` answers None unless the engine can start a batch without blocking the
caller (then the agent starts it from its event loop and only the wait goes to a worker);
``block_arrays`` says whether the backend takes a batch as arrays, with no Block object per block;
``paths`` lists every `path` metric label the backend can report, so the agent pre-creates their
series; ``local_metadata`` is what a peer must load before writing here (NIXL's agent metadata),
None where the engine handshakes on its own (Mooncake). This is how SGLang's disaggregation base classes give optional methods
defaults: a caller asks the capability, it does not look for attribute names.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdfabric_agent.memory.block_arrays import BlockArrays
from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Block, KvPages
from pdfabric_agent.memory.pools import Pool
from pdfabric_core.policy.types import Transport


@dataclass(frozen=True)
class BackendOptions:
    """What a backend's factory (``registry``) is made with."""

    host: str  # the address the engine advertises to peers
    gpu: int  # the rank's GPU (local index)
    max_batch_entries: int  # the spec's transfer.maxBatchEntries
    timeout_s: float = 30.0  # the spec's transfer.timeoutSeconds: the longest one batch may take


class TransferError(RuntimeError):
    """The engine reported failure for a batch; the peer session is suspect from now on."""


class KernelPath(Protocol):
    """Launch-now, wait-later kernels into a peer's mapped pools. Each call returns None, having
    moved nothing, when the kernel cannot take the data (peer on another node, a block outside the
    GPU pools, too many blocks); the caller then uses the engine. A launch handle is opaque: pass it
    to ``wait`` (always: the receiver's reservations are released there) and ``completion_mark``."""

    def submit_pages(self, peer: str, kvp: KvPages) -> object | None:
        """A route's whole KV from its page lists (every layer, K and V), launched, not waited for."""
        ...

    def submit_blocks(self, peer: str, blocks: Sequence[Block]) -> object | None:
        """Any number of blocks in one launch, not waited for."""
        ...

    def try_write_pages(self, peer: str, kvp: KvPages) -> str | None:
        """``submit_pages`` and ``wait``: the `path` label once landed."""
        ...

    def try_write_blocks(self, peer: str, blocks: Sequence[Block]) -> str | None:
        """``submit_blocks`` and ``wait``: the `path` label once landed."""
        ...

    def wait(self, handle: object) -> str:
        """Until every byte of the launch landed at the receiver; the `path` label."""
        ...

    def completion_mark(self, handle: object) -> CompletionMark | None:
        """Where the receiving agent can watch the launch complete itself; None: it cannot."""
        ...


class TransferBackend(abc.ABC):
    name: str  # "mooncake" | "mori" | ...: the `backend` metric label
    path: str  # the code path that moves bytes: the `path` metric label
    transport: Transport
    max_batch_entries: int  # the most blocks one write_batch may carry

    @property
    def kernel(self) -> KernelPath | None:
        """The kernel path this backend offers besides ``write_batch``; None for engines alone."""
        return None

    @property
    def paths(self) -> tuple[str, ...]:
        """Every `path` label ``write_batch`` and the kernel path can report."""
        return (self.path,)

    @property
    def pair_paths(self) -> tuple[str, str]:
        """The path that moves bytes to a peer on this node and to one on another node: the
        kernel path's first and the engine's last when there is a kernel path, else the engine's."""
        return (self.paths[0], self.paths[-1]) if self.kernel is not None else (self.path, self.path)

    @property
    def device_memory(self) -> bool:
        """``register`` and ``write_batch`` take GPU memory (CUDA device pointers, an engine's
        buffers mapped by CUDA IPC among them); False: host memory only."""
        return False

    @property
    def host_memory_only_because(self) -> str:
        """Why ``device_memory`` is False, with what to do instead: the refusal an engine that
        registers GPU buffers reads."""
        return f"the {self.name} backend moves host memory only"

    @abc.abstractmethod
    def endpoint(self) -> str:
        """Session id peers write to (Mooncake: "host:rpc_port")."""

    def local_metadata(self) -> tuple[str, bytes] | None:
        """What a peer's backend must load (``load_metadata``) before it writes to this rank, with
        the endpoint it belongs to (read together: a registration changes both), handed out on the
        agent's peer door; opaque to all but the backend. None: nothing (Mooncake's engines
        handshake on their own)."""
        return None

    def needs_metadata(self, peer: str) -> bool:
        """A write to ``peer`` needs its rank's metadata loaded first (and it is not loaded)."""
        return False

    def load_metadata(self, peer: str, metadata: bytes) -> None:
        """Load the metadata the agent of ``peer``'s rank handed out for that endpoint; raises
        ``TransferError`` when it is not that endpoint's."""
        raise NotImplementedError(f"the {self.name} backend loads no peer metadata")

    def forget_peer(self, peer: str) -> None:
        """``peer`` is an old endpoint of a rank now at another (its agent restarted, or its engine
        registered again): what the backend holds of it may go once no write to it is in flight.
        Nothing by default (Mooncake's engines hold no per-peer state of ours)."""
        return

    @abc.abstractmethod
    def register(self, pool: Pool) -> None:
        """Make pool.addr .. pool.addr + pool.size a valid source and destination."""

    def unregister(self, pool: Pool) -> None:
        """Forget a registered region (an engine's buffers, replaced when the engine restarts)."""
        raise NotImplementedError(f"the {self.name} backend cannot release registered memory")

    @abc.abstractmethod
    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        """Write every block to the peer session and return once all landed; raise TransferError.

        Returns the `path` label of the route the batch took when a backend has more than one
        (e.g. a GPU kernel with the engine as fallback); None means ``self.path``."""

    def start_batch(self, peer: str, blocks: Sequence[Block]) -> Callable[[], str | None] | None:
        """``write_batch`` in two halves: the batch is started now, on the caller's thread, without
        waiting (no handshake, no copy), and the returned call waits until it landed and answers
        what ``write_batch`` would (raising as it would). None: nothing was started, this batch
        needs ``write_batch`` (a backend that cannot, a peer it has no session with yet)."""
        return None

    @property
    def block_arrays(self) -> bool:
        """``write_arrays`` and ``start_arrays`` take a batch as arrays without a Block object per
        block (the writer then plans a room's KV as arrays: ``memory/block_arrays.py``); False:
        they only unpack the arrays for ``write_batch`` and ``start_batch``."""
        return False

    def write_arrays(self, peer: str, batch: BlockArrays) -> str | None:
        """``write_batch`` of the same blocks."""
        return self.write_batch(peer, batch.blocks())

    def start_arrays(self, peer: str, batch: BlockArrays) -> Callable[[], str | None] | None:
        """``start_batch`` of the same blocks."""
        return self.start_batch(peer, batch.blocks())

    @abc.abstractmethod
    def probe(self, peer: str) -> bool:
        """Cheap liveness check of a peer session (no data moved)."""

    @abc.abstractmethod
    def close(self) -> None: ...
