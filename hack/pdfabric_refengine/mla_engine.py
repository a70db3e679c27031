"""The MLA reference model (``mla.py``) over SGLang-layout pools: prefill writes each rank's latent
pages and indexer state, decode generates from its pools alone.

Pools (``KVPool(mla=True)``): per layer one latent buffer [pages * page_size, 1, latent_width],
page-major as SGLang's MLATokenToKVPool, whole on every attention-TP rank; and per layer one state
buffer of page-indexed indexer keys (DSA's, narrowed): state page s holds the indexer keys of KV
page s, [page_size, index_dim] float32, registered after KV and aux as SGLang registers a DSA
pool's indexer (state type ``dsa``: page state beside MLA, one page item a layer, so the spec's
``stateTensorBytes`` is one page per layer and a request moves its pages' items).

Prefill CP: CP rank c writes the latent of its page shard only; the indexer state is whole on
every CP rank (prefill CP all-gathers before writing state, the second seed's premise), so with
all-ranks transfer only CP rank 0's copy is sent (dedup). Under the DSA cache layer split each CP
rank owns its contiguous share of the state layers and writes only those, so a fabric that took
any layer from another rank would hand decode zeros there and change its tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from pdfabric_core.policy.rank_mapping import cp_page_shard, state_layer_shard
from pdfabric_refengine.engine import _write_aux, pages_for, token_slots
from pdfabric_refengine.geometry import AUX_ROW_BYTES, DTYPE, PAGE_SIZE
from pdfabric_refengine.kvpool import KVPool
from pdfabric_refengine.mla import MLACache, MLAConfig, MLAModel, greedy_continue, prefill_forward

MLA_CONFIG = MLAConfig()


def mla_spec_model(cfg: MLAConfig = MLA_CONFIG, page_size: int = PAGE_SIZE, draft_layers: int = 0) -> dict[str, Any]:
    """The PDCluster's ``spec.model`` for the MLA reference model (with its MTP draft's KV layers)."""
    return {
        "draftLayers": draft_layers,
        "layers": cfg.layers,
        "kvKind": "MLA",
        "kvLoraRank": cfg.kv_lora_rank,
        "qkRopeHeadDim": cfg.qk_rope_head_dim,
        "dtype": DTYPE,
        "pageSizeTokens": page_size,
        # SGLang's DSA indexer state: page state, one page of indexer keys a layer.
        "stateKind": "page",
        "stateTensorBytes": [state_slot_bytes(cfg, page_size)] * cfg.layers,
        "auxRowBytes": list(AUX_ROW_BYTES),
    }


def state_slot_bytes(cfg: MLAConfig, page_size: int = PAGE_SIZE) -> int:
    """Bytes of one state slot of one layer: a page of indexer keys, float32."""
    return page_size * cfg.index_dim * 4


def mla_pool(cfg: MLAConfig, *, num_pages: int, page_size: int = PAGE_SIZE, **kw: Any) -> KVPool:
    """One rank's pool: the latent per layer, aux rows, and as many indexer slots as pages."""
    return KVPool(
        layers=cfg.layers, local_heads=1, head_dim=cfg.latent_width, num_pages=num_pages, page_size=page_size,
        mla=True, state_layers=cfg.layers, state_slot_bytes=state_slot_bytes(cfg, page_size), state_slots=num_pages,
        **kw,
    )  # fmt: skip


def _index_view(pool: KVPool, layer: int, index_dim: int) -> torch.Tensor:
    """The layer's state buffer as indexer keys, [slots, page_size, index_dim] (a view)."""
    return pool.state_buffers[0][layer].view(torch.float32).view(pool.num_pages, pool.page_size, index_dim)


def prefill_mla(
    model: MLAModel,
    prompt_ids: list[int],
    pools: list[list[KVPool]],
    pages: list[list[int]],
    slots: list[list[int]],
    aux_slot: int,
    *,
    layer_split: bool = False,
    room: int = 0,
) -> int:
    """Prefill with ``len(pools)`` CP ranks of ``len(pools[c])`` TP ranks; returns the first token.

    CP rank c writes request page ``shard[j]``'s latent at its local page ``pages[c][j]`` (every
    TP rank the same), and the indexer keys of request page i at its state slot ``slots[c][i]``
    for the state layers it owns (all of them unless ``layer_split``)."""
    cfg, cp = model.cfg, len(pools)
    page_size = pools[0][0].page_size
    n = pages_for(len(prompt_ids), page_size)
    caches, first = prefill_forward(model, prompt_ids)
    cache = caches[0]
    for c in range(cp):
        shard = cp_page_shard(n, cp, c, all_ranks_send=True)
        if len(pages[c]) < len(shard) or len(slots[c]) < n:
            raise ValueError(f"CP rank {c} needs {len(shard)} pages and {n} state slots")
        tokens = range(shard.start * page_size, min(shard.stop * page_size, len(prompt_ids)))
        rows = token_slots([-1] * shard.start + pages[c][: len(shard)], tokens, page_size)
        owned = state_layer_shard(cfg.layers, cp, c, dsa_cache_layer_split=layer_split)
        state_rows = token_slots(slots[c], range(len(prompt_ids)), page_size)
        for pool in pools[c]:
            for layer in range(cfg.layers):
                pool.k_buffers[layer][rows, 0] = cache.latent[layer][tokens.start : tokens.stop]
                if layer in owned:
                    flat = _index_view(pool, layer, cfg.index_dim).view(-1, cfg.index_dim)
                    flat[state_rows] = cache.index[layer]
            _write_aux(pool, aux_slot, first, room)
    return first


def decode_mla(
    model: MLAModel,
    prompt_len: int,
    pools: list[KVPool],
    pages: list[int],
    aux_slot: int,
    max_new_tokens: int,
) -> list[int]:
    """Greedy decode from the decode TP ranks' pools: the first token from the aux row, each TP
    rank's latent from ``pages`` and indexer keys from the state slots of the same numbers (its
    heads attend over its own copy); returns ``max_new_tokens`` tokens, the first included."""
    caches, first = decode_caches(model, prompt_len, pools, pages, aux_slot)
    return greedy_continue(model, caches, first, max_new_tokens)


def decode_caches(
    model: MLAModel, prompt_len: int, pools: list[KVPool], pages: list[int], aux_slot: int
) -> tuple[list[MLACache], int]:
    """The decode TP ranks' caches read from their pools (latent and indexer keys of ``pages``)
    and the first token from the aux row."""
    cfg = model.cfg
    page_size = pools[0].page_size
    if len(pages) < pages_for(prompt_len, page_size):
        raise ValueError(f"{prompt_len} tokens need {pages_for(prompt_len, page_size)} pages, got {len(pages)}")
    firsts = {int(pool.aux["output_ids"][aux_slot, 0]) for pool in pools}
    if len(firsts) != 1:
        raise ValueError(f"decode ranks disagree on the first token: {sorted(firsts)}")
    rows = token_slots(pages, range(prompt_len), page_size)
    caches = []
    for pool in pools:
        cache = MLACache()
        for layer in range(cfg.layers):
            cache.latent.append(pool.k_buffers[layer][rows, 0].clone())
            cache.index.append(_index_view(pool, layer, cfg.index_dim).reshape(-1, cfg.index_dim)[rows].clone())
        caches.append(cache)
    return caches, firsts.pop()
