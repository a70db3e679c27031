"""An MTP-style draft head for the MLA reference model (``mla.py``) and greedy speculative decoding.

The draft (DeepSeek's MTP / NextN, narrowed) is one MLA layer of its own, with random weights from
the seed, over the target's embedding and LM head; it caches its own latent per token in a paged
pool of the target's latent width (SGLang's draft MLATokenToKVPool, on the target's page ids). At
prefill it runs over the prompt beside the target (SGLang's draft extend), so its cache holds a
row per prompt token; decode proposes ``k`` tokens from that cache, the target verifies them in one
forward, the longest agreeing prefix is kept plus the target's own next token, and both caches are
cut back to the kept tokens.

Verification makes the final tokens the target's alone, whatever the draft proposes; the
proposals and the accepted length of every step are the draft cache's doing, so a run records
them (``SpecTrace``) and a PD run must reproduce the colocated run's trace as well as its tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pdfabric_core.policy.rank_mapping import cp_page_shard
from pdfabric_refengine.engine import pages_for, token_slots
from pdfabric_refengine.geometry import PAGE_SIZE
from pdfabric_refengine.kvpool import KVPool
from pdfabric_refengine.mla import MLACache, MLAConfig, MLAModel, _rms, mla_attention
from pdfabric_refengine.mla_engine import decode_caches

DRAFT_SEED_OFFSET = 7919  # the draft's weights come from the model's seed, shifted
SPEC_STEPS = 3  # tokens the draft proposes per step


class MTPDraft:
    """One MLA layer (no indexer) over the target's embedding and LM head; float32 on the CPU."""

    layers = 1

    def __init__(self, target: MLAModel, seed: int = 0) -> None:
        self.target = target
        c = target.cfg
        g = torch.Generator().manual_seed(seed + DRAFT_SEED_OFFSET)

        def w(out: int, inp: int) -> torch.Tensor:
            return torch.randn(out, inp, generator=g) / math.sqrt(inp)

        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.wts = {
            "q_a": w(c.q_lora_rank, c.hidden),
            "q_b": w(c.heads * qk, c.q_lora_rank),
            "kv_a": w(c.latent_width, c.hidden),
            "k_b": w(c.heads * c.qk_nope_head_dim, c.kv_lora_rank),
            "v_b": w(c.heads * c.v_head_dim, c.kv_lora_rank),
            "o": w(c.hidden, c.heads * c.v_head_dim),
            "gate": w(2 * c.hidden, c.hidden),
            "up": w(2 * c.hidden, c.hidden),
            "down": w(c.hidden, 2 * c.hidden),
        }

    @torch.inference_mode()
    def forward(self, tokens: list[int], caches: list[MLACache]) -> torch.Tensor:
        """Logits of the last of ``tokens``, appended to the draft caches (one per TP rank)."""
        start = caches[0].tokens
        positions = torch.arange(start, start + len(tokens))
        x = self.target.embed[torch.tensor(tokens)]
        x = x + mla_attention(self.target.cfg, self.wts, 0, _rms(x), positions, caches, indexer=False)
        h = _rms(x)
        x = x + (torch.nn.functional.silu(h @ self.wts["gate"].T) * (h @ self.wts["up"].T)) @ self.wts["down"].T
        return (_rms(x[-1]) @ self.target.lm_head.T).detach()


@dataclass
class SpecTrace:
    """What the draft did in a speculative run: its proposals and how many the target accepted,
    step by step."""

    proposals: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def _truncate(caches: list[MLACache], n: int) -> None:
    for cache in caches:
        cache.latent = [t[:n] for t in cache.latent]
        cache.index = [t[:n] for t in cache.index]


def speculative_continue(
    model: MLAModel,
    draft: MTPDraft,
    caches: list[MLACache],
    draft_caches: list[MLACache],
    first_token: int,
    max_new_tokens: int,
    k: int = SPEC_STEPS,
) -> tuple[list[int], SpecTrace]:
    """``first_token``, then greedy speculative steps over the target's and the draft's caches
    (both holding the prompt); returns ``max_new_tokens`` tokens and the draft's trace."""
    prompt_len = caches[0].tokens
    if draft_caches[0].tokens != prompt_len:
        raise ValueError(f"the draft caches hold {draft_caches[0].tokens} tokens, the target's {prompt_len}")
    tokens, trace = [first_token], SpecTrace()
    while len(tokens) < max_new_tokens:
        # The draft first catches up with every kept token but the last (not yet in any cache).
        behind = tokens[draft_caches[0].tokens - prompt_len : caches[0].tokens - prompt_len]
        if behind:
            draft.forward(behind, draft_caches)
        proposals, tok = [], tokens[-1]
        for _ in range(k):
            tok = int(draft.forward([tok], draft_caches).argmax())
            proposals.append(tok)
        logits = model.forward_all([tokens[-1], *proposals], caches)  # [k + 1, vocab]
        verified = [int(t) for t in logits.argmax(-1)]
        accepted = next((i for i, (p, v) in enumerate(zip(proposals, verified, strict=False)) if p != v), k)
        trace.proposals.append(proposals)
        trace.accepted.append(accepted)
        kept = caches[0].tokens - k + accepted  # the last token and the accepted proposals stay cached
        _truncate(caches, kept)
        _truncate(draft_caches, min(draft_caches[0].tokens, kept))
        tokens.extend([*proposals[:accepted], verified[accepted]])
    return tokens[:max_new_tokens], trace


def colocated_speculative(
    model: MLAModel, draft: MTPDraft, prompt_ids: list[int], max_new_tokens: int, k: int = SPEC_STEPS
) -> tuple[list[int], SpecTrace]:
    """Speculative greedy generation in one place: the reference a PD hand-off must reproduce,
    tokens and trace."""
    caches = model.new_caches()
    first = int(model.forward(prompt_ids, caches).argmax())
    draft_caches = [MLACache()]
    draft.forward(prompt_ids, draft_caches)
    return speculative_continue(model, draft, caches, draft_caches, first, max_new_tokens, k)


# ---- the draft's paged KV, as an engine holds it ------------------------------------------------


@dataclass
class DraftSide:
    """An engine's draft: the head and one draft pool per rank, shaped as ``Engine.pools``
    (``pools[cp or dp group][tp]``), indexed by the target's page ids."""

    draft: MTPDraft
    pools: list[list[KVPool]]

    def close(self) -> None:
        for row in self.pools:
            for pool in row:
                pool.close()


def draft_pool(cfg: MLAConfig, *, num_pages: int, page_size: int = PAGE_SIZE, **kw: Any) -> KVPool:
    """One rank's draft pool: a latent buffer per draft layer, the target's width and page count."""
    return KVPool(
        layers=MTPDraft.layers, local_heads=1, head_dim=cfg.latent_width, num_pages=num_pages, page_size=page_size,
        mla=True, aux_slots=1, **kw,
    )  # fmt: skip


def with_draft(args: Any, pool: KVPool) -> Any:
    """``args`` (the target pool's KVArgs) with the draft pool's buffers appended, as SGLang's
    schedulers append the draft pool's ``get_contiguous_buf_infos`` (MHA: every K, then every V;
    MLA: the latents)."""
    infos = pool.k_infos + pool.v_infos
    args.kv_data_ptrs = [*args.kv_data_ptrs, *(b.data_ptr for b in infos)]
    args.kv_data_lens = [*args.kv_data_lens, *(b.nbytes for b in infos)]
    args.kv_item_lens = [*args.kv_item_lens, *(pool.page_bytes for _ in infos)]
    args.num_draft_entries = len(infos)
    return args


def prefill_draft(draft: MTPDraft, prompt_ids: list[int], pools: list[list[KVPool]], pages: list[list[int]]) -> None:
    """The draft over the prompt (SGLang's draft extend after the target's prefill); CP rank c
    writes the rows of its page shard at its local pages ``pages[c]`` (the target's), every TP
    rank the same."""
    caches = [MLACache()]
    draft.forward(prompt_ids, caches)
    page_size, cp = pools[0][0].page_size, len(pools)
    n = pages_for(len(prompt_ids), page_size)
    for c in range(cp):
        shard = cp_page_shard(n, cp, c, all_ranks_send=True)
        tokens = range(shard.start * page_size, min(shard.stop * page_size, len(prompt_ids)))
        rows = token_slots([-1] * shard.start + pages[c][: len(shard)], tokens, page_size)
        for pool in pools[c]:
            for layer in range(MTPDraft.layers):
                pool.k_buffers[layer][rows, 0] = caches[0].latent[layer][tokens.start : tokens.stop]


def decode_speculative(
    model: MLAModel,
    draft: MTPDraft,
    prompt_len: int,
    pools: list[KVPool],
    draft_pools: list[KVPool],
    pages: list[int],
    aux_slot: int,
    max_new_tokens: int,
) -> tuple[list[int], SpecTrace]:
    """Speculative greedy decode from the decode TP ranks' pools alone: the target's caches
    (``decode_caches``) and the draft's latent rows of the same pages; tokens and the trace."""
    caches, first = decode_caches(model, prompt_len, pools, pages, aux_slot)
    rows = token_slots(pages, range(prompt_len), pools[0].page_size)
    draft_caches = []
    for pool in draft_pools:
        cache = MLACache()
        for layer in range(MTPDraft.layers):
            cache.latent.append(pool.k_buffers[layer][rows, 0].clone())
            cache.index.append(torch.zeros(prompt_len, model.cfg.index_dim))
        draft_caches.append(cache)
    return speculative_continue(model, draft, caches, draft_caches, first, max_new_tokens)
