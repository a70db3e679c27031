"""Which prefill rank sends which KV heads to which decode rank (sglang disaggregation).

Upstream rules reproduced here:
- equal attention TP: 1:1;
- decode TP > prefill TP: prefill rank r serves decode ranks r*k .. r*k+k-1 (k = dtp/ptp), each
  receiving its slice of r's heads;
- decode TP < prefill TP: decode rank d pulls prefill ranks d*k .. d*k+k-1 (k = ptp/dtp), each
  writing its heads into d's page; when heads are replicated (MLA, or fewer KV heads than ranks)
  only the first candidate holding a head sends it, the rest send nothing for it (SGLang's MLA
  decode takes ``target_tp_ranks[0]`` and counts one prefill response: ``_resolve_rank_mapping``);
- MLA is one latent "head" (``tp_kv_heads``) in one buffer per layer (``kv_buffers_per_layer``):
  every attention-TP rank holds all of it, so it takes the replicated-head routes above;
- decode CP must be 1; decode pulls from prefill CP rank 0 only, or from every CP rank with
  all-CP-ranks transfer or the DSA cache layer split;
- decode PP equals prefill PP or is 1.

Heads are in global numbering; a route's offsets are local to each side's own head range so a
backend can turn them straight into byte offsets within a page.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric_core.policy.types import KvKind


@dataclass(frozen=True)
class KvRoute:
    prefill_tp_rank: int
    decode_tp_rank: int
    src_head_offset: int  # first head within the prefill rank's local heads
    dst_head_offset: int  # first head within the decode rank's local heads
    num_heads: int
    src_local_heads: int
    dst_local_heads: int

    @property
    def whole_page(self) -> bool:
        """True when the route moves whole pages on both sides (page-granular blocks)."""
        return self.num_heads == self.src_local_heads == self.dst_local_heads


def kv_buffers_per_layer(kind: KvKind) -> int:
    """KV buffers one layer holds: a K and a V (MHA), or the latent alone (MLA: SGLang's
    MLATokenToKVPool registers one buffer per layer, ``get_contiguous_buf_infos``)."""
    return 1 if kind is KvKind.MLA else 2


def tp_kv_heads(kind: KvKind, kv_heads: int) -> int:
    """The KV heads attention TP splits: the model's (MHA), or one for MLA, whose latent is whole
    on every attention-TP rank (its pool has one head), so it is a replicated head to route."""
    return 1 if kind is KvKind.MLA else kv_heads


def validate_tp(tp: int, kv_heads: int, *, role: str) -> None:
    if tp < 1:
        raise ValueError(f"{role} TP size must be at least 1, got {tp}")
    if kv_heads < 1:
        raise ValueError(f"KV heads must be at least 1, got {kv_heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"{role} TP size {tp} and {kv_heads} KV heads do not divide each other; "
            "choose a TP size that divides the KV heads or is a multiple of them"
        )


def local_heads(tp: int, kv_heads: int) -> int:
    """KV heads each rank holds (replicated when there are fewer heads than ranks)."""
    return max(1, kv_heads // tp)


def global_heads(tp_rank: int, tp: int, kv_heads: int) -> range:
    if not 0 <= tp_rank < tp:
        raise ValueError(f"TP rank {tp_rank} is outside TP size {tp}")
    if kv_heads >= tp:
        per = kv_heads // tp
        return range(tp_rank * per, tp_rank * per + per)
    head = tp_rank // (tp // kv_heads)
    return range(head, head + 1)


def candidate_sources(decode_tp_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """Prefill TP ranks decode rank d reads from, in upstream order."""
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ValueError(f"prefill TP {prefill_tp} and decode TP {decode_tp} must divide each other")
    if decode_tp >= prefill_tp:
        return [decode_tp_rank // (decode_tp // prefill_tp)]
    k = prefill_tp // decode_tp
    return [decode_tp_rank * k + i for i in range(k)]


def kv_routes(prefill_tp: int, decode_tp: int, kv_heads: int) -> list[KvRoute]:
    """Every (prefill rank -> decode rank) head route, sorted by prefill then decode rank."""
    validate_tp(prefill_tp, kv_heads, role="prefill")
    validate_tp(decode_tp, kv_heads, role="decode")
    src_n, dst_n = local_heads(prefill_tp, kv_heads), local_heads(decode_tp, kv_heads)
    routes: list[KvRoute] = []
    for d in range(decode_tp):
        needed = global_heads(d, decode_tp, kv_heads)
        covered: set[int] = set()
        for p in candidate_sources(d, prefill_tp, decode_tp):
            held = global_heads(p, prefill_tp, kv_heads)
            share = [h for h in needed if h in held and h not in covered]
            if not share:
                continue
            covered.update(share)
            routes.append(
                KvRoute(
                    prefill_tp_rank=p,
                    decode_tp_rank=d,
                    src_head_offset=share[0] - held.start,
                    dst_head_offset=share[0] - needed.start,
                    num_heads=len(share),
                    src_local_heads=src_n,
                    dst_local_heads=dst_n,
                )
            )
        if covered != set(needed):
            raise AssertionError(f"decode rank {d} heads {sorted(set(needed) - covered)} have no source")
    return sorted(routes, key=lambda r: (r.prefill_tp_rank, r.decode_tp_rank))


def routes_from_prefill(prefill_tp_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int) -> list[KvRoute]:
    return [r for r in kv_routes(prefill_tp, decode_tp, kv_heads) if r.prefill_tp_rank == prefill_tp_rank]


def contiguous_shard(n: int, parts: int, index: int) -> range:
    """Share `index` of n items split into `parts` contiguous shares; the first shares take the
    remainder (n=10, parts=4: 3, 3, 2, 2), as SGLang splits CP pages
    (``_get_cp_rank_page_bounds``). CP page shards and CP state-layer shards split this way; PP
    layer ranges do not (``pp_layer_range``)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"share {index} is outside a split into {parts} parts")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def all_cp_ranks_send(*, all_cp_ranks_transfer: bool, dsa_cache_layer_split: bool) -> bool:
    """Whether every prefill CP rank sends its own share (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER,
    or the DSA cache layer split, under which each CP rank owns different state layers); else only
    CP rank 0 sends. ``PrefillSpec.all_cp_ranks_send`` asks this of a spec."""
    return all_cp_ranks_transfer or dsa_cache_layer_split


def sending_cp_ranks(cp_size: int, *, all_cp_ranks_transfer: bool, dsa_cache_layer_split: bool) -> list[int]:
    """Prefill CP ranks that send KV to decode (decode CP is always 1)."""
    if cp_size < 1:
        raise ValueError(f"CP size must be at least 1, got {cp_size}")
    if all_cp_ranks_send(all_cp_ranks_transfer=all_cp_ranks_transfer, dsa_cache_layer_split=dsa_cache_layer_split):
        return list(range(cp_size))
    return [0]


def cp_page_shard(num_pages: int, cp_size: int, cp_rank: int, *, all_ranks_send: bool) -> range:
    """Request pages (by position in the request) that prefill CP rank `cp_rank` sends.

    With all ranks sending, each rank sends its contiguous token shard (`contiguous_shard`);
    otherwise CP rank 0 sends every page and the others send none.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside a CP group of size {cp_size}")
    if not all_ranks_send:
        return range(num_pages) if cp_rank == 0 else range(0)
    return contiguous_shard(num_pages, cp_size, cp_rank)


def state_layer_shard(state_layers: int, cp_size: int, cp_rank: int, *, dsa_cache_layer_split: bool) -> range:
    """State layers CP rank `cp_rank` owns: all of them, or its share under the layer split."""
    if not dsa_cache_layer_split:
        return range(state_layers)
    return contiguous_shard(state_layers, cp_size, cp_rank)


def validate_pp(prefill_pp: int, decode_pp: int) -> None:
    if decode_pp not in (1, prefill_pp):
        raise ValueError(f"decode PP must equal prefill PP ({prefill_pp}) or be 1, got {decode_pp}")


def pp_layer_range(layers: int, pp: int, stage: int) -> range:
    """Global layers PP stage `stage` holds, as SGLang splits them (``get_pp_indices``): contiguous,
    the LAST stages take the remainder (10 layers in 4 stages: 2, 2, 3, 3). SGLang's
    ``SGLANG_PP_LAYER_PARTITION`` may split otherwise; an engine whose stage holds another number
    of layers is refused at registration."""
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"PP stage {stage} is outside a pipeline of {pp} stages")
    base, extra = divmod(layers, pp)
    first_longer = pp - extra  # stages before it hold `base` layers, it and after `base + 1`
    start = stage * base + max(0, stage - first_longer)
    return range(start, start + base + (1 if stage >= first_longer else 0))


def decode_pp_stage(prefill_stage: int, prefill_pp: int, decode_pp: int) -> int:
    """The decode stage a prefill stage sends to: the same stage, or 0 when decode PP is 1."""
    validate_pp(prefill_pp, decode_pp)
    if not 0 <= prefill_stage < prefill_pp:
        raise ValueError(f"PP stage {prefill_stage} is outside a pipeline of {prefill_pp} stages")
    return 0 if decode_pp == 1 else prefill_stage


def sends_request_rows(prefill_stage: int, prefill_pp: int) -> bool:
    """Per-request rows (aux, state) leave from the last PP stage only (upstream send_aux)."""
    return prefill_stage == prefill_pp - 1


def primary_source(decode_tp_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int) -> int:
    """The prefill TP rank that sends a decode rank its per-request rows (state, aux).

    KV heads may come from several prefill ranks (decode TP < prefill TP), but the per-request
    rows are whole and identical on every source, so one sender suffices: the lowest-numbered
    prefill rank with a route to the decode rank. Sending them from every source would write the
    same bytes k times.
    """
    sources = [
        r.prefill_tp_rank for r in kv_routes(prefill_tp, decode_tp, kv_heads) if r.decode_tp_rank == decode_tp_rank
    ]
    if not sources:
        raise ValueError(f"decode TP rank {decode_tp_rank} is outside decode TP size {decode_tp}")
    return min(sources)
