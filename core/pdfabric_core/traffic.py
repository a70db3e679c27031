"""Expected bytes per request, with and without CP-replicated state dedup (sglang #36025).

The status of a PDCluster publishes what one request of `model.expectedPromptTokens` tokens puts
on the wire from a prefill replica to the decode replica it feeds, so an operator can compare the
agents' measured bytes with the prediction and see what the dedup saves.

The prediction sums the very duties the agents plan their blocks from (`duties.replica_duties`:
each prefill rank's `sender_duties` for each of its decode targets), so it cannot drift from them;
nothing is re-derived here but the byte size of each duty (tests/unit/test_traffic_sweep.py proves
it equal to what `pdfabric_agent.memory.plan.plan_transfer` plans, over every layout). Per (prefill rank
-> decode rank) pair:
- KV: the pages of its CP shard, each KV buffer (K and V, or the MLA latent), for every layer of
  its PP stage, the route's heads (a whole page, or its head slice under a TP mismatch); the last
  PP stage adds the draft's layers (`model.draftLayers`) by the same rule, counted in kv and
  shown apart as draftKv.
  Under MLA KV cache sharding (``prefill.kvCacheSharding``) a pair moves the request's pages its
  prefill rank owns, which depends on the page ids the allocator gave the request: the prediction
  takes a cyclic draw from owner 0 (``Duties.predicted_pages``); every decode rank receives all
  the request's pages whatever the draw, so its total and the replica's are exact.
- State: each state tensor's item (`model.stateTensorBytes`, or `model.stateBytesPerRequest` over
  `model.stateLayers` equal tensors) per state index (``state_indices``: a slot or row per request;
  DSA's indexer, page state beside MLA, one per KV page; an SWA window's pages are not in the spec:
  one). The pair carries the slices its duties name (policy/state_slices.py, per state
  kind), from the last PP stage, of the tensors its CP rank owns; with dedup the copies
  CP ranks other than 0 would send again are skipped (counted as "without dedup" here, and by the
  agents' `pdfabric_state_dedup_skipped_bytes_total`).
- Aux: one metadata row (`model.auxRowBytes` summed) per decode rank, from its primary source at
  CP rank 0 on the last PP stage; dedup does not touch it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pdfabric_core.duties import PairDuties, replica_duties
from pdfabric_core.policy.rank_mapping import pp_layer_range
from pdfabric_core.policy.types import KvKind, StateKind
from pdfabric_core.spec import PDClusterSpec

__all__ = ["PairBytes", "TrafficEstimate", "duty_bytes", "estimate_traffic", "pair_traffic", "state_indices"]

PrefillRankKey = tuple[int, int, int]  # (tp rank, cp rank, pp stage)
DecodeRankKey = tuple[int, int]  # (tp rank, pp stage)


@dataclass(frozen=True)
class PairBytes:
    """Bytes one (prefill rank -> decode rank) pair moves for one request, by kind."""

    kv: int  # the draft's KV included
    state: int  # with CP-state dedup
    state_skipped: int  # what the dedup rule saved this pair
    aux: int
    draft_kv: int = 0  # of kv, the draft model's layers

    @property
    def total(self) -> int:
        return self.kv + self.state + self.aux

    @property
    def total_without_dedup(self) -> int:
        return self.total + self.state_skipped


@dataclass(frozen=True)
class TrafficEstimate:
    prompt_tokens: int
    pages: int
    kv_bytes: int  # the draft's KV included
    state_bytes: int  # with CP-state dedup
    state_bytes_without_dedup: int
    aux_bytes: int
    # Busiest single rank on each side, with and without dedup: the link that bounds latency.
    max_prefill_rank_bytes: int
    max_prefill_rank_bytes_without_dedup: int
    max_decode_rank_bytes: int
    max_decode_rank_bytes_without_dedup: int
    draft_kv_bytes: int = 0  # of kv_bytes, the draft model's layers (model.draftLayers)

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
            "draftKv": self.draft_kv_bytes,
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


def duty_bytes(spec: PDClusterSpec, pair: PairDuties, *, state_slots: int = 1) -> PairBytes:
    """Bytes of one pair's duties: what ``plan_transfer`` plans for them (same page count, the
    stage's layers, the route's heads, the named state layers, the aux row if it sends it)."""
    m, p = spec.model, spec.prefill
    duties = pair.duties
    layers = len(pp_layer_range(m.layers, p.pp, pair.pp_stage))
    per_layer = duties.predicted_pages * m.kv_buffers * duties.route.num_heads * m.head_page_bytes
    return PairBytes(
        kv=(layers + duties.draft_layers) * per_layer,
        draft_kv=duties.draft_layers * per_layer,
        state=state_slots * duties.state_bytes,
        state_skipped=state_slots * duties.skipped_state_bytes,
        aux=sum(m.aux_row_bytes) if duties.send_aux else 0,
    )


def pair_traffic(
    spec: PDClusterSpec, pages: int, *, state_slots: int = 1
) -> dict[tuple[PrefillRankKey, DecodeRankKey], PairBytes]:
    """Bytes per (prefill rank, decode rank) pair of one replica pair for a request of ``pages``
    pages; pairs without duties (CP ranks that do not send) are absent."""
    if pages < 0:
        raise ValueError(f"pages must not be negative, got {pages}")
    return {
        ((d.prefill_tp_rank, d.cp_rank, d.pp_stage), (d.decode_tp_rank, d.decode_stage)): duty_bytes(
            spec, d, state_slots=state_slots
        )
        for d in replica_duties(spec, pages)
    }


def state_indices(spec: PDClusterSpec, pages: int) -> int:
    """State indices one request of ``pages`` KV pages moves: page state beside MLA is DSA's indexer,
    indexed by every KV page of the request (SGLang's ``_dsa_pages_payload``); one otherwise (a slot,
    a row, or an SWA window page: the window is not in the spec)."""
    m = spec.model
    return pages if m.state_kind is StateKind.PAGE and m.kv_kind is KvKind.MLA else 1


def estimate_traffic(spec: PDClusterSpec, prompt_tokens: int | None = None) -> TrafficEstimate:
    """Bytes one request moves from one prefill replica to one decode replica (see module doc)."""
    m = spec.model
    tokens = m.expected_prompt_tokens if prompt_tokens is None else prompt_tokens
    if tokens < 0:
        raise ValueError(f"prompt tokens must not be negative, got {tokens}")
    pages = math.ceil(tokens / m.page_size_tokens)
    pairs = pair_traffic(spec, pages, state_slots=state_indices(spec, pages))
    sent: dict[PrefillRankKey, list[int]] = defaultdict(lambda: [0, 0])
    received: dict[DecodeRankKey, list[int]] = defaultdict(lambda: [0, 0])
    for (src, dst), b in pairs.items():
        for acc in (sent[src], received[dst]):
            acc[0] += b.total
            acc[1] += b.total_without_dedup

    def _max(acc: dict[Any, list[int]], i: int) -> int:
        return max((v[i] for v in acc.values()), default=0)

    state = sum(b.state for b in pairs.values())
    return TrafficEstimate(
        prompt_tokens=tokens,
        pages=pages,
        kv_bytes=sum(b.kv for b in pairs.values()),
        state_bytes=state,
        state_bytes_without_dedup=state + sum(b.state_skipped for b in pairs.values()),
        aux_bytes=sum(b.aux for b in pairs.values()),
        max_prefill_rank_bytes=_max(sent, 0),
        max_prefill_rank_bytes_without_dedup=_max(sent, 1),
        max_decode_rank_bytes=_max(received, 0),
        max_decode_rank_bytes_without_dedup=_max(received, 1),
        draft_kv_bytes=sum(b.draft_kv for b in pairs.values()),
    )
