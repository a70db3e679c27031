"""NIXL transfer backend: one NIXL agent per rank over its UCX backend, with no listener thread and
no metadata server. A peer writes here only after loading this rank's agent metadata (its UCX
address and the remote keys of every registered region), which the agent hands out through its
own authenticated peer door (``local_metadata``, ``load_metadata``; the blob is this module's
``RankMetadata``): NIXL's socket exchange and etcd are never used, so nothing of NIXL's listens
but UCX's own transport, on the interface peers reach the rank at.

An endpoint names the NIXL agent and the digest of its metadata (``name#digest``): registering or
releasing memory makes a new endpoint, so a writer holding older metadata loads it again instead
of writing with stale keys. Writes are WRITE transfers, made from descriptor lists prepared once per
region (``nixl_grids``) or, for a batch those do not serve, from its own descriptors; a transfer is
DONE once its bytes landed in the peer's memory, which is what ``write_batch``
promises. Waits poll ``check_xfer_state`` with a short sleep: NIXL's progress thread moves the
bytes, so a spinning wait would only take a core from it; that thread waits for UCX's events
(``waiting_agent``) instead of polling, as NIXL's Python API would have it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdfabric_agent.memory.block_arrays import BlockArrays, Int64s
from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import BackendOptions, TransferBackend, TransferError
from pdfabric_agent.transfer.nixl_grids import Grids
from pdfabric_agent.transfer.nixl_metadata import RankMetadata, Region, Regions, metadata_digest, split_endpoint
from pdfabric_agent.transfer.nixl_setup import library_env, plugin_of, waiting_agent
from pdfabric_core.policy.transports import transport_traits
from pdfabric_core.policy.types import Backend, Device, Transport

WAIT_POLL_S = 50e-6  # sleep between checks of a transfer's state
# NIXL's memory segment type per pool device.
SEGMENTS = {Device.CPU: "DRAM", Device.CUDA: "VRAM"}


def path_of(transport: Transport) -> str:
    """The `path` metric label of a NIXL backend over ``transport``: its plugin and the transports
    that plugin may use differ per transport (``library_env``), so the bytes of each are counted
    apart (``nixl-ucx-tcp``, ``nixl-libfabric-efa``)."""
    return f"nixl-{plugin_of(transport).lower()}-{transport.value}"


# Every label a NIXL backend can report: one per transport the transports table gives NIXL.
PATHS = tuple(path_of(t) for t in Transport if Backend.NIXL in transport_traits(t).backends)
# What a plugin needs of the node beyond NIXL's wheel, for the refusal when NIXL cannot make it.
PLUGIN_NEEDS = {
    "LIBFABRIC": "NIXL's LIBFABRIC plugin needs libfabric.so.1 with its efa provider, CUDA's runtime and hwloc: "
    "the CUDA agent image on an EFA node",
}


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(
        self, transport: Transport, *, host: str, gpu: int = 0, max_batch_entries: int = 1024, timeout_s: float = 30.0
    ) -> None:
        try:
            from nixl._api import nixl_agent  # import here: loads UCX
        except ImportError as exc:
            raise TransferError(
                f"backend nixl needs NIXL in the agent's environment (nixl and nixl-cu13 1.5.1, images/nixl-nodeps.txt): {exc}"
            ) from exc

        self.transport = transport
        self.path = path_of(transport)
        self.max_batch_entries = max_batch_entries
        self._gpu = gpu
        # Unique across restarts: a peer must never take a new process for the old one.
        self._name = f"{host}/{os.getpid()}/{gpu}/{uuid.uuid4().hex[:8]}"
        self._plugin = plugin_of(transport)
        try:
            self._agent = waiting_agent(nixl_agent, self._name, self._plugin)
            made = self._plugin in self._agent.backends
        except Exception as exc:  # NIXL raises when the plugin cannot make its backend on this node
            made, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = f"plugins found: {', '.join(self._agent.plugin_list)}"
        if not made:
            needs = PLUGIN_NEEDS.get(self._plugin, "")
            raise TransferError(
                f"NIXL could not make its {self._plugin} backend for transport {transport.value} here ({why})"
                + (f"; {needs}" if needs else "")
            )
        self._grids = Grids(self._agent)  # prepared descriptor lists, reused by every room
        self._lock = threading.Lock()  # registrations and peers change while worker threads write
        self._regions = Regions()
        self._registered: dict[int, Any] = {}  # pool address -> its registration descriptors
        self._metadata: tuple[str, bytes] | None = None  # endpoint and blob, remade after a registration change
        self._peers: dict[str, Regions] = {}  # endpoint -> the regions of a peer whose metadata NIXL holds
        self._in_flight: dict[str, int] = {}  # remote NIXL agent -> transfers posted to it, not yet released
        self._retired: set[str] = set()  # remote NIXL agents forgotten while transfers to them were in flight
        self._timeout_s = timeout_s

    @property
    def host_memory_only_because(self) -> str:
        # Measured on an H100 (benchmarks/results/gpu-2026-12-07-nixl.md): UCX's CUDA IPC carries
        # GPU memory its own process allocated; an engine's buffer, which the agent opens by CUDA
        # IPC, has no handle UCX can pass on, and UCX fell back to emulating the writes over tcp.
        return (
            "the nixl backend moves GPU memory only in the agent's own pools (UCX's CUDA IPC cannot pass on "
            "memory the agent opened by CUDA IPC); register host buffers, or use backend mooncake for an "
            "engine's own GPU KV"
        )

    # ------------------------------------------------------------ this rank
    def endpoint(self) -> str:
        return self.local_metadata()[0]

    def local_metadata(self) -> tuple[str, bytes]:
        with self._lock:
            if self._metadata is None:
                blob = RankMetadata(bytes(self._agent.get_agent_metadata()), tuple(self._regions)).encode()
                self._metadata = (f"{self._name}#{metadata_digest(blob)}", blob)
            return self._metadata

    def register(self, pool: Pool) -> None:
        segment = SEGMENTS[pool.device]
        descs = self._agent.get_reg_descs([(pool.addr, pool.size, self._device_id(pool), pool.name)], segment)
        try:
            self._agent.register_memory(descs, backends=[self._plugin])
        except Exception as exc:
            raise TransferError(
                f"NIXL register_memory({pool.name}, {pool.size} bytes, {segment}) failed: {exc}"
            ) from exc
        with self._lock:
            self._registered[pool.addr] = descs
            self._regions = self._regions.add(Region(pool.addr, pool.size, segment, self._device_id(pool)))
            self._metadata = None

    def unregister(self, pool: Pool) -> None:
        self._grids.drop_local(pool.addr)
        with self._lock:
            descs = self._registered.pop(pool.addr, None)
            self._regions = self._regions.without(pool.addr)
            self._metadata = None
        if descs is not None:
            self._agent.deregister_memory(descs, backends=[self._plugin])

    def _device_id(self, pool: Pool) -> int:
        return (pool.gpu if pool.gpu is not None else self._gpu) if pool.device is Device.CUDA else 0

    # ------------------------------------------------------------ peers
    def needs_metadata(self, peer: str) -> bool:
        with self._lock:
            return peer not in self._peers

    def load_metadata(self, peer: str, metadata: bytes) -> None:
        """Load a peer rank's metadata, checked against its endpoint: the digest must match, and
        the NIXL agent must be the one the endpoint names. A newer endpoint of the same agent
        replaces the older one."""
        name, digest = split_endpoint(peer)
        if metadata_digest(metadata) != digest:
            raise TransferError(f"metadata for {peer} does not match its digest")
        decoded = RankMetadata.decode(metadata)
        with self._lock:
            try:
                loaded = self._agent.add_remote_agent(decoded.nixl)
            except Exception as exc:  # NIXL refuses its own metadata, or a blob it cannot read
                raise TransferError(f"NIXL refused the metadata for {peer}: {exc!r}") from exc
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != name:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(loaded_name)
                raise TransferError(f"metadata for {peer} is NIXL agent {loaded_name!r}")
            for old in [e for e in self._peers if split_endpoint(e)[0] == name]:
                del self._peers[old]
            self._peers[peer] = Regions(decoded.regions)
        self._grids.drop_remote(name)  # its regions may have changed under the same addresses

    def forget_peer(self, peer: str) -> None:
        """A restarted peer's old NIXL agent is removed from this one (its UCX endpoints and keys
        with it), at once or when the last transfer to it is released; an older endpoint of an
        agent still loaded (its memory registered again) only drops out of the peers."""
        try:
            name = split_endpoint(peer)[0]
        except ValueError:
            return
        with self._lock:
            self._peers.pop(peer, None)
            if any(split_endpoint(e)[0] == name for e in self._peers):
                return
            if self._in_flight.get(name):
                self._retired.add(name)
                return
        self._remove_remote(name)

    def _remove_remote(self, name: str) -> None:
        self._grids.drop_remote(name)
        with contextlib.suppress(Exception):  # already gone, or never loaded
            self._agent.remove_remote_agent(name)

    def _peer(self, peer: str) -> tuple[str, Regions]:
        with self._lock:
            regions = self._peers.get(peer)
        if regions is None:
            raise TransferError(f"no NIXL metadata of {peer} loaded: its agent's metadata must come first")
        return split_endpoint(peer)[0], regions

    # ------------------------------------------------------------ writes
    @property
    def block_arrays(self) -> bool:
        return True  # the grids take a batch's pieces as index arrays

    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        return self.write_arrays(peer, BlockArrays.of(blocks))

    def start_batch(self, peer: str, blocks: Sequence[Block]) -> Callable[[], str | None] | None:
        return self.start_arrays(peer, BlockArrays.of(blocks)) if blocks else None

    def write_arrays(self, peer: str, batch: BlockArrays) -> str | None:
        wait = self._start(peer, batch)
        if wait is not None:
            wait()
        return None

    def start_arrays(self, peer: str, batch: BlockArrays) -> Callable[[], str | None] | None:
        """The batch's transfers posted now (NIXL's progress thread moves them); the returned call
        waits until they landed. None, nothing started, for a peer whose metadata is not loaded
        yet or when posting failed (a peer gone): ``write_arrays`` then says why, where the caller
        waits for a write."""
        if self.needs_metadata(peer) or not len(batch) or len(batch) > self.max_batch_entries:
            return None
        try:
            wait = self._start(peer, batch)
        except TransferError:
            return None

        def waited() -> str | None:
            if wait is not None:
                wait()
            return None

        return waited

    def _start(self, peer: str, batch: BlockArrays) -> Callable[[], None] | None:
        if len(batch) > self.max_batch_entries:
            raise ValueError(f"{len(batch)} blocks exceed max_batch_entries {self.max_batch_entries}")
        if not len(batch):
            return None
        remote, remote_regions = self._peer(peer)
        handles = []
        try:
            for (src, dst), group in _grouped(peer, batch, self._regions, remote_regions):
                handles.append(self._post(remote, group, src, dst))
        except TransferError:
            if handles:  # what was posted lands or fails before this batch is reported failed
                with contextlib.suppress(TransferError):
                    self._land(peer, handles, time.monotonic() + self._timeout_s)
            raise
        deadline = time.monotonic() + self._timeout_s + batch.nbytes / 1e9
        return lambda: self._land(peer, handles, deadline)

    def _post(self, remote: str, batch: BlockArrays, src_region: Region, dst_region: Region) -> Any:
        agent = self._agent
        try:
            handle = self._grids.write(remote, batch, src_region, dst_region, [self._plugin])
            if handle is None:  # a batch the prepared lists do not serve: descriptors of its own
                src = agent.get_xfer_descs(_descs(batch.src, batch.length, src_region), src_region.segment)
                dst = agent.get_xfer_descs(_descs(batch.dst, batch.length, dst_region), dst_region.segment)
                handle = agent.initialize_xfer("WRITE", src, dst, remote, backends=[self._plugin])
            state = agent.transfer(handle)
        except Exception as exc:
            raise TransferError(f"NIXL write of {len(batch)} blocks to {remote} failed: {exc}") from exc
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL write of {len(batch)} blocks to {remote} failed when posted")
        with self._lock:
            self._in_flight[remote] = self._in_flight.get(remote, 0) + 1
        return handle

    def _released(self, remote: str, count: int) -> None:
        """``count`` transfers to ``remote`` released; the last one removes a retired remote agent."""
        with self._lock:
            left = self._in_flight.get(remote, 0) - count
            if left > 0:
                self._in_flight[remote] = left
                return
            self._in_flight.pop(remote, None)
            if remote not in self._retired:
                return
            self._retired.discard(remote)
        self._remove_remote(remote)

    def _land(self, peer: str, handles: list[Any], deadline: float) -> None:
        """Until every transfer is DONE; raises when one failed or the deadline passed (the rest are
        still released, which aborts what did not land)."""
        try:
            failure = self._wait_all(handles, deadline)
        finally:
            self._released(split_endpoint(peer)[0], len(handles))
        if failure:
            raise TransferError(f"NIXL write to {peer} failed: {failure}")

    def _wait_all(self, handles: list[Any], deadline: float) -> str:
        """Every handle polled until it ends, then released: the first failure, or ""."""
        agent, failure = self._agent, ""
        pending = list(handles)
        while pending:
            still = []
            for handle in pending:
                try:
                    state = agent.check_xfer_state(handle)
                except Exception as exc:
                    state, failure = "ERR", failure or str(exc)
                if state == "PROC" and time.monotonic() < deadline:
                    still.append(handle)
                    continue
                if state != "DONE":
                    failure = failure or ("timed out" if state == "PROC" else f"state {state}")
                with contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)
            pending = still
            if pending:
                time.sleep(WAIT_POLL_S)
        return failure

    def probe(self, peer: str) -> bool:
        """True when the peer's NIXL agent is loaded and a connection to it can be made."""
        try:
            remote, _ = self._peer(peer)
            self._agent.make_connection(remote, backends=[self._plugin])
        except Exception:
            return False
        return True

    def close(self) -> None:
        self._grids.close()
        with self._lock:
            peers, self._peers = list(self._peers), {}
            registered, self._registered = list(self._registered.values()), {}
        for endpoint in peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(split_endpoint(endpoint)[0])
        for descs in registered:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(descs, backends=[self._plugin])


def _descs(addrs: Int64s, lengths: Int64s, region: Region) -> np.ndarray[Any, Any]:
    """NIXL's (address, length, device) rows of a batch's blocks in one region."""
    return np.stack((addrs, lengths, np.full(len(addrs), region.device_id, dtype=np.int64)), axis=1).astype(np.uint64)


def _one_region(regions: Regions, addrs: Int64s, lengths: Int64s) -> Region | None:
    """The region that holds every block, when one does (a room's KV is in one pool a side)."""
    low = int(addrs.min())
    return regions.find(low, int((addrs + lengths).max()) - low)


def _grouped(
    peer: str, batch: BlockArrays, local: Regions, remote: Regions
) -> list[tuple[tuple[Region, Region], BlockArrays]]:
    """The blocks by (source region, destination region): one NIXL transfer takes one segment type
    and device on each side. Looked up block by block only when one region a side does not hold
    them all (an engine's buffers: a region per tensor)."""
    src, dst = _one_region(local, batch.src, batch.length), _one_region(remote, batch.dst, batch.length)
    if src is not None and dst is not None:
        return [((src, dst), batch)]
    groups: dict[tuple[Region, Region], list[int]] = {}
    for i, (s, d, n) in enumerate(zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist(), strict=True)):
        sr, dr = local.find(s, n), remote.find(d, n)
        if sr is None:
            raise TransferError(f"source {s:#x}+{n} is in no region registered here")
        if dr is None:
            raise TransferError(f"destination {d:#x}+{n} is in no region {peer} registered")
        groups.setdefault((sr, dr), []).append(i)
    if len(groups) == 1:
        return [(next(iter(groups)), batch)]
    return [(key, batch.pick(np.asarray(rows))) for key, rows in groups.items()]


def create(transport: Transport, opts: BackendOptions) -> TransferBackend:
    """The registry's factory: the settings of the transport's library (unless set already), then
    the backend."""
    for key, value in library_env(transport, opts.host).items():
        os.environ.setdefault(key, value)
    return NixlBackend(
        transport, host=opts.host, gpu=opts.gpu, max_batch_entries=opts.max_batch_entries, timeout_s=opts.timeout_s
    )
