"""SGLang's own DSA pool (DeepSeek-V3.2's ``DSATokenToKVPool``: per layer the packed fp8 latent, and
the indexer's page-indexed keys with their scales) built on CPU with its tensors in a shared-memory
directory the agents map (``pdfabric_agent.client.shm.shared_cpu_allocations``, as the plugin allocates SGLang's
CPU pools), and the ``KVArgs`` SGLang's scheduler fills for it: the latent from the pool's own
``get_contiguous_buf_infos``, the indexer state from SGLang's ``setup_state_kv_args``.

The pool needs only SGLang's parallel state (its decode-CP width, 1 here); its kernels are never
called: tests write the bytes through the pool's own buffers."""

from __future__ import annotations

from typing import Any

import torch

KV_LORA_RANK, ROPE, PAGE_TOKENS = 512, 64, 64  # DeepSeek-V3.2's latent; SGLang's DSA needs 64-token pages
INDEX_HEAD_DIM = 128  # SGLang asserts it for DSA
PACKED_TOKEN = KV_LORA_RANK + KV_LORA_RANK // 128 * 4 + ROPE * 2  # 656: SGLang's calculate_mla_kv_cache_dim
INDEX_PAGE = PAGE_TOKENS * (INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4)  # 8448: keys, then a float32 scale each


def dsa_model(layers: int) -> dict[str, Any]:
    """spec.model for the pool: the packed latent and one page state tensor (indexer keys) a layer."""
    return {
        "layers": layers,
        "kvKind": "MLA",
        "kvLoraRank": KV_LORA_RANK,
        "qkRopeHeadDim": ROPE,
        "kvPacking": "packedFp8",
        "dtype": "float8_e4m3fn",
        "pageSizeTokens": PAGE_TOKENS,
        "stateKind": "page",
        "stateTensorBytes": [INDEX_PAGE] * layers,
        "auxRowBytes": [64, 64, 64],
    }


def dsa_pool(shm_dir: str, *, layers: int, pages: int) -> Any:
    """SGLang's DSATokenToKVPool with an fp8 KV cache (the packed latent) of ``pages`` pages."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from pdfabric_agent.client.shm import shared_cpu_allocations

    with get_parallel().override(attn_dcp_size=1), shared_cpu_allocations(shm_dir):
        return DSATokenToKVPool(
            size=pages * PAGE_TOKENS,
            page_size=PAGE_TOKENS,
            kv_lora_rank=KV_LORA_RANK,
            dtype=torch.float8_e4m3fn,
            qk_rope_head_dim=ROPE,
            layer_num=layers,
            device="cpu",
            index_head_dim=INDEX_HEAD_DIM,
            enable_memory_saver=False,
            kv_cache_dim=PACKED_TOKEN,
        )


def dsa_kv_args(pool: Any, aux_args: Any) -> Any:
    """SGLang's KVArgs for the DSA pool: ``aux_args`` (the reference engine's KVArgs of its aux rows
    and rank fields) with the pool's latent buffers and its state components as SGLang registers them."""
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    aux_args.kv_data_ptrs, aux_args.kv_data_lens, aux_args.kv_item_lens = pool.get_contiguous_buf_infos()
    aux_args.kv_cache_dtype_str = "fp8_e4m3"
    setup_state_kv_args(aux_args, pool)
    return aux_args


def latent_pages(pool: Any, layer: int) -> Any:
    """The layer's packed latent as [pages, page bytes] uint8 (a view; page 0 is SGLang's padding page)."""
    return pool.kv_buffer[layer].view(-1, PAGE_TOKENS * PACKED_TOKEN)


def index_pages(pool: Any, layer: int) -> Any:
    """The layer's indexer keys and scales as [pages, page bytes] uint8 (a view)."""
    return pool.index_k_with_scale_buffer[layer]
