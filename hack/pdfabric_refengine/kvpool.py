"""A paged KV pool of one engine rank in SGLang's layout, and the KVArgs SGLang's scheduler
builds from it.

Layout (SGLang's MHATokenToKVPool, NHD): per layer one K and one V buffer of shape
[num_pages * page_size, local_heads, head_dim], token-indexed, so page p is tokens
p*page_size .. p*page_size+page_size-1 and its bytes are [token][head][dim], contiguous. A
page is therefore one `item_len` block, and a head slice of a token is one contiguous run.
With ``mla`` (SGLang's MLATokenToKVPool): per layer one latent buffer of shape
[num_pages * page_size, 1, kv_lora_rank + qk_rope_head_dim] (``head_dim`` is the latent width),
in ``k_buffers``; there are no V buffers.

On CPU every buffer lives in one shared-memory file the pool creates (each buffer at a
4096-aligned offset), so another process (the agent) can map the same bytes by path; on CUDA
each buffer is its own allocation, which the agent reaches by CUDA IPC.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVArgs  # type: ignore[import-untyped,unused-ignore]

ALIGN = 4096  # page-aligned offsets: registrable by RDMA, mappable one buffer at a time


@dataclass(frozen=True)
class AuxItem:
    """One metadata buffer: `width` elements of `dtype` per aux slot (SGLang's MetadataBuffers)."""

    name: str
    dtype: torch.dtype
    width: int


# A subset of SGLang's MetadataBuffers, in its order: the first output token (padded to 16 int32,
# the 64 B RDMA minimum), the cached-token count, and the bootstrap room that validates a row.
AUX_ITEMS: tuple[AuxItem, ...] = (
    AuxItem("output_ids", torch.int32, 16),
    AuxItem("cached_tokens", torch.int32, 16),
    AuxItem("bootstrap_room", torch.uint64, 8),
)


@dataclass(frozen=True)
class BufferInfo:
    """Where one buffer's bytes are: its address, size and (CPU) offset in the pool's shm file."""

    name: str
    data_ptr: int
    nbytes: int
    offset: int | None  # None on CUDA: the buffer is its own allocation


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class KVPool:
    """K/V buffers per layer plus aux rows, for one engine rank holding `local_heads` KV heads."""

    def __init__(
        self,
        *,
        layers: int,
        local_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        aux_slots: int = 8,
        device: str = "cpu",
        aux_device: str | None = None,  # the aux rows' device, default `device` (SGLang: cpu but on INTRA_NODE_NVLINK)
        shm_dir: str = "/dev/shm",
        name: str | None = None,
        state_layers: int = 0,
        state_slot_bytes: int = 0,
        state_slots: int = 8,
        mla: bool = False,  # one latent buffer per layer (one head of the latent width), no V
    ) -> None:
        if min(layers, local_heads, head_dim, num_pages, page_size, aux_slots) < 1:
            raise ValueError("layers, heads, head_dim, pages, page_size and aux slots must all be positive")
        if mla and local_heads != 1:
            raise ValueError(f"an MLA pool holds one latent per token, not {local_heads} heads")
        self.mla = mla
        self.layers = layers
        self.local_heads = local_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.aux_slots = aux_slots
        self.device = torch.device(device)
        self.shm_path: str | None = None
        self._mmap: mmap.mmap | None = None

        kv_shape = (num_pages * page_size, local_heads, head_dim)
        specs: list[tuple[str, tuple[int, ...], torch.dtype]] = [
            *((f"{'latent' if mla else 'k'}{layer}", kv_shape, dtype) for layer in range(layers)),
            *((f"v{layer}", kv_shape, dtype) for layer in range(0 if mla else layers)),
            *((f"aux.{item.name}", (aux_slots, item.width), item.dtype) for item in AUX_ITEMS),
            # One slot-indexed state kind (Mamba's, in SGLang): per state layer [slot][bytes].
            *(
                (f"state{i}", (state_slots, state_slot_bytes), torch.uint8)
                for i in range(state_layers if state_slot_bytes else 0)
            ),
        ]
        aux_dev = torch.device(aux_device) if aux_device else self.device
        places = [aux_dev if spec[0].startswith("aux.") else self.device for spec in specs]
        # CPU buffers in one shared-memory file (the agent maps them there), the rest on the GPU.
        on_cpu = [i for i, place in enumerate(places) if place.type == "cpu"]
        tensors: list[torch.Tensor] = []
        offsets: list[int | None] = [None] * len(specs)
        placed: dict[int, torch.Tensor] = {}
        if on_cpu:
            cpu_tensors, cpu_offsets = self._map_shm([specs[i] for i in on_cpu], shm_dir, name)
            placed = dict(zip(on_cpu, cpu_tensors, strict=True))
            for i, off in zip(on_cpu, cpu_offsets, strict=True):
                offsets[i] = off
        for i, ((_, shape, dt), place) in enumerate(zip(specs, places, strict=True)):
            # SGLang zero-fills its pools too; untouched pages read as zeros on both devices.
            tensors.append(placed[i] if i in placed else torch.zeros(shape, dtype=dt, device=place))

        nkv = layers if mla else 2 * layers  # KV buffers in all
        self.k_buffers: list[torch.Tensor] = tensors[:layers]
        self.v_buffers: list[torch.Tensor] = tensors[layers:nkv]
        n_aux = len(AUX_ITEMS)
        self.aux: dict[str, torch.Tensor] = {
            item.name: t for item, t in zip(AUX_ITEMS, tensors[nkv : nkv + n_aux], strict=True)
        }
        # One state kind at most (the reference model is plain MHA: none unless asked for), one
        # tensor per state layer, registered after KV and aux as SGLang's setup_state_kv_args does.
        self.state_slot_bytes = state_slot_bytes
        self.state_buffers: list[list[torch.Tensor]] = [tensors[nkv + n_aux :]] if state_slot_bytes else []
        infos = [
            BufferInfo(spec[0], t.data_ptr(), t.nbytes, off)
            for spec, t, off in zip(specs, tensors, offsets, strict=True)
        ]
        self.k_infos: list[BufferInfo] = infos[:layers]
        self.v_infos: list[BufferInfo] = infos[layers:nkv]
        self.aux_infos: list[BufferInfo] = infos[nkv : nkv + n_aux]
        self.state_infos: list[BufferInfo] = infos[nkv + n_aux :]

        self._free_pages: list[int] = list(range(num_pages))
        self._free_slots: list[int] = list(range(aux_slots))

    def _map_shm(
        self, specs: list[tuple[str, tuple[int, ...], torch.dtype]], shm_dir: str, name: str | None
    ) -> tuple[list[torch.Tensor], list[int | None]]:
        """Create the pool's file, map it shared, and carve one aligned view per buffer."""
        offsets: list[int | None] = []
        end = 0
        for _, shape, dt in specs:
            offsets.append(end)
            end = _align(end + _numel(shape) * dt.itemsize)
        path = os.path.join(shm_dir, name or f"pdfabric-refengine-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        # O_EXCL: the pool owns its file; two pools never share one by accident.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, end)  # a fresh file reads as zeros: untouched pages are zero
            self._mmap = mmap.mmap(fd, end, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the memory; the path is for other processes
        self.shm_path = path
        tensors = [
            torch.frombuffer(self._mmap, dtype=dt, count=_numel(shape), offset=off or 0).view(shape)
            for (_, shape, dt), off in zip(specs, offsets, strict=True)
        ]
        return tensors, offsets

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one K or V buffer (SGLang's kv_item_len)."""
        return self.page_size * self.local_heads * self.head_dim * self.dtype.itemsize

    def buffer(self, kind: Literal["k", "v"], layer: int) -> torch.Tensor:
        return (self.k_buffers if kind == "k" else self.v_buffers)[layer]

    def page(self, kind: Literal["k", "v"], layer: int, page: int) -> torch.Tensor:
        """A view of one page: [page_size, local_heads, head_dim]."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is outside a pool of {self.num_pages} pages")
        start = page * self.page_size
        return self.buffer(kind, layer)[start : start + self.page_size]

    def allocate_pages(self, n: int) -> list[int]:
        """`n` free pages, lowest first (a plain free list, like SGLang's paged allocator)."""
        if n > len(self._free_pages):
            raise MemoryError(f"{n} pages asked, {len(self._free_pages)} free")
        pages, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        return pages

    def free_pages(self, pages: list[int]) -> None:
        bad = [p for p in pages if not 0 <= p < self.num_pages or p in self._free_pages]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"pages {sorted(bad) or list(pages)} are not allocated (or repeat)")
        self._free_pages = sorted(self._free_pages + list(pages))

    def allocate_aux_slot(self) -> int:
        if not self._free_slots:
            raise MemoryError("no free aux slot")
        return self._free_slots.pop(0)

    def free_aux_slot(self, slot: int) -> None:
        if not 0 <= slot < self.aux_slots or slot in self._free_slots:
            raise ValueError(f"aux slot {slot} is not allocated")
        for row in self.aux.values():
            row[slot].zero_()  # the next owner must not read this request's first token
        self._free_slots = sorted([*self._free_slots, slot])

    def close(self) -> None:
        """Unlink the shm file and drop the buffers; views still held elsewhere stay valid
        until released (the mapping goes with the last one)."""
        self.k_buffers, self.v_buffers, self.aux = [], [], {}
        if self._mmap is not None:
            # A caller may still hold a view; then the mapping is freed with the last one.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
            self.shm_path = None

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def kv_args(
    pool: KVPool,
    *,
    engine_rank: int,
    page_size: int,
    kv_head_num: int,
    total_kv_head_num: int,
    gpu_id: int = 0,
    pp_rank: int = 0,
    prefill_start_layer: int = 0,
    system_dp_rank: int = 0,
    ib_device: str = "",
    cls: Any = None,
    state_type: str = "mamba",
) -> KVArgs:
    """SGLang's KVArgs for `pool`, filled the way its prefill/decode scheduler fills it for an
    MHATokenToKVPool (or, for an ``mla`` pool, an MLATokenToKVPool: one latent per layer, and
    no KV head counts) with MetadataBuffers, and its state buffers as one component of SGLang's
    ``state_type`` (``mamba``: slot state; ``dsa``: DSA's page-indexed indexer keys beside MLA)."""
    # Imported here: SGLang pulls in its server args, seconds of import a pure compute user
    # (model, pools, prefill/decode) need not pay.
    if cls is None:
        from sglang.srt.disaggregation.base.conn import KVArgs as cls  # type: ignore[import-untyped,unused-ignore]

    if page_size != pool.page_size:
        raise ValueError(f"page_size {page_size} differs from the pool's {pool.page_size}")
    if kv_head_num != pool.local_heads:
        raise ValueError(f"kv_head_num {kv_head_num} differs from the pool's {pool.local_heads} local heads")
    args = cls()  # SGLang's KVArgs; any attribute holder (types.SimpleNamespace) without SGLang
    args.engine_rank = engine_rank
    args.pp_rank = pp_rank
    args.system_dp_rank = system_dp_rank
    args.rust_http_port = None
    args.kv_cache_dtype_str = "auto"  # ServerArgs' default: the KV cache is the model's dtype
    args.kv_layout = None  # only DeepSeek-V4 pools have a choice of byte layout
    args.prefill_start_layer = prefill_start_layer
    args.prefill_end_layer = prefill_start_layer + pool.layers  # exclusive
    kv = pool.k_infos + pool.v_infos  # MHA: every layer's K, then every layer's V; MLA: the latents
    args.kv_data_ptrs = [b.data_ptr for b in kv]
    args.kv_data_lens = [b.nbytes for b in kv]
    args.kv_item_lens = [pool.page_bytes for _ in kv]
    args.num_draft_entries = 0
    # build_kv_layer_ids gives plain MHA pools no ids (peers pair buffers by position); only
    # hybrid pools report them, as their layer ids twice (K, then V).
    args.kv_layer_ids = []
    if not pool.mla:  # SGLang's schedulers set no head counts for an MLA pool
        args.kv_head_num = kv_head_num
        args.total_kv_head_num = total_kv_head_num
    args.page_size = page_size
    args.aux_data_ptrs = [b.data_ptr for b in pool.aux_infos]
    args.aux_data_lens = [b.nbytes for b in pool.aux_infos]
    args.aux_item_lens = [t[0].nbytes for t in pool.aux.values()]
    args.ib_device = ib_device
    args.gpu_id = gpu_id
    # setup_state_kv_args: one list per state kind (none for a pool without state).
    kinds = [pool.state_infos] if pool.state_infos else []
    try:
        from sglang.srt.disaggregation.base.conn import StateType  # type: ignore[import-untyped,unused-ignore]

        typed: Any = StateType(state_type)
    except ImportError:  # no SGLang here: its value (StateType is a str enum)
        typed = state_type
    args.state_types = [typed] * len(kinds)
    args.state_data_ptrs = [[b.data_ptr for b in k] for k in kinds]
    args.state_data_lens = [[b.nbytes for b in k] for k in kinds]
    args.state_item_lens = [[pool.state_slot_bytes for _ in k] for k in kinds]
    args.state_layer_ids = [list(range(len(k))) for k in kinds]
    args.state_dim_per_tensor = [[0 for _ in k] for k in kinds]
    args.state_slice_outer_counts = [[1 for _ in k] for k in kinds]
    args.state_conv_shard_groups = [[None for _ in k] for k in kinds]
    args.is_hybrid_mla_backend = False
    args.swa_kv_cache_layout = None
    args.mla_compression_ratios = None
    # NPU-only fields, at the values a non-NPU pool implies (one K/V group, no draft layers).
    args.kv_buf_groups = 1
    args.hidden_kv_layers = pool.layers
    args.draft_kv_layers = 0
    return args
