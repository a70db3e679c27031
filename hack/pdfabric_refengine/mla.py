"""A tiny DeepSeek-style model with multi-head latent attention (MLA) and a DSA-style indexer, with
deterministic random weights from a seed (nothing is downloaded), written for the reference engine.

Per layer and token the model caches what SGLang's MLATokenToKVPool holds, one row of
``kv_lora_rank + qk_rope_head_dim`` elements: the normalised compressed latent ``c`` and the
decoupled rope key ``k_pe`` (rotated). Attention is computed from that row alone: per head the
no-rope key and the value are up-projections of ``c``, the rope part of the score is
``q_pe . k_pe``. Beside it each layer caches a small indexer key per token (DeepSeek-V3.2's
lightning indexer, narrowed): a query's indexer score against every past token is added to its
attention logits and only the ``index_topk`` best-scored past tokens are attended to, so every
indexer byte the decode side was handed decides its tokens as much as the latent does.

Attention TP is modelled as SGLang runs it: each TP rank holds the whole latent and indexer cache
and computes its slice of the heads from its own copy (``MLACache`` per rank), so a decode rank
whose copy differs changes the tokens. Colocated generation and PD decode run the same two steps
(one prefill forward over the prompt, then one-token forwards), so tokens differ only when the
cached bytes do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MLAConfig:
    layers: int = 2
    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    index_dim: int = 8  # the indexer key per token and layer (DSA's index_head_dim, narrowed)
    index_topk: int = 12  # past tokens each query may attend to, by indexer score
    rope_theta: float = 10000.0

    @property
    def latent_width(self) -> int:
        """Elements of one token's cache row (SGLang's MLA kv_cache_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MLACache:
    """One attention-TP rank's cache: per layer the latent rows [tokens, latent_width] and the
    indexer keys [tokens, index_dim], in token order."""

    latent: list[torch.Tensor] = field(default_factory=list)
    index: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.latent[0].shape[0]) if self.latent else 0


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding over the last dimension (halves rotated), ``x`` [tokens, ..., dim]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv[None, :]  # [tokens, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MLAModel:
    """The weights and the forward pass; float32 on the CPU."""

    def __init__(self, cfg: MLAConfig, seed: int = 0) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
            return torch.randn(out, inp, generator=g) * (gain / math.sqrt(inp))

        c = cfg
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.embed = torch.randn(c.vocab, c.hidden, generator=g)
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                "q_a": w(c.q_lora_rank, c.hidden),
                "q_b": w(c.heads * qk, c.q_lora_rank),
                "kv_a": w(c.latent_width, c.hidden),
                "k_b": w(c.heads * c.qk_nope_head_dim, c.kv_lora_rank),  # latent -> per-head no-rope key
                "v_b": w(c.heads * c.v_head_dim, c.kv_lora_rank),  # latent -> per-head value
                "o": w(c.hidden, c.heads * c.v_head_dim),
                "idx_q": w(c.index_dim, c.hidden, 2.0),
                "idx_k": w(c.index_dim, c.hidden, 2.0),
                "gate": w(2 * c.hidden, c.hidden),
                "up": w(2 * c.hidden, c.hidden),
                "down": w(c.hidden, 2 * c.hidden),
            }
            for _ in range(c.layers)
        ]
        self.lm_head = w(c.vocab, c.hidden, 4.0)

    def new_caches(self, tp: int = 1) -> list[MLACache]:
        return [MLACache() for _ in range(tp)]

    def _attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, caches: list[MLACache]) -> torch.Tensor:
        return mla_attention(self.cfg, self.layers[layer], layer, h, positions, caches)

    @torch.inference_mode()
    def forward(self, tokens: list[int], caches: list[MLACache]) -> torch.Tensor:
        """Logits of the last token of ``tokens``, which follow the caches' tokens (appended)."""
        return (_rms(self._hidden(tokens, caches)[-1]) @ self.lm_head.T).detach()

    @torch.inference_mode()
    def forward_all(self, tokens: list[int], caches: list[MLACache]) -> torch.Tensor:
        """Logits of every token of ``tokens`` [tokens, vocab] (a speculative step's verification)."""
        return (_rms(self._hidden(tokens, caches)) @ self.lm_head.T).detach()

    def _hidden(self, tokens: list[int], caches: list[MLACache]) -> torch.Tensor:
        if not tokens:
            raise ValueError("at least one token is needed")
        if self.cfg.heads % len(caches):
            raise ValueError(f"{self.cfg.heads} heads do not split over {len(caches)} TP ranks")
        start = caches[0].tokens
        if any(cache.tokens != start for cache in caches):
            raise ValueError(f"the TP ranks' caches hold different lengths: {[x.tokens for x in caches]}")
        positions = torch.arange(start, start + len(tokens))
        x = self.embed[torch.tensor(tokens)]
        for layer, wts in enumerate(self.layers):
            x = x + self._attention(layer, _rms(x), positions, caches)
            h = _rms(x)
            x = x + (torch.nn.functional.silu(h @ wts["gate"].T) * (h @ wts["up"].T)) @ wts["down"].T
        return x


def mla_attention(
    c: MLAConfig,
    wts: dict[str, torch.Tensor],
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    caches: list[MLACache],
    *,
    indexer: bool = True,
) -> torch.Tensor:
    """One MLA attention layer (weights ``wts``) over layer ``layer`` of each TP rank's cache, the
    new rows appended; ``indexer``: the DSA-style indexer picks and biases the attended tokens
    (else plain causal attention, the MTP draft's layer: its index keys are zeros, never read)."""
    t = h.shape[0]
    q = (_rms(h @ wts["q_a"].T) @ wts["q_b"].T).view(t, c.heads, -1)
    q_nope, q_pe = q[..., : c.qk_nope_head_dim], _rope(q[..., c.qk_nope_head_dim :], positions, c.rope_theta)
    kv = h @ wts["kv_a"].T
    row = torch.cat([_rms(kv[:, : c.kv_lora_rank]), _rope(kv[:, c.kv_lora_rank :], positions, c.rope_theta)], -1)
    index_key = h @ wts["idx_k"].T if indexer else torch.zeros(t, c.index_dim)
    tp = len(caches)
    per_rank = c.heads // tp
    outs = []
    for r, cache in enumerate(caches):
        # Every rank appends the same new rows; what it attends over is its own copy.
        if len(cache.latent) == layer:
            cache.latent.append(row)
            cache.index.append(index_key)
        else:
            cache.latent[layer] = torch.cat([cache.latent[layer], row])
            cache.index[layer] = torch.cat([cache.index[layer], index_key])
        lat, idx = cache.latent[layer], cache.index[layer]
        n = lat.shape[0]
        heads = slice(r * per_rank, (r + 1) * per_rank)
        latent, k_pe = lat[:, : c.kv_lora_rank], lat[:, c.kv_lora_rank :]
        k_nope = (latent @ wts["k_b"].T).view(n, c.heads, -1)[:, heads]  # [n, h, nope]
        v = (latent @ wts["v_b"].T).view(n, c.heads, -1)[:, heads]  # [n, h, v]
        scores = torch.einsum("thd,nhd->htn", q_nope[:, heads], k_nope)
        scores = scores + torch.einsum("thd,nd->htn", q_pe[:, heads], k_pe)
        scores = scores / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        causal = torch.arange(n)[None, :] > positions[:, None]
        if indexer:
            # The indexer: a score per (query, past token), causal, the top-k kept and added.
            index_scores = (h @ wts["idx_q"].T @ idx.T) / math.sqrt(c.index_dim)  # [t, n]
            index_scores = index_scores.masked_fill(causal, float("-inf"))
            k = min(c.index_topk, n)
            kth = index_scores.topk(k, dim=-1).values[:, -1:]
            keep = (index_scores >= kth) & ~causal
            bias = torch.where(keep, index_scores, torch.full_like(index_scores, float("-inf")))
        else:
            bias = torch.zeros(t, n).masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores + bias[None], dim=-1)
        outs.append(torch.einsum("htn,nhd->thd", probs, v))
    return torch.cat(outs, dim=1).reshape(t, -1) @ wts["o"].T


def prefill_forward(model: MLAModel, prompt_ids: list[int], tp: int = 1) -> tuple[list[MLACache], int]:
    """One forward over the prompt: the filled caches (one per TP rank, equal) and the first token."""
    caches = model.new_caches(tp)
    return caches, int(model.forward(prompt_ids, caches).argmax())


def greedy_continue(model: MLAModel, caches: list[MLACache], first_token: int, max_new_tokens: int) -> list[int]:
    """`first_token`, then greedy one-token forwards over `caches` (up to `max_new_tokens` tokens)."""
    tokens: list[int] = []
    token = first_token
    while len(tokens) < max_new_tokens:
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            break
        token = int(model.forward([token], caches).argmax())
    return tokens


def colocated_generate(model: MLAModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation in one place: the reference a PD hand-off must reproduce."""
    caches, first = prefill_forward(model, prompt_ids)
    return greedy_continue(model, caches, first, max_new_tokens)
