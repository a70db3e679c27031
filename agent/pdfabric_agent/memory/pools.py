"""KV, state and aux pools of one rank: their byte layout and their memory.

Layout (all offsets in bytes from the pool base):
- KV pool: [layer][K=0, V=1][page][head][token][dim] (MLA: [layer][latent][page]..., one buffer
  per layer, one head: ``kv_buffers``). Heads are the outer dimension inside a page
  (``PageOrder.HEAD_MAJOR``), so the head slice a TP-mismatched route moves is one contiguous block
  per page. An engine's own buffers (``memory.py``, SGLang's) keep [token][head][dim] pages
  (``PageOrder.TOKEN_MAJOR``): there a head slice is one block per token of the page.
- state pool: [state layer][slot][bytes per layer]; one slot holds one request's state.
- aux pool: one region per aux item, [item][slot][item bytes], like upstream MetadataBuffers.

Memory: CPU pools are files under PDFABRIC_SHM_DIR mapped with mmap, so a serving engine on the
node maps the very bytes the engine registered. GPU pools (nvlink-intra, or metadata buffers the
device policy puts on the GPU) are allocated with torch on the rank's GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from pdfabric_core.policy.rank_mapping import local_heads, pp_layer_range
from pdfabric_core.policy.types import Device
from pdfabric_core.spec import ModelGeometry

log = logging.getLogger("pdfabric.pools")


class PageOrder(StrEnum):
    """How the bytes of one KV page are ordered."""

    HEAD_MAJOR = "head-major"  # [head][token][dim]: the agent's own pools
    TOKEN_MAJOR = "token-major"  # [token][head][dim]: SGLang's pools (one row of heads per token)


@dataclass(frozen=True)
class PoolLayout:
    layers: int
    local_heads: int
    head_bytes: int  # one head of one page of one layer's K (or V, or latent)
    kv_pages: int
    state_layers: int
    state_layer_bytes: int  # one slot of one state layer
    state_slots: int
    aux_items: tuple[int, ...]
    aux_slots: int
    page_tokens: int = 1  # tokens per page: a token-major head slice is one block per token
    page_order: PageOrder = PageOrder.HEAD_MAJOR
    kv_buffers: int = 2  # KV buffers per layer: K and V, or the MLA latent (ModelGeometry.kv_buffers)
    # Typed state: item bytes of each state tensor on this rank (empty: state_layers of
    # state_layer_bytes), each tensor's whole item (before TP sharding) and the state kind; the
    # last two must be the peer's (``plan_transfer`` refuses otherwise).
    state_items: tuple[int, ...] = ()
    state_whole: tuple[int, ...] = ()
    state_kind: str = "slot"
    # Draft KV layers (ModelGeometry.draft_layers; the last PP stage only): after the target's
    # ``layers``, of the same page geometry, so layer index ``layers + d`` is draft layer d.
    draft_layers: int = 0

    @property
    def kv_layers(self) -> int:
        """Every KV layer this rank holds: the target's, then the draft's."""
        return self.layers + self.draft_layers

    def state_item(self, tensor: int) -> int:
        """Bytes of one slot (row, page) of state tensor ``tensor``."""
        return self.state_items[tensor] if self.state_items else self.state_layer_bytes

    @property
    def state_signature(self) -> tuple[str, tuple[int, ...]]:
        """What prefill and decode must agree on: the kind and each tensor's whole item bytes."""
        whole = self.state_whole or (self.state_layer_bytes,) * (self.state_layers if self.state_layer_bytes else 0)
        return self.state_kind, whole

    @property
    def token_head_bytes(self) -> int:
        """One head of one token (a token-major page's unit)."""
        return self.head_bytes // max(self.page_tokens, 1)

    @classmethod
    def from_geometry(
        cls,
        geo: ModelGeometry,
        tp: int,
        *,
        kv_pages: int,
        state_slots: int,
        aux_slots: int,
        pp: int = 1,
        pp_stage: int = 0,
    ) -> PoolLayout:
        """One rank's layout; a PP stage holds only its own layers (pp_layer_range). The geometry
        is a parsed spec's, whose state bytes divide into its state layers (parse_spec, the CRD)."""
        return cls(
            layers=len(pp_layer_range(geo.layers, pp, pp_stage)),
            local_heads=local_heads(tp, geo.tp_kv_heads),
            head_bytes=geo.head_page_bytes,
            kv_pages=kv_pages,
            state_layers=geo.state_layers,
            state_layer_bytes=geo.state_bytes_per_request // geo.state_layers,
            state_slots=state_slots,
            state_items=geo.state_item_bytes(tp),
            state_whole=geo.state_tensors,
            state_kind=geo.state_kind.value,
            aux_items=tuple(geo.aux_row_bytes),
            aux_slots=aux_slots,
            page_tokens=geo.page_size_tokens,
            kv_buffers=geo.kv_buffers,
            draft_layers=geo.draft_layers_on(pp, pp_stage),
        )

    @property
    def page_bytes(self) -> int:
        return self.local_heads * self.head_bytes

    def fused(self) -> PoolLayout:
        """This MHA layout as an engine that keeps a layer's K and V in one buffer holds it (vLLM:
        ``MemoryRegistration.fused``): one buffer per layer, a head's share of a page twice as long."""
        if self.kv_buffers != 2:
            raise ValueError(f"only K and V buffers fuse; this layout has {self.kv_buffers} KV buffer per layer")
        return dataclasses.replace(self, kv_buffers=1, head_bytes=2 * self.head_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.kv_layers * self.kv_buffers * self.kv_pages * self.page_bytes

    @property
    def state_bytes(self) -> int:
        return self.state_slots * sum(self.state_item(t) for t in range(self.state_layers))

    @property
    def aux_row_bytes(self) -> int:
        return sum(self.aux_items)

    @property
    def aux_bytes(self) -> int:
        return self.aux_row_bytes * self.aux_slots

    def kv_offset(self, layer: int, kv: int, page: int, head: int = 0) -> int:
        return ((layer * self.kv_buffers + kv) * self.kv_pages + page) * self.page_bytes + head * self.head_bytes

    def state_offset(self, layer: int, slot: int) -> int:
        before = sum(self.state_item(t) for t in range(layer))
        return before * self.state_slots + slot * self.state_item(layer)

    def aux_offset(self, item: int, slot: int) -> int:
        return sum(self.aux_items[:item]) * self.aux_slots + slot * self.aux_items[item]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_items"] = list(self.aux_items)
        d["page_order"] = self.page_order.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolLayout:
        """Raises ValueError for an unknown page order, TypeError/KeyError for other bad fields."""
        order = PageOrder(d.get("page_order", PageOrder.HEAD_MAJOR.value))
        tuples = {k: tuple(d.get(k, ())) for k in ("aux_items", "state_items", "state_whole")}
        return cls(**{**d, **tuples, "page_order": order})


@dataclass(frozen=True)
class DeviceBuffer:
    """A raw device allocation, seen by torch through the CUDA array interface (no copy)."""

    ptr: int
    size: int

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}


class Pool:
    """One registered memory region. ``addr`` is what the engine registers and peers write to."""

    def __init__(
        self, name: str, size: int, device: Device, addr: int, handle: str, keep: Any, gpu: int | None = None
    ) -> None:
        self.name = name
        self.size = size
        self.device = device
        self.addr = addr
        # CPU: the shm file path a client maps. CUDA: the pool's CUDA IPC export (JSON) a client on
        # this node opens, "" when the allocation cannot be exported (then clients cannot map it).
        self.handle = handle
        self.gpu = gpu
        self._keep = keep  # mmap or tensor owning the memory
        self._device_buffer: DeviceBuffer | None = None  # a GPU pool's own allocation, freed on close

    @classmethod
    def allocate(cls, name: str, size: int, device: Device, *, shm_dir: str, gpu: int = 0) -> Pool:
        size = max(size, 1)  # the engine refuses zero-length registrations; an unused pool is 1 byte
        if device is Device.CPU:
            path = os.path.join(shm_dir, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                mem = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
            return cls(name, size, device, addr, path, mem)
        if device is Device.CUDA:
            import torch

            from pdfabric_agent.memory import cuda

            # A device allocation of its own (not torch's caching allocator, which packs several
            # tensors into one segment): its CUDA IPC export opens this pool and nothing beside it.
            cuda.primary_context(gpu)
            buffer = DeviceBuffer(cuda.mem_alloc(size), size)
            tensor = torch.as_tensor(buffer, device=f"cuda:{gpu}")
            tensor.zero_()
            pool = cls(name, size, device, buffer.ptr, _ipc_handle(tensor, gpu), tensor, gpu)
            pool._device_buffer = buffer
            return pool
        raise ValueError(f"pools on {device.value} are not supported by this agent")

    def view(self) -> memoryview:
        if self.device is not Device.CPU:
            raise ValueError("only CPU pools can be viewed from Python")
        return memoryview(self._keep)

    def tensor(self) -> Any:
        """The torch uint8 tensor of a GPU pool (integrity checksums read it on the device)."""
        if self.device is not Device.CUDA:
            raise ValueError("only GPU pools are tensors")
        return self._keep

    def read(self, offset: int, length: int) -> bytes:
        """Copy bytes out (the TCP side channel reads aux rows this way, from CPU or GPU pools)."""
        if not 0 <= offset <= offset + length <= self.size:
            raise ValueError(f"{self.name}: {length} bytes at {offset} outside {self.size}")
        if self.device is Device.CPU:
            return bytes(memoryview(self._keep)[offset : offset + length])
        return bytes(self._keep[offset : offset + length].cpu().numpy().tobytes())

    def write(self, offset: int, data: bytes) -> None:
        if not 0 <= offset <= offset + len(data) <= self.size:
            raise ValueError(f"{self.name}: {len(data)} bytes at {offset} outside {self.size}")
        if self.device is Device.CPU:
            memoryview(self._keep)[offset : offset + len(data)] = data
            return
        import torch

        self._keep[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def close(self) -> None:
        if self.device is Device.CPU and self.handle:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.handle)
            # A ctypes view may still point into the map; then the OS frees it at exit.
            with contextlib.suppress(BufferError):
                self._keep.close()
        self._keep = None
        if self._device_buffer is not None:
            import torch

            from pdfabric_agent.memory import cuda

            torch.cuda.synchronize(self.gpu)  # nothing of ours still writes or reads it
            cuda.mem_free(self._device_buffer.ptr)
            self._device_buffer = None


def region_of(regions: Sequence[Pool], addr: int, length: int) -> Pool:
    """The registered region holding ``length`` bytes at ``addr`` (the rank's pools, or an
    engine's buffers); ValueError when none does."""
    for pool in regions:
        if pool.addr <= addr and addr + length <= pool.addr + pool.size:
            return pool
    raise ValueError(f"{length} bytes at {addr:#x} are outside the rank's memory")


def _ipc_handle(tensor: Any, gpu: int) -> str:
    """The CUDA IPC export of a GPU pool as JSON, or "" (logged) when it has none: pools from
    cuMemCreate (torch's expandable segments) have no legacy IPC handle."""
    from pdfabric_agent.memory import cuda, ipc

    try:
        import torch

        torch.cuda.synchronize(gpu)  # the zero-fill lands before anyone else maps the pool
        return json.dumps(ipc.export_pool(tensor.data_ptr(), tensor.numel(), gpu).to_json())
    except cuda.CudaError as exc:
        log.warning("GPU pool on cuda:%d cannot be exported for clients: %s", gpu, exc)
        return ""


@dataclass
class RankPools:
    layout: PoolLayout
    kv: Pool
    state: Pool
    aux: Pool

    def all(self) -> tuple[Pool, Pool, Pool]:
        return (self.kv, self.state, self.aux)

    def close(self) -> None:
        for pool in self.all():
            pool.close()
