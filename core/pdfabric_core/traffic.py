"""Expected bytes per request, with and without CP-replicated state dedup (sglang #36025).

The status of a PDCluster publishes what one request of `model.expectedPromptTokens` tokens puts
on the wire from a prefill replica to the decode replica it feeds, so an operator can compare the
agents' measured bytes with the prediction and see what the dedup saves.

Model of one request (every rule comes from the policy modules, nothing is re-derived here):
- KV: the prompt's pages, K and V, for every layer. Each (prefill TP rank -> decode TP rank)
  route from `kv_routes` carries its heads; prefill CP ranks that send (`sending_cp_ranks`) each
  send their page shard (`cp_page_shard`); PP stage s holds its share of the layers
  (`pp_layer_range`) and feeds the decode stage `decode_pp_stage` names.
- State: `model.stateBytesPerRequest` is one prefill rank's full state for one request across
  `model.stateLayers`. Every route carries the state layers its sending CP rank owns
  (`state_layer_shard`) within its PP stage (`pp_layer_range`); with dedup,
  `should_skip_state_transfer` drops the copies CP ranks other than 0 would send again.
- Aux: one metadata row (`model.auxRowBytes` summed) per route and sending CP rank from the last
  PP stage (`sends_request_rows`), which produces the output ids; dedup does not touch it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pdfabric_core.policy.cp_dedup import should_skip_state_transfer
from pdfabric_core.policy.rank_mapping import (
    cp_page_shard,
    decode_pp_stage,
    kv_routes,
    pp_layer_range,
    sending_cp_ranks,
    sends_request_rows,
    state_layer_shard,
)
from pdfabric_core.spec import PDClusterSpec


@dataclass(frozen=True)
class TrafficEstimate:
    prompt_tokens: int
    pages: int
    kv_bytes: int
    state_bytes: int  # with CP-state dedup
    state_bytes_without_dedup: int
    aux_bytes: int
    # Busiest single rank on each side, with and without dedup: the link that bounds latency.
    max_prefill_rank_bytes: int
    max_prefill_rank_bytes_without_dedup: int
    max_decode_rank_bytes: int
    max_decode_rank_bytes_without_dedup: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.aux_bytes

    @property
    def total_bytes_without_dedup(self) -> int:
        return self.kv_bytes + self.state_bytes_without_dedup + self.aux_bytes

    @property
    def saved_bytes(self) -> int:
        return self.total_bytes_without_dedup - self.total_bytes

    def to_status(self) -> dict[str, Any]:
        """camelCase form for PDCluster status.expectedBytesPerRequest (integers, bytes)."""
        saved_pct = 100 * self.saved_bytes / self.total_bytes_without_dedup if self.total_bytes_without_dedup else 0.0
        return {
            "promptTokens": self.prompt_tokens,
            "kv": self.kv_bytes,
            "state": self.state_bytes,
            "aux": self.aux_bytes,
            "total": self.total_bytes,
            "stateWithoutDedup": self.state_bytes_without_dedup,
            "totalWithoutDedup": self.total_bytes_without_dedup,
            "savedByDedup": self.saved_bytes,
            # A string: status schemas keep integers exact and this is for people.
            "savedPercent": f"{saved_pct:.2f}",
            "prefill": {
                "maxPerRank": self.max_prefill_rank_bytes,
                "maxPerRankWithoutDedup": self.max_prefill_rank_bytes_without_dedup,
            },
            "decode": {
                "maxPerRank": self.max_decode_rank_bytes,
                "maxPerRankWithoutDedup": self.max_decode_rank_bytes_without_dedup,
            },
        }


def _overlap(a: range, b: range) -> int:
    return max(0, min(a.stop, b.stop) - max(a.start, b.start))


def estimate_traffic(spec: PDClusterSpec, prompt_tokens: int | None = None) -> TrafficEstimate:
    """Bytes one request moves from one prefill replica to one decode replica (see module doc)."""
    m, p, d = spec.model, spec.prefill, spec.decode
    tokens = m.expected_prompt_tokens if prompt_tokens is None else prompt_tokens
    if tokens < 0:
        raise ValueError(f"prompt tokens must not be negative, got {tokens}")
    pages = math.ceil(tokens / m.page_size_tokens)
    routes = kv_routes(p.tp, d.tp, m.kv_heads)
    senders = sending_cp_ranks(
        p.cp, all_cp_ranks_transfer=p.all_cp_ranks_transfer, dsa_cache_layer_split=p.dsa_cache_layer_split
    )
    all_send = p.all_cp_ranks_send
    head_page_bytes = 2 * m.page_size_tokens * m.head_dim * m.dtype_bytes  # K and V of one head, layer, page
    state_per_layer = Fraction(m.state_bytes_per_request, m.state_layers)
    aux_row = sum(m.aux_row_bytes)

    kv_total = aux_total = 0
    state_total = state_total_nodedup = Fraction(0)
    sent: dict[tuple[int, int, int], list[Fraction]] = defaultdict(lambda: [Fraction(0), Fraction(0)])
    received: dict[tuple[int, int], list[Fraction]] = defaultdict(lambda: [Fraction(0), Fraction(0)])
    for stage in range(p.pp):
        layers = len(pp_layer_range(m.layers, p.pp, stage))
        stage_state = pp_layer_range(m.state_layers, p.pp, stage)
        dst_stage = decode_pp_stage(stage, p.pp, d.pp)
        for cp_rank in senders:
            cp_pages = len(cp_page_shard(pages, p.cp, cp_rank, all_ranks_send=all_send))
            owned = state_layer_shard(m.state_layers, p.cp, cp_rank, dsa_cache_layer_split=p.dsa_cache_layer_split)
            state_full = state_per_layer * _overlap(owned, stage_state)
            skip = should_skip_state_transfer(p.cp, cp_rank, dsa_cache_layer_split=p.dsa_cache_layer_split)
            state = Fraction(0) if skip else state_full
            aux = aux_row if sends_request_rows(stage, p.pp) else 0
            for route in routes:
                kv = cp_pages * layers * route.num_heads * head_page_bytes
                kv_total += kv
                aux_total += aux
                state_total += state
                state_total_nodedup += state_full
                src = sent[(route.prefill_tp_rank, cp_rank, stage)]
                dst = received[(route.decode_tp_rank, dst_stage)]
                for acc in (src, dst):
                    acc[0] += kv + aux + state
                    acc[1] += kv + aux + state_full

    def _max(acc: dict[Any, list[Fraction]], i: int) -> int:
        return round(max((v[i] for v in acc.values()), default=Fraction(0)))

    return TrafficEstimate(
        prompt_tokens=tokens,
        pages=pages,
        kv_bytes=kv_total,
        state_bytes=round(state_total),
        state_bytes_without_dedup=round(state_total_nodedup),
        aux_bytes=aux_total,
        max_prefill_rank_bytes=_max(sent, 0),
        max_prefill_rank_bytes_without_dedup=_max(sent, 1),
        max_decode_rank_bytes=_max(received, 0),
        max_decode_rank_bytes_without_dedup=_max(received, 1),
    )
