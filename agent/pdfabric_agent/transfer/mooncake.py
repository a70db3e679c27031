"""Mooncake transfer engine backend: one TransferEngine per rank, P2PHANDSHAKE (no metadata
server), transport chosen by the MC_* environment the agent sets before the first engine starts
(see transport.mooncake_env)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import socket
import time
from collections.abc import Callable, Sequence

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import BackendOptions, TransferBackend, TransferError
from pdfabric_agent.transfer.staging import HostStaging
from pdfabric_core.policy.transports import TRANSPORTS
from pdfabric_core.policy.types import Device, Transport

# Benchmarks only (like PDFABRIC_COALESCE): 0 sends GPU sources on tcp through Mooncake's own device
# copy instead of the agent's staging (transfer/staging.py), to measure one against the other.
STAGING_ENV = "PDFABRIC_TCP_STAGING"
# How long a tcp batch's waiter sleeps between checks of its transfers (``_land``).
WAIT_POLL_S = 50e-6


def transfer_timeout_s() -> float:
    """Mooncake's per-transfer timeout (``MC_TRANSFER_TIMEOUT``, which the agent sets from the spec
    before its first engine starts; Mooncake reads it once, takes at least 5 s, 30 s when unset); a
    batch may take one more second per GB."""
    try:
        return float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
    except ValueError:
        return 30.0


class MooncakeBackend(TransferBackend):
    name = "mooncake"
    path = "mooncake"

    def __init__(self, transport: Transport, *, host: str, gpu: int = 0, max_batch_entries: int = 1024) -> None:
        from mooncake.engine import TransferEngine  # import here: needs libibverbs even for tcp

        self.transport = transport
        self.max_batch_entries = max_batch_entries
        self._engine = TransferEngine()
        self._host = host
        # Empty device name: Mooncake discovers HCAs itself (rdma) and needs none for tcp/nvlink.
        # The protocol string alone does not pick tcp or nvlink_intra: the MC_* environment does
        # (transport.mooncake_env, from the same traits row).
        protocol = TRANSPORTS[transport].mooncake_protocol
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}) returned {rc}")
        self._registered: list[tuple[int, int]] = []
        self._gpu = gpu
        # tcp: GPU sources go through pinned host memory this backend owns (staging.py), made at the
        # first GPU registration.
        self._stage = transport is Transport.TCP and os.environ.get(STAGING_ENV, "1") != "0"
        self._staging: HostStaging | None = None
        # Peers a batch reached: their session is open, so an async submit to them does not block
        # on Mooncake's handshake (which a first submit runs in the caller's thread).
        self._sessions: set[str] = set()
        self.started = 0  # batches started by start_batch (tests, benchmarks)
        self._poll_waits = TRANSPORTS[transport].cpu_moves_bytes
        self._timeout_s = transfer_timeout_s()  # read once, as the engine it mirrors does

    @property
    def device_memory(self) -> bool:
        return cuda_build()

    @property
    def host_memory_only_because(self) -> str:
        return (
            "Mooncake is built without CUDA here (mooncake-transfer-engine-non-cuda); run the CUDA agent "
            "image (spec.agent.image, docs/images.md)"
        )

    def endpoint(self) -> str:
        return f"{self._host}:{self._engine.get_rpc_port()}"

    def register(self, pool: Pool) -> None:
        self._register(pool.addr, pool.size, pool.name)
        if self._stage and pool.device is Device.CUDA:
            if self._staging is None:
                self._staging = HostStaging(self._gpu, lambda addr, size: self._register(addr, size, "staging"))
            self._staging.add(pool.addr, pool.size, pool.tensor())

    def _register(self, addr: int, size: int, name: str) -> None:
        rc = self._engine.register_memory(addr, size)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({name}, {size} bytes) returned {rc}")
        self._registered.append((addr, size))

    def unregister(self, pool: Pool) -> None:
        if self._staging is not None:
            self._staging.remove(pool.addr)
        if (pool.addr, pool.size) in self._registered:
            self._engine.unregister_memory(pool.addr)
            self._registered.remove((pool.addr, pool.size))

    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        if len(blocks) > self.max_batch_entries:
            # Guard the session: an oversized tcp batch poisons it for every later transfer.
            raise ValueError(f"{len(blocks)} blocks exceed max_batch_entries {self.max_batch_entries}")
        if not blocks:
            return None
        if self._staging is None or not self._staging.write(blocks, lambda part: self._send(peer, part)):
            self._send(peer, blocks)
        return None

    def _send(self, peer: str, blocks: Sequence[Block]) -> None:
        """Write and wait: on tcp to an open session the sleeping per-block way (``start_batch``);
        else Mooncake's synchronous write, which opens or repairs the session."""
        if self._poll_waits and peer in self._sessions:
            wait = self._start_polled(peer, blocks)
            if wait is not None:
                wait()
                return
        rc = self._engine.batch_transfer_sync_write(peer, *_columns(blocks))
        self._check(peer, blocks, rc)
        self._sessions.add(peer)

    def _check(self, peer: str, blocks: Sequence[Block], rc: int) -> None:
        """A batch's return code; a failed one leaves the peer's session suspect (its next batch
        goes the synchronous way, which repairs the session or says why it cannot)."""
        if rc != 0:
            self._sessions.discard(peer)
            raise TransferError(f"Mooncake batch write of {len(blocks)} blocks to {peer} returned {rc}")

    def start_batch(self, peer: str, blocks: Sequence[Block]) -> Callable[[], str | None] | None:
        """A batch started without waiting, for a peer whose session a synchronous write opened and
        kept, with no GPU source to stage; the returned call waits until every byte landed.
        Otherwise, or when the (first) submit fails, None: ``write_batch`` goes the synchronous way,
        which opens or repairs the session and says why it failed.

        Where the CPU moves the bytes (tcp), each block is a transfer of its own
        (``transfer_submit_write``) and the wait checks them (``transfer_check_status``) with a
        short sleep between rounds; elsewhere the batch is one submit
        (``batch_transfer_async_write``) and Mooncake's spinning ``get_batch_transfer_status``
        waits for it (``TransportTraits.cpu_moves_bytes`` says why)."""
        if not blocks or len(blocks) > self.max_batch_entries or peer not in self._sessions:
            return None
        if self._staging is not None:
            return None  # GPU sources on tcp are copied through host memory first (staging.py)
        wait = self._start_polled(peer, blocks) if self._poll_waits else self._start_batch(peer, blocks)
        if wait is None:
            return None
        self.started += 1

        def waited() -> str | None:
            wait()
            return None  # the backend's own path

        return waited

    def _start_batch(self, peer: str, blocks: Sequence[Block]) -> Callable[[], None] | None:
        """One submit; the returned call is Mooncake's spinning wait. None when it was refused."""
        batch = self._engine.batch_transfer_async_write(peer, *_columns(blocks))
        if not batch:  # 0: not submitted (Mooncake's failure value)
            self._sessions.discard(peer)
            return None
        return lambda: self._check(peer, blocks, self._engine.get_batch_transfer_status([batch]))

    def _start_polled(self, peer: str, blocks: Sequence[Block]) -> Callable[[], None] | None:
        """Each block submitted as a transfer of its own; the returned call waits for them all
        (``_land``), then writes what a failed submit left the synchronous way. None (and the
        session suspect) when the first submit failed."""
        transfers: list[int] = []
        for b in blocks:
            transfer = self._engine.transfer_submit_write(peer, b.src, b.dst, b.length)
            if not transfer:  # 0: not submitted (Mooncake's failure value)
                break
            transfers.append(transfer)
        if not transfers:
            self._sessions.discard(peer)
            return None
        rest = blocks[len(transfers) :]
        deadline_s = self._timeout_s + sum(b.length for b in blocks) / 1e9

        def wait() -> None:
            self._check(peer, blocks, self._land(transfers, deadline_s))
            if rest:  # a later submit failed: the synchronous way repairs the session or says why
                self._send(peer, rest)

        return wait

    def _land(self, transfers: list[int], deadline_s: float) -> int:
        """Wait until every transfer ended: 0 when all completed; -1 when one failed (the others are
        still waited for, so that no byte of a failed batch lands after it was reported) or the
        batch outlived ``deadline_s`` (as Mooncake's own wait: its transfers are not cancellable)."""
        check = self._engine.transfer_check_status
        start = time.monotonic()
        pending, rc = transfers, 0
        while True:
            still = []
            for transfer in pending:
                status = check(transfer)  # 1 completed, -1 failed (both freed), 0 or -2 (timed out) pending
                if status == -1:
                    rc = -1
                elif status != 1:
                    still.append(transfer)
            if not still:
                return rc
            if time.monotonic() - start > deadline_s:
                return -1
            pending = still
            time.sleep(WAIT_POLL_S)

    def probe(self, peer: str, timeout_s: float = 1.0) -> bool:
        """True when the peer engine's handshake listener accepts a connection. This Mooncake
        build has no data-less probe call, and a write needs a destination, so this checks the
        listener that every new session starts with."""
        host, _, port = peer.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        for addr, _size in self._registered:
            # Closing must not mask the error that made us close.
            with contextlib.suppress(Exception):
                self._engine.unregister_memory(addr)
        self._registered.clear()


def _columns(blocks: Sequence[Block]) -> tuple[list[int], list[int], list[int]]:
    """Sources, destinations and lengths: the three lists Mooncake's batch calls take."""
    return [b.src for b in blocks], [b.dst for b in blocks], [b.length for b in blocks]


@functools.cache
def cuda_build() -> bool:
    """The installed Mooncake engine is a CUDA build (``USE_CUDA``): its transports tell device
    pointers from host ones (``cudaPointerGetAttributes``) and its TCP transport copies device
    memory through host memory. Mooncake's CUDA wheels are mooncake-transfer-engine (CUDA 12) and
    mooncake-transfer-engine-cuda13; mooncake-transfer-engine-non-cuda (the CPU agent image) reads
    every address as host memory, so a GPU pointer would crash it."""
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    normal = [n.lower().replace("_", "-") for n in names]
    return any(n.startswith("mooncake-transfer-engine") and not n.endswith("non-cuda") for n in normal)


def create(transport: Transport, opts: BackendOptions) -> TransferBackend:
    """The registry's factory: on a transport the GPU kernels can carry (intra-node NVLink), the
    gather/scatter kernels for GPU pools of agents on this node, with the engine as fallback
    (``maybe_fast_path``)."""
    backend = MooncakeBackend(transport, host=opts.host, gpu=opts.gpu, max_batch_entries=opts.max_batch_entries)
    if TRANSPORTS[transport].kernel_path:
        from pdfabric_agent.transfer.fastpath.backend import maybe_fast_path

        return maybe_fast_path(backend, gpu=opts.gpu)
    return backend
