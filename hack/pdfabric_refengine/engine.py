"""Prefill into and decode from SGLang-layout pools, for a model sharded by TP over KV heads and,
on prefill, by CP over the request's pages.

One process computes the full model; each TP rank's pool gets that rank's head slice
([r*kv_heads/tp, (r+1)*kv_heads/tp), replicated when there are fewer heads than ranks): the
layout and the values a real TP rank holds (a real one may differ in the last bits, from its
sharded matmuls and all-reduces; a reference needs only that decode reproduces colocated
generation). Decode reads its ranks' pools only, so whatever moved the bytes between the two
(the fabric under test) decides the tokens.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from pdfabric_core.policy.rank_mapping import cp_page_shard, global_heads
from pdfabric_refengine.kvpool import KVPool
from pdfabric_refengine.model import greedy_continue, model_shape, prefill_forward


def pages_for(tokens: int, page_size: int) -> int:
    """Pages a request of `tokens` tokens occupies (the last one partly filled)."""
    return -(-tokens // page_size)


def token_slots(pages: list[int], tokens: range, page_size: int) -> torch.Tensor:
    """Pool row of each token in `tokens` (positions in the request): token t sits at row
    pages[t // page_size] * page_size + t % page_size."""
    return torch.tensor([pages[t // page_size] * page_size + t % page_size for t in tokens], dtype=torch.long)


def _check_tp(pools: list[KVPool], kv_heads: int, page_size: int) -> None:
    for r, pool in enumerate(pools):
        heads = global_heads(r, len(pools), kv_heads)
        if pool.local_heads != len(heads) or pool.page_size != page_size:
            raise ValueError(
                f"TP rank {r} of {len(pools)}: pool has {pool.local_heads} heads and page size {pool.page_size}, "
                f"the model needs {len(heads)} heads (of {kv_heads}) and page size {page_size}"
            )


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cached K and V, [batch, kv_heads, seq, head_dim] (a full-attention layer)."""
    cached = cache.layers[layer]
    if not isinstance(cached, DynamicLayer) or cached.keys is None or cached.values is None:
        raise TypeError(f"layer {layer} of the cache is {type(cached).__name__}, not a filled DynamicLayer")
    return cached.keys, cached.values


def _write_aux(pool: KVPool, aux_slot: int, first_token: int, room: int) -> None:
    pool.aux["output_ids"][aux_slot].zero_()
    pool.aux["output_ids"][aux_slot, 0] = first_token
    pool.aux["cached_tokens"][aux_slot].zero_()  # no prefix cache: nothing of the prompt was cached
    pool.aux["bootstrap_room"][aux_slot].zero_()
    pool.aux["bootstrap_room"][aux_slot, 0] = room


def prefill_cp(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    pools: list[list[KVPool]],
    pages: list[list[int]],
    aux_slot: int,
    *,
    all_ranks_send: bool = True,
    room: int = 0,
) -> int:
    """Prefill with `len(pools)` CP ranks of `len(pools[c])` TP ranks each; returns the first token.

    CP rank c holds the request pages `cp_page_shard(num_pages, cp, c, all_ranks_send=...)`
    (contiguous shards, the first ones taking the remainder): request page shard[j] is written
    at its local page pages[c][j] in each of its TP ranks' pools, and no other page is touched.
    Every rank writes the aux row (output_ids[aux_slot, 0] = first token) at `aux_slot`.

    Without all-ranks transfer CP rank 0 sends every page and the others none; a rank's pool is
    written with the pages it sends only, all a fabric may read from it.
    """
    if not pools or not pools[0]:
        raise ValueError("at least one CP rank with one TP rank is needed")
    shape = model_shape(model, page_size=pools[0][0].page_size)
    num_pages = pages_for(len(prompt_ids), shape.page_size)
    cp = len(pools)
    if len(pages) != cp:
        raise ValueError(f"{cp} CP ranks but {len(pages)} page lists")
    for tp_pools in pools:
        _check_tp(tp_pools, shape.kv_heads, shape.page_size)
    shards = [cp_page_shard(num_pages, cp, c, all_ranks_send=all_ranks_send) for c in range(cp)]
    for c, shard in enumerate(shards):
        if len(pages[c]) < len(shard):
            raise ValueError(f"CP rank {c} holds {len(shard)} request pages but was given {len(pages[c])}")

    cache, first = prefill_forward(model, prompt_ids)
    for c, shard in enumerate(shards):
        tokens = range(shard.start * shape.page_size, min(shard.stop * shape.page_size, len(prompt_ids)))
        # Indexed by request page: request page shard.start + j lives at local page pages[c][j].
        by_request = [-1] * shard.start + pages[c][: len(shard)]
        rows = token_slots(by_request, tokens, shape.page_size)
        tp = len(pools[c])
        for r, pool in enumerate(pools[c]):
            heads = global_heads(r, tp, shape.kv_heads)
            for layer in range(shape.layers):
                keys, values = _layer_kv(cache, layer)
                # cache [batch, heads, seq, dim] -> pool rows [token, head, dim]
                k = keys[0, heads.start : heads.stop, tokens.start : tokens.stop].transpose(0, 1)
                v = values[0, heads.start : heads.stop, tokens.start : tokens.stop].transpose(0, 1)
                pool.k_buffers[layer][rows.to(pool.device)] = k.to(pool.device, pool.dtype)
                pool.v_buffers[layer][rows.to(pool.device)] = v.to(pool.device, pool.dtype)
            _write_aux(pool, aux_slot, first, room)
    return first


def prefill(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    pools: list[KVPool],
    pages: list[int],
    aux_slot: int,
    *,
    room: int = 0,
) -> int:
    """Prefill on one TP group (no CP): token t of the prompt goes to page pages[t // page_size],
    slot t % page_size, on every TP rank's pool (same page indices on each); returns the first
    generated token, also written to each pool's output_ids row at `aux_slot`."""
    return prefill_cp(model, prompt_ids, [pools], [pages], aux_slot, room=room)


def gather_kv(
    pools: list[KVPool], pages: list[int], prompt_len: int, kv_heads: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V of the prompt's tokens from the TP ranks' pools, as [1, kv_heads,
    prompt_len, head_dim] (the model's cache layout), head slices concatenated in head order.

    With replicated heads (more ranks than heads) each head is read from the first rank holding it.
    """
    tp = len(pools)
    owners: list[tuple[int, int]] = []  # (rank, local head) for each global head
    for head in range(kv_heads):
        rank = next(r for r in range(tp) if head in global_heads(r, tp, kv_heads))
        owners.append((rank, head - global_heads(rank, tp, kv_heads).start))
    rows = token_slots(pages, range(prompt_len), pools[0].page_size)

    def heads_in_order(buffers: list[torch.Tensor]) -> torch.Tensor:
        per_rank = [buf[rows.to(buf.device)].to("cpu") for buf in buffers]  # [token, local head, dim]
        heads = torch.stack([per_rank[r][:, h] for r, h in owners], dim=1)
        return heads.transpose(0, 1).unsqueeze(0).contiguous()

    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(pools[0].layers):
        k = heads_in_order([pool.k_buffers[layer] for pool in pools])
        v = heads_in_order([pool.v_buffers[layer] for pool in pools])
        out.append((k, v))
    return out


def decode(
    model: LlamaForCausalLM,
    prompt_len: int,
    pools: list[KVPool],
    pages: list[int],
    aux_slot: int,
    max_new_tokens: int,
) -> list[int]:
    """Greedy decode from the decode TP ranks' pools: the first token from aux, the prompt's KV
    from `pages` (same indices on every rank); returns `max_new_tokens` tokens, the first one
    included, so a faithful hand-off equals `colocated_generate`."""
    if not pools:
        raise ValueError("at least one decode TP rank's pool is needed")
    shape = model_shape(model, page_size=pools[0].page_size)
    _check_tp(pools, shape.kv_heads, shape.page_size)
    if len(pages) < pages_for(prompt_len, shape.page_size):
        raise ValueError(f"{prompt_len} tokens need {pages_for(prompt_len, shape.page_size)} pages, got {len(pages)}")
    firsts = {int(pool.aux["output_ids"][aux_slot, 0]) for pool in pools}
    if len(firsts) != 1:
        # Every decode rank got the aux row from its own source; they must agree.
        raise ValueError(f"decode ranks disagree on the first token: {sorted(firsts)}")
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(gather_kv(pools, pages, prompt_len, shape.kv_heads)):
        cache.update(k.to(model.device, model.dtype), v.to(model.device, model.dtype), layer)
    return greedy_continue(model, cache, firsts.pop(), max_new_tokens)
