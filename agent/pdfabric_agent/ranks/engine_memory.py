"""An engine's own memory for one rank: the buffers SGLang's KVArgs describe, registered here.

The engine (``pdfabric_sglang``'s manager) sends a ``MemoryRegistration``: for every buffer, how
this process reaches it. ``engine_layout`` checks it against the PDCluster's model and the
devices the upstream policies name before anything is mapped, and refuses (422) with the
mismatch named; the devices come from ``MemoryRules``: the transport the agent actually runs
(after a declared fallback) and what its transfer engine can move. ``EngineMemory.map`` then maps
each buffer, a shared-memory file at its offset or a CUDA allocation through IPC, as a ``Pool`` that the rank's transfer engine registers like the
agent's own pools; every rule (rank mapping, CP shards, state dedup, aux path, coalescing,
chunking) then plans over its ``MemoryMap`` exactly as over the pools.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdfabric_agent.memory.plan import MemoryMap
from pdfabric_agent.memory.pools import DeviceBuffer, Pool, PoolLayout
from pdfabric_agent.protocol.board import RoomBoard
from pdfabric_agent.protocol.errors import layout_mismatch
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import MemoryAnswer
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_board import open_board, open_engine_file
from pdfabric_agent.ranks.engine_draft import draft_buffers
from pdfabric_agent.ranks.engine_state import state_items
from pdfabric_core.duties import kv_shard_size
from pdfabric_core.policy.buffer_device import engine_gpu_transports, engine_kv_devices, metadata_buffer_device
from pdfabric_core.policy.rank_mapping import local_heads, pp_layer_range
from pdfabric_core.policy.types import Device, KvKind, KvPacking, MemPool, Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import ModelGeometry, PDClusterSpec

_SHARE_DEVICE = {ShareKind.SHM: Device.CPU, ShareKind.CUDA_IPC: Device.CUDA}


@dataclass(frozen=True)
class MemoryRules:
    """Where an engine's buffers may live on this agent: KV and state on the devices the transport
    it runs takes (``engine_kv_devices``: GPU memory on tcp and the NVLink transports), aux on the
    memory pool's metadata device, GPU memory only when the rank's transfer engine moves it.
    ``transport`` is the transport actually chosen, ``requested`` the rank map's (they differ after
    a declared ``placement.fallback: TCP``): refusals name the first and say what it fell back from."""

    transport: Transport
    requested: Transport
    mem_pool: MemPool
    engine_moves_gpu: bool  # the backend's ``device_memory``
    host_only_because: str = ""  # the backend's ``host_memory_only_because``

    @classmethod
    def of(
        cls, spec: PDClusterSpec, transport: Transport, requested: Transport, engine_moves_gpu: bool, why_not: str = ""
    ) -> MemoryRules:
        return cls(transport, requested, spec.transfer.mem_pool, engine_moves_gpu, why_not)

    @property
    def kv_devices(self) -> frozenset[Device]:
        return engine_kv_devices(self.transport)

    @property
    def aux_device(self) -> Device:
        return metadata_buffer_device(self.mem_pool)

    def where(self) -> str:
        fell_back = (
            f", the declared fallback from {self.requested.value}" if self.requested is not self.transport else ""
        )
        return f"this agent's transport ({self.transport.value}{fell_back}; memPool {self.mem_pool.value})"

    def check(self, kind: str, shares: Sequence[BufferShare], devices: frozenset[Device]) -> None:
        """``layout_mismatch`` for a buffer of `kind` on a device `devices` leaves out, or GPU
        memory the transfer engine cannot move."""
        for share in shares:
            device = _SHARE_DEVICE[share.kind]
            if device not in devices:
                allowed = " or ".join(sorted(d.value for d in devices))
                gpu_note = ""
                if kind != "aux" and device is Device.CUDA:
                    gpu_note = f" (an engine's GPU KV moves on {', '.join(t.value for t in engine_gpu_transports())})"
                raise layout_mismatch(
                    f"{kind} buffers must be {allowed} memory on {self.where()}; one is shared as "
                    f"{share.kind.value}{gpu_note}"
                )
            if device is Device.CUDA and not self.engine_moves_gpu:
                raise layout_mismatch(
                    f"{kind} buffers are GPU memory, but the transfer engine of {self.where()} moves host "
                    f"memory only{': ' + self.host_only_because if self.host_only_because else ''}"
                )


def engine_layout(reg: MemoryRegistration, spec: PDClusterSpec, rank: Rank, rules: MemoryRules) -> PoolLayout:
    """The layout the registration gives this rank, or ``layout_mismatch`` naming what does not fit
    the PDCluster's model (spec.model) or the devices ``rules`` allow."""
    geo = spec.model
    group = spec.prefill if rank.role is Role.PREFILL else spec.decode
    layers = pp_layer_range(geo.layers, group.pp, rank.pp_rank)
    heads = local_heads(group.tp, geo.tp_kv_heads)
    where = f"{rank.rank_id} (TP {group.tp}, PP stage {rank.pp_rank} of {group.pp})"
    if reg.kv_kind is not geo.kv_kind:
        raise layout_mismatch(
            f"{reg.kv_kind.value} KV buffers registered, but the PDCluster's model has kvKind {geo.kv_kind.value}"
        )
    kv = reg.target_kv_buffers() if len(reg.k) == len(reg.v) else []
    # Fused: a layer's K and V in one buffer (vLLM), one head's share of a page twice as long.
    per_buffer = 2 if reg.kv_fused else 1
    kv_buffers = 1 if reg.kv_fused else geo.kv_buffers
    if len(kv) != kv_buffers * len(layers):
        per_layer = (
            "one latent buffer"
            if geo.kv_kind is KvKind.MLA
            else "one fused K and V buffer"
            if reg.kv_fused
            else "one K and one V buffer"
        )
        fused = f"{len(reg.fused)} fused K and V, " if reg.kv_fused else ""
        raise layout_mismatch(
            f"{fused}{len(reg.k)} K, {len(reg.v)} V and {len(reg.latent)} latent buffers registered, but {where} holds "
            f"layers {layers.start}..{layers.stop - 1} of the model's {geo.layers}: {per_layer} per layer"
        )
    if reg.kv_fused and reg.draft is not None:
        raise layout_mismatch("a draft model's KV beside fused K and V buffers (vLLM's) is not supported")
    shards = kv_shard_size(spec) if rank.role is Role.PREFILL else 1
    if reg.kv_shard_size != shards:
        raise layout_mismatch(
            f"the engine stripes its KV pages over {reg.kv_shard_size} ranks (SGLang's --enable-kv-cache-sharding), "
            f"but {rank.rank_id} holds {'every page' if shards == 1 else f'1 / {shards} of them'} by the PDCluster: "
            "set spec.prefill.kvCacheSharding to match the prefill engines (only they shard)"
        )
    if reg.page_tokens != geo.page_size_tokens:
        raise layout_mismatch(
            f"pages of {reg.page_tokens} tokens registered; the PDCluster's model has pageSizeTokens {geo.page_size_tokens}"
        )
    want_page = geo.kv_page_bytes(group.tp) * per_buffer
    if reg.kv_page_bytes != want_page:
        fused = ", K and V together" if reg.kv_fused else ""
        raise layout_mismatch(
            f"{reg.kv_page_bytes} KV bytes per page registered; {where} has {want_page} "
            f"({geo.describe_page(group.tp)}{fused}){_packing_hint(geo, reg.kv_page_bytes)}: check spec.model "
            "against the engine's model, TP size and KV dtype"
        )
    draft = draft_buffers(reg, geo.draft_layers, geo.draft_layers_on(group.pp, rank.pp_rank), where)
    kv_pages = _slots(kv + draft, reg.kv_page_bytes, "KV", "pages")
    items, state_slots = state_items(reg, spec, group.tp, where)
    # The aux rows are the engine's own (SGLang's MetadataBuffers): prefill and decode must register
    # the same, which the prefill agent checks on each room's info (rooms.room_info_checks.check_dst_layout).
    aux_slots = reg.aux_slots or min(
        (b.nbytes // size for b, size in zip(reg.aux, reg.aux_row_bytes, strict=True)), default=0
    )
    rules.check("KV", kv + draft, rules.kv_devices)
    rules.check("state", reg.state, rules.kv_devices)
    rules.check("aux", reg.aux, frozenset({rules.aux_device}))
    return PoolLayout(
        layers=len(layers),
        local_heads=heads,
        head_bytes=geo.head_page_bytes * per_buffer,
        kv_pages=kv_pages,
        state_layers=geo.state_layers,
        state_layer_bytes=geo.state_bytes_per_request // geo.state_layers,
        state_slots=state_slots,
        state_items=items,
        state_whole=geo.state_tensors,
        state_kind=geo.state_kind.value,
        aux_items=tuple(reg.aux_row_bytes),
        aux_slots=aux_slots,
        page_tokens=reg.page_tokens,
        page_order=reg.page_order,
        kv_buffers=kv_buffers,
        draft_layers=geo.draft_layers_on(group.pp, rank.pp_rank),
    )


def _packing_hint(geo: ModelGeometry, registered: int) -> str:
    """When an MLA registration's pages are the model's latent under the other kvPacking, say so
    (SGLang packs the fp8 DSA latent for its FlashMLA kernels, and not for trtllm or tilelang)."""
    if geo.kv_kind is not KvKind.MLA or geo.dtype != "float8_e4m3fn":
        return ""
    other = replace(geo, kv_packing=KvPacking.NONE if geo.packed else KvPacking.PACKED_FP8)
    if other.head_page_bytes != registered:
        return ""
    return f"; the engine's pages are the latent with spec.model.kvPacking {other.kv_packing.value} ({other.describe_page(1)})"


def _slots(shares: Sequence[BufferShare], unit: int, kind: str, what: str) -> int:
    """Units every buffer of a kind holds (the fewest, when the engine's buffers differ)."""
    bad = [b.nbytes for b in shares if b.nbytes % unit]
    if bad:
        raise layout_mismatch(f"a {kind} buffer of {bad[0]} bytes is not a whole number of {unit}-byte {what}")
    return min((b.nbytes // unit for b in shares), default=0)


class EngineMemory:
    """One rank's engine buffers, mapped into this process: ``kv`` in (layer, K/V or latent) order, ``state``
    per state layer, ``aux`` per item. Closing unmaps them; the engine keeps owning the memory."""

    def __init__(
        self,
        layout: PoolLayout,
        kv: list[Pool],
        state: list[Pool],
        aux: list[Pool],
        keep: Any,
        file_ranges: tuple[FileRange, ...] = (),  # the shared-memory ranges mapped
        *,
        aux_inline: bool = False,  # ``aux`` are the agent's rows: the engine's travel with its sends
    ) -> None:
        self.layout = layout
        self.aux_inline = aux_inline
        self.kv, self.state, self.aux = kv, state, aux
        self._keep = keep  # the open mappings (mmaps, IPC mappings) the pools point into
        # Fixed once mapped, and read per room.
        self.memory_map = MemoryMap(
            kv=tuple(p.addr for p in kv), state=tuple(p.addr for p in state), aux=tuple(p.addr for p in aux)
        )
        self._regions = (*kv, *state, *aux)
        self.file_ranges = file_ranges
        self.board: RoomBoard | None = None  # the engine's room board, when it offered one the agent maps
        self.board_refused = ""

    @classmethod
    def map(
        cls, reg: MemoryRegistration, layout: PoolLayout, *, shm_dir: str, gpu: int, aux_device: Device = Device.CPU
    ) -> EngineMemory:
        """Map every buffer; refuses (422) a file outside ``shm_dir``, a range past its end or one
        that cannot be mapped. Of each file only the range its buffers span is mapped. Aux rows
        the engine keeps private (``aux_slots``) get rows of the agent's own on ``aux_device``."""
        mapper = _Mapper(shm_dir, gpu, reg.rank, _spans(reg))
        try:
            names = ("latent",) if reg.kv_kind is KvKind.MLA else ("kv",) if reg.kv_fused else ("k", "v")
            kv = [
                mapper.map(share, f"{names[i % len(names)]}{i // len(names)}")
                for i, share in enumerate(reg.kv_buffers())
            ]
            state = [mapper.map(share, f"state{i}") for i, share in enumerate(reg.state)]
            aux = [mapper.map(share, f"aux{i}") for i, share in enumerate(reg.aux)]
            if reg.aux_inline:  # private engine rows: the agent's own, the engine hands them over
                aux = [
                    mapper.own(Pool.allocate(f"{reg.rank}-aux{i}-{os.getpid()}", layout.aux_slots * size,
                                             aux_device, shm_dir=shm_dir, gpu=gpu))
                    for i, size in enumerate(layout.aux_items)
                ]  # fmt: skip
        except BaseException:
            mapper.close()
            raise
        memory = cls(layout, kv, state, aux, mapper, tuple(mapper.ranges), aux_inline=reg.aux_inline)
        if reg.board is not None:
            memory.board, memory.board_refused = open_board(reg.board, reg.board_row_bytes, shm_dir)
        return memory

    def overlap(self, other: EngineMemory) -> FileRange | None:
        """A file range of this memory that `other` maps too (the same file, by device and inode)."""
        for mine in self.file_ranges:
            for theirs in other.file_ranges:
                if mine.file == theirs.file and mine.start < theirs.end and theirs.start < mine.end:
                    return mine
        return None

    def regions(self) -> tuple[Pool, ...]:
        return self._regions

    def put_aux_row(self, row: int, data: Sequence[bytes]) -> None:
        """A send's aux row (``SendRequest.aux_rows``) into the agent's rows of a private-aux engine."""
        for pool, size, raw in zip(self.aux, self.layout.aux_items, data, strict=True):
            pool.write(row * size, raw)

    def aux_row(self, row: int) -> tuple[bytes, ...]:
        """What landed in aux row ``row``, per item (a decode room's view hands it to the engine)."""
        return tuple(pool.read(row * size, size) for pool, size in zip(self.aux, self.layout.aux_items, strict=True))

    def answer(self, rank_id: str) -> MemoryAnswer:
        """What the agent answers the registration (and shows in /v1/info)."""
        devices = tuple(sorted({p.device.value for p in self.regions()}))
        board = self.board is not None
        return MemoryAnswer(rank_id, self.layout, len(self.regions()), devices, board, self.board_refused)

    def close(self) -> None:
        self.kv, self.state, self.aux, self._regions = [], [], [], ()
        if self.board is not None:
            self.board.release()
            self.board = None
        self._keep.close()


@dataclass(frozen=True)
class FileRange:
    """Bytes [start, end) of one shared-memory file, named by device and inode (``file``)."""

    file: tuple[int, int]
    start: int
    end: int
    path: str


def _spans(reg: MemoryRegistration) -> dict[str, tuple[int, int]]:
    """Per shared-memory path: the range its buffers span."""
    spans: dict[str, tuple[int, int]] = {}
    for share in (*reg.kv_buffers(), *reg.state, *reg.aux):
        if share.kind is ShareKind.SHM:
            lo, hi = spans.get(share.path, (share.offset, share.offset + share.nbytes))
            spans[share.path] = (min(lo, share.offset), max(hi, share.offset + share.nbytes))
    return spans


class _Mapper:
    """Maps each file's span once (buffers often share one file) and each CUDA allocation once."""

    def __init__(self, shm_dir: str, gpu: int, rank_id: str, spans: dict[str, tuple[int, int]]) -> None:
        self.shm_dir = os.path.realpath(shm_dir)
        self.gpu = gpu
        self.rank_id = rank_id
        self.spans = spans
        self.ranges: list[FileRange] = []
        self._files: dict[str, tuple[mmap.mmap, int]] = {}  # path as given -> (mapping, file offset of its start)
        self._ipc: Any = None  # fastpath.ipc.PeerMappings, opened on the first GPU buffer
        self._owned: list[Pool] = []  # the agent's own rows for private engine buffers

    def own(self, pool: Pool) -> Pool:
        """A pool of the agent's own that lives and goes with these mappings."""
        self._owned.append(pool)
        return pool

    def map(self, share: BufferShare, name: str) -> Pool:
        label = f"engine:{self.rank_id}:{name}"
        if share.kind is ShareKind.SHM:
            mem, base = self._file(share)
            at = share.offset - base
            view = memoryview(mem)[at : at + share.nbytes]
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mem)) + at
            return Pool(label, share.nbytes, Device.CPU, addr, share.path, view)
        return self._cuda(share, label)

    def _file(self, share: BufferShare) -> tuple[mmap.mmap, int]:
        found = self._files.get(share.path)
        if found is not None:
            return found
        fd, st = open_engine_file(share.path, self.shm_dir)
        try:
            lo, hi = self.spans[share.path]
            if hi > st.st_size:
                raise layout_mismatch(f"buffers up to byte {hi} of {share.path} run past its end ({st.st_size} bytes)")
            base = lo - lo % mmap.ALLOCATIONGRANULARITY
            try:
                mem = mmap.mmap(fd, hi - base, offset=base)
            except (OSError, OverflowError, ValueError) as exc:
                raise layout_mismatch(f"cannot map bytes {lo}..{hi} of {share.path}: {exc}") from None
        finally:
            os.close(fd)
        self._files[share.path] = (mem, base)
        self.ranges.append(FileRange((st.st_dev, st.st_ino), lo, hi, share.path))
        return mem, base

    def _cuda(self, share: BufferShare, label: str) -> Pool:
        import torch

        from pdfabric_agent.memory import cuda, ipc

        assert share.export is not None  # BufferShare.parse requires it for cuda-ipc
        export = ipc.PoolExport.from_json(share.export)
        if export.nbytes < share.nbytes:
            raise layout_mismatch(f"{label}: the CUDA export covers {export.nbytes} bytes, not {share.nbytes}")
        if self._ipc is None:
            self._ipc = ipc.PeerMappings(self.gpu)
        try:
            ptr = self._ipc.map(export)
        except (cuda.CudaError, ValueError) as exc:
            raise layout_mismatch(
                f"{label}: cannot open the engine's CUDA IPC handle on GPU {self.gpu}: {exc}"
            ) from None
        tensor = torch.as_tensor(DeviceBuffer(ptr, share.nbytes), device=f"cuda:{self.gpu}")
        return Pool(label, share.nbytes, Device.CUDA, ptr, json.dumps(dict(share.export)), tensor, self.gpu)

    def close(self) -> None:
        for pool in self._owned:
            pool.close()
        self._owned.clear()
        for mem, _ in self._files.values():
            with contextlib.suppress(BufferError):  # a view still exported: the OS unmaps at exit
                mem.close()
        self._files.clear()
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
