"""DeepSeek-V4's PD transfer geometry as SGLang registers it, and the PDCluster spec that describes
it for pdfabric (the second seed's CP8 -> TP8 figure; issue 25).

What one request moves, per (prefill rank -> decode rank) pair, read from SGLang's own pool
classes (``sglang.srt.mem_cache.deepseek_v4_memory_pool``, built here on CPU at a few pages):
- KV, page-indexed by the request's full 256-token pages (``get_contiguous_buf_infos``): per layer
  of ratio 4 one compressed MLA page (64 rows) and one indexer page; per layer of ratio 128 one
  compressed page (2 rows). Each CP rank sends the pages of its shard.
- State component ``swa`` (``get_state_buf_infos``), indexed by the window's SWA pages (SGLang's
  prefill ``_swa_payload``: from ``max(0, L - window)`` rounded down to a page, to the end): per
  layer one SWA page, per ratio-4 layer its compress-state ring and its indexer compress-state
  ring (page-scoped, they travel with the SWA pages).
- State component ``c128_state`` (``get_request_state_buf_infos``), one index a request: per
  ratio-128 layer its raw-token ring (offline C128, SGLang's default).
MLA is whole on every rank, so each of the decode TP ranks receives all of it; CP-replicated state
goes once with dedup (CP rank 0) and cp times without.

pdfabric's spec describes one KV kind of uniform layers and one state component; the spec below
is V4's as closely as that allows (``describe`` says what differs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

PAGE = 256  # SGLang's DeepSeek-V4 page size (its model override; NVIDIA and AMD)
# Assumed layer pattern: DeepSeekV4Config's defaults leave compress_ratios empty and V4-Pro's own
# config.json cannot be read here. Two pure-SWA layers, then ratio 4 and 128 alternating.
DEFAULT_LAYERS = 43  # DeepSeekV4Config.num_hidden_layers


def default_ratios(layers: int = DEFAULT_LAYERS) -> list[int]:
    return [0, 0] + [4 if i % 2 == 0 else 128 for i in range(layers - 2)]


@dataclass(frozen=True)
class V4Geometry:
    """Item bytes of each buffer SGLang registers for DeepSeek-V4, one rank (MLA: every rank)."""

    ratios: tuple[int, ...]
    window: int
    c4_kv: int  # one full page's compressed KV of one ratio-4 layer
    c4_indexer: int  # ... its indexer keys with scales
    c128_kv: int  # one full page's compressed KV of one ratio-128 layer
    swa_page: int  # one SWA page of one layer
    c4_state: int  # one SWA page's compress-state ring of one ratio-4 layer
    c4_indexer_state: int  # ... its indexer compress-state ring
    c128_state: int  # one request's raw-token ring of one ratio-128 layer
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def n4(self) -> int:
        return self.ratios.count(4)

    @property
    def n128(self) -> int:
        return self.ratios.count(128)

    @property
    def kv_page(self) -> int:
        """KV bytes of one full page, every layer (what one page index moves)."""
        return self.n4 * (self.c4_kv + self.c4_indexer) + self.n128 * self.c128_kv

    @property
    def swa_index(self) -> int:
        """Bytes of one index of the ``swa`` state component, every buffer."""
        return len(self.ratios) * self.swa_page + self.n4 * (self.c4_state + self.c4_indexer_state)

    @property
    def request_state(self) -> int:
        """Bytes of the ``c128_state`` component's one index."""
        return self.n128 * self.c128_state

    def window_pages(self, tokens: int) -> int:
        """SWA pages SGLang's prefill sends for a prompt of ``tokens`` (no cached prefix)."""
        start = max(0, tokens - self.window) // PAGE * PAGE
        return math.ceil(tokens / PAGE) - start // PAGE

    def state_bytes(self, tokens: int) -> int:
        return self.window_pages(tokens) * self.swa_index + self.request_state

    def kv_bytes(self, tokens: int) -> int:
        return math.ceil(tokens / PAGE) * self.kv_page


def from_sglang(ratios: list[int] | None = None) -> V4Geometry:
    """Item bytes read off SGLang's own V4 pools, built on CPU with SGLang's defaults (the V4
    FlashMLA layout: fp8 nope, bf16 rope, scales; fp8 indexer; fp32 compress state; offline C128)."""
    import torch
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config
    from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
        DeepSeekV4IndexerPool,
        DeepSeekV4SingleKVPool,
        get_compress_state_ring_size,
    )

    # The config class's own defaults (its constructor wants a checkpoint's fields).
    cfg = {f.name: f.default for f in dataclasses.fields(DeepSeekV4Config)}
    ratios = ratios if ratios is not None else default_ratios(cfg["num_hidden_layers"])
    nope, rope, index_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]

    def kv_item(ratio: int) -> int:
        pool = DeepSeekV4SingleKVPool(
            4 * PAGE // ratio, PAGE // ratio, torch.float8_e4m3fn, nope, rope, 1, "cpu", False, global_page_size=PAGE
        )
        return int(pool.kv_buffer[0][0].nbytes)

    def state_item(ratio: int, head_dim: int) -> int:
        ring = get_compress_state_ring_size(ratio)
        pool = CompressStatePool(
            size=2 * ring, ring_size=ring, overlap=ratio == 4, head_dim=head_dim, dtype=torch.float32,
            device="cpu", enable_memory_saver=False, ratio=ratio, request_scoped=ratio == 128, swa_page_size=PAGE,
        )  # fmt: skip
        row = int(pool.kv_score_buffer.kv_score[0].nbytes)
        # The SWA component's item is the whole ring; the request state's a raw-token ring of 128 rows.
        return row * (ring if ratio == 4 else 128)

    indexer = DeepSeekV4IndexerPool(
        4 * PAGE // 4, PAGE // 4, torch.float8_e4m3fn, index_dim, 1, "cpu", False,
        use_fp4_indexer=False, global_page_size=PAGE,
    )  # fmt: skip
    return V4Geometry(
        ratios=tuple(ratios),
        window=cfg["window_size"],
        c4_kv=kv_item(4),
        c4_indexer=int(indexer.contiguous_page_row_buffers()[0][0].nbytes),
        c128_kv=kv_item(128),
        swa_page=kv_item(1),
        c4_state=state_item(4, nope + rope),
        c4_indexer_state=state_item(4, index_dim),
        c128_state=state_item(128, nope + rope),
        source={
            "layers": cfg["num_hidden_layers"],
            "hidden_size": cfg["hidden_size"],
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "index_head_dim": index_dim,
            "window_size": cfg["window_size"],
        },
    )


def sglang_reduction(geo: V4Geometry, tokens: int, *, cp: int = 8) -> float:
    """The dedup's reduction of transfer bytes under SGLang's rule, from the bytes above: every CP
    rank sends its KV shard; state once instead of ``cp`` times; every decode rank receives the
    same, so decode TP cancels (aux rows left out, as SGLang's kv_transfer_total_mb)."""
    kv, state = geo.kv_bytes(tokens), geo.state_bytes(tokens)
    return (cp - 1) * state / (kv + cp * state)


# SGLang 0.5.23's metadata rows with V4's hidden size (4096 bf16 hidden states).
V4_AUX_ROWS = [64, 64, 64, 64, 512, 512, 64, 128, 8192, 64]


def pdcluster_spec(geo: V4Geometry, tokens: int, *, cp: int = 8, decode_tp: int = 8) -> dict[str, Any]:
    """A PDCluster spec (camelCase, as users write it) of V4 for a prompt of ``tokens``: KV as one
    MLA layer per 256-token page whose fp8 latent width gives the page's bytes (rounded to whole
    bytes a token), state as replicated slot tensors, one a registered state buffer, their items
    the bytes each moves for this prompt (the window's SWA pages, the request's C128 ring)."""
    width = round(geo.kv_page / PAGE)
    wp = geo.window_pages(tokens)
    tensors = (
        [wp * geo.swa_page] * len(geo.ratios)
        + [wp * geo.c4_state] * geo.n4
        + [wp * geo.c4_indexer_state] * geo.n4
        + [geo.c128_state] * geo.n128
    )
    return {
        "prefill": {"tp": 1, "cp": cp, "allCpRanksTransfer": True},
        "decode": {"tp": decode_tp},
        "transfer": {"transport": "tcp", "timeoutSeconds": 60},
        "placement": {"fallback": "TCP"},
        "model": {
            "kvKind": "MLA",
            "layers": 1,
            "kvLoraRank": width - 64,
            "qkRopeHeadDim": 64,
            "dtype": "float8_e4m3fn",
            "pageSizeTokens": PAGE,
            "stateKind": "slot",
            "stateTensorBytes": tensors,
            "auxRowBytes": V4_AUX_ROWS,
            "expectedPromptTokens": tokens,
        },
    }


def describe(geo: V4Geometry) -> list[str]:
    """What the spec describes differently from SGLang's registration, with the bytes."""
    width = round(geo.kv_page / PAGE)
    return [
        f"KV: SGLang registers {geo.n4} x (compressed c4 page {geo.c4_kv} + indexer page {geo.c4_indexer}) "
        f"+ {geo.n128} x c128 page {geo.c128_kv} = {geo.kv_page} bytes a 256-token page over "
        f"{2 * geo.n4 + geo.n128} buffers of three sizes; the spec has one MLA layer of fp8 latent width "
        f"{width} = {width * PAGE} bytes a page ({width * PAGE - geo.kv_page:+d} bytes a page): pdfabric's KV "
        "is uniform layers of page_tokens x width bytes",
        f"State: SGLang registers two components, 'swa' ({len(geo.ratios)} SWA pages of {geo.swa_page}, "
        f"{geo.n4} c4 state rings of {geo.c4_state}, {geo.n4} indexer rings of {geo.c4_indexer_state}; "
        f"indexed by the 1-2 window pages) and 'c128_state' ({geo.n128} rings of {geo.c128_state}, one "
        "index a request); the spec has one slot component whose items carry the same bytes (the window's "
        "pages folded into each SWA tensor's item), so it is rebuilt per prompt length: pdfabric moves one "
        "state component a rank",
    ]
