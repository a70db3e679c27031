"""vLLM's KV cache as the agent takes it.

vLLM (0.32) allocates every layer's cache in one backing buffer and views it per layer as
``[blocks, heads, tokens, K | V]`` (``KVCacheLayout``): each page of a layer holds every head's K
and V side by side. With a layer-compact layout (``LBHNC``, its CPU backend's; ``LBNHC``
token-major) a layer's pages are contiguous, so each layer is one fused K and V buffer of whole
pages (``MemoryRegistration.fused``), a head's share of a page one run, as the agent's head-sliced
transfers need. Block-outermost layouts put other layers between a layer's pages: refused by name.

On CPU, vLLM's cache is private memory the agent cannot map: ``kv_allocation`` (the connector's
``get_mem_pool_context``) makes the backing buffer a shared-memory file in the agent's
directory, as the SGLang plugin does for SGLang's pools (``pdfabric_agent.client.shm``)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from pdfabric_agent.client.shares import UnshareableBuffer, process_mappings, share_of
from pdfabric_agent.client.shm import shared_cpu_allocations, shm_dir
from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.memory_registration import MemoryRegistration


def kv_allocation(device: Any) -> contextlib.AbstractContextManager[None] | None:
    """The context vLLM allocates its KV cache in: shared-memory files for a CPU cache; None (vLLM's
    own allocator) on a GPU, whose allocations the agent opens through CUDA IPC."""
    return shared_cpu_allocations(shm_dir()) if str(device) == "cpu" else None


def page_order(tensor: Any) -> PageOrder:
    """How one layer's ``[blocks, heads, tokens, K | V]`` view lies in memory, or
    ``UnshareableBuffer`` when its pages are not contiguous runs of whole pages."""
    if tensor.is_contiguous():
        return PageOrder.HEAD_MAJOR
    if tensor.permute(0, 2, 1, 3).is_contiguous():
        return PageOrder.TOKEN_MAJOR
    raise UnshareableBuffer(
        f"a KV cache layer of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not a run of whole "
        "pages (a block-outermost VLLM_KV_CACHE_LAYOUT?): pdfabric moves layer-compact layouts (LBHNC, LBNHC)"
    )


def registration(rank_id: str, kv_caches: Mapping[str, Any], gpu: int | None) -> MemoryRegistration:
    """Each layer's cache as one fused K and V buffer, in the model's layer order."""
    if not kv_caches:
        raise UnshareableBuffer("vLLM registered no KV cache layers")
    tensors = list(kv_caches.values())
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        raise UnshareableBuffer("layers that share one KV cache (cross-layer KV sharing) are not supported")
    shapes = {tuple(t.shape[1:]) for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(shapes) != 1 or len(dtypes) != 1 or any(t.dim() != 4 for t in tensors):
        raise UnshareableBuffer(
            f"KV cache layers of shapes {sorted(shapes)} and dtypes {sorted(map(str, dtypes))}: pdfabric moves "
            "one page geometry for every layer (a hybrid model's groups are not supported)"
        )
    orders = {page_order(t) for t in tensors}
    if len(orders) != 1:
        raise UnshareableBuffer(f"KV cache layers in different page orders {sorted(orders)}")
    (order,) = orders
    _, heads, tokens, content = tensors[0].shape
    page_bytes = heads * tokens * content * tensors[0].element_size()
    maps = process_mappings()
    shares = [share_of(t.data_ptr(), t.shape[0] * page_bytes, gpu, maps) for t in tensors]
    return MemoryRegistration(
        rank=rank_id,
        page_order=order,
        page_tokens=int(tokens),
        kv_page_bytes=page_bytes,
        k=[],
        v=[],
        fused=shares,
        state_slot_bytes=0,
        state=[],
        aux_row_bytes=[],
        aux=[],
    )
