"""MORI-IO backend (AMD), written against amd-mori's Python IOEngine API as ANCHORS.md records it.

NOT EXERCISED: amd-mori ships only a CPython 3.10 ROCm wheel, so this module has never been
imported or run on the project's machines; its unit tests drive it through a stand-in of the
``mori.io`` module to check the calls it makes (offsets, descriptor lookup, status handling),
nothing more. Treat it as a reviewed draft until it runs on an MI300-class node.

MORI addresses memory by descriptor plus offset instead of by absolute address, so the endpoint
this backend advertises carries the packed engine descriptor and the packed descriptors of every
registered pool; a writer maps each absolute (src, dst) back to (descriptor, offset) by range.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import BackendOptions, TransferBackend, TransferError
from pdfabric_core.policy.types import Device, Transport


@dataclass(frozen=True)
class _Region:
    addr: int
    size: int
    desc: Any  # mori MemoryDesc

    def offset(self, addr: int, length: int) -> int | None:
        if self.addr <= addr and addr + length <= self.addr + self.size:
            return addr - self.addr
        return None


def _find(regions: Sequence[_Region], addr: int, length: int) -> tuple[_Region, int]:
    for region in regions:
        off = region.offset(addr, length)
        if off is not None:
            return region, off
    raise TransferError(f"block {addr:#x}+{length} lies in no registered MORI region")


class MoriBackend(TransferBackend):
    name = "mori"
    path = "mori"

    def __init__(self, transport: Transport, *, host: str, gpu: int = 0, max_batch_entries: int = 1024) -> None:
        from mori import io as mori_io  # ROCm only; see the module docstring

        self._io = mori_io
        self.transport = transport
        self.max_batch_entries = max_batch_entries
        self._gpu = gpu
        self._timeout_ms = int(float(os.environ.get("SGLANG_MORI_TRANSFER_TIMEOUT_S", "30")) * 1000)
        key = f"pdfabric-{uuid.uuid4().hex[:12]}"
        self._engine = mori_io.IOEngine(key, mori_io.IOEngineConfig(host=host, port=0))
        # XGMI moves between GPUs of one node, RDMA between nodes; tcp is MORI's slow fallback.
        if transport is Transport.NVLINK_INTRA:
            kind = mori_io.BackendType.XGMI
        elif transport is Transport.TCP:
            kind = mori_io.BackendType.TCP
        else:
            kind = mori_io.BackendType.RDMA
        self._engine.create_backend(kind)
        self._local: list[_Region] = []
        self._peers: dict[str, list[_Region]] = {}
        self._lock = threading.Lock()

    def register(self, pool: Pool) -> None:
        loc = self._io.MemoryLocationType.GPU if pool.device is Device.CUDA else self._io.MemoryLocationType.CPU
        device_id = self._gpu if pool.device is Device.CUDA else -1
        desc = self._engine.register_memory(pool.addr, pool.size, device_id, loc)
        self._local.append(_Region(pool.addr, pool.size, desc))

    def endpoint(self) -> str:
        doc = {
            "engine": base64.b64encode(self._engine.get_engine_desc().pack()).decode(),
            "regions": [
                {"addr": r.addr, "size": r.size, "desc": base64.b64encode(r.desc.pack()).decode()} for r in self._local
            ],
        }
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()

    def _peer(self, peer: str) -> list[_Region]:
        with self._lock:
            regions = self._peers.get(peer)
            if regions is None:
                doc = json.loads(base64.urlsafe_b64decode(peer.encode()))
                engine_desc = self._io.EngineDesc.unpack(base64.b64decode(doc["engine"]))
                self._engine.register_remote_engine(engine_desc)
                regions = [
                    _Region(r["addr"], r["size"], self._io.MemoryDesc.unpack(base64.b64decode(r["desc"])))
                    for r in doc["regions"]
                ]
                self._peers[peer] = regions
            return regions

    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        if len(blocks) > self.max_batch_entries:
            raise ValueError(f"{len(blocks)} blocks exceed max_batch_entries {self.max_batch_entries}")
        if not blocks:
            return None
        remote = self._peer(peer)
        # MORI batches per (local region, remote region) pair: group the blocks accordingly.
        groups: dict[tuple[int, int], tuple[_Region, _Region, list[int], list[int], list[int]]] = {}
        for b in blocks:
            lr, lo = _find(self._local, b.src, b.length)
            rr, ro = _find(remote, b.dst, b.length)
            g = groups.setdefault((lr.addr, rr.addr), (lr, rr, [], [], []))
            g[2].append(lo)
            g[3].append(ro)
            g[4].append(b.length)
        local_descs: list[Any] = []
        remote_descs: list[Any] = []
        local_offs: list[list[int]] = []
        remote_offs: list[list[int]] = []
        sizes: list[list[int]] = []
        uids: list[int] = []
        for local_region, remote_region, local_off, remote_off, size in groups.values():
            local_descs.append(local_region.desc)
            local_offs.append(local_off)
            remote_descs.append(remote_region.desc)
            remote_offs.append(remote_off)
            sizes.append(size)
            uids.append(self._engine.allocate_transfer_uid())
        statuses = self._engine.batch_write(local_descs, local_offs, remote_descs, remote_offs, sizes, uids)
        self._engine.wait_all(statuses, self._timeout_ms)
        failed = [s for s in statuses if not s.Succeeded()]
        if failed:
            raise TransferError(f"MORI batch write to a peer failed: {failed[0].Message()}")
        return None

    def probe(self, peer: str) -> bool:
        return True

    def close(self) -> None:
        for region in self._local:
            # Closing must not mask the error that made us close.
            with contextlib.suppress(Exception):
                self._engine.deregister_memory(region.desc)
        self._local.clear()


def create(transport: Transport, opts: BackendOptions) -> TransferBackend:
    return MoriBackend(transport, host=opts.host, gpu=opts.gpu, max_batch_entries=opts.max_batch_entries)
