"""What each prefill rank owes each decode rank for one request: pure, every rule from ``policy``.

A prefill rank (tp p, cp c, pp stage s) sending a request to decode rank d owes:
- KV: for each route p->d (rank_mapping), the pages of its CP shard (cp_page_shard), every layer
  of its stage, K and V (or the MLA latent), the route's heads (a whole page, or a head slice under
  a TP mismatch); MLA's latent is one replicated head, so d reads it from one prefill rank;
- state: each state tensor by its kind's rule (``state_slices``: a replicated slot tensor or a
  row whole from d's primary source, a TP-sharded slot tensor as the overlap of the two ranks'
  shares, page state as the route's head slice), only from the last PP stage, only the state
  tensors this CP rank owns (state_layer_shard), and nothing when the dedup rule says CP rank 0
  sends it (cp_dedup);
- aux: only from d's primary source at CP rank 0 on the last PP stage, through the engine or over
  the TCP side channel as aux_path says;
- pipeline parallel: PP stage s sends its own layers to the decode stage decode_pp_stage names,
  shifted to that stage's layer numbering.
Which (p, c, s) a decode rank waits for is ``expected_sources``; both sides use the same rules.

MLA KV cache sharding (``spec.prefill.kvCacheSharding``, policy/kv_shard.py): every prefill
attention-TP rank has a route to every decode rank (equal TP), its duties name all the request's
positions and its shard (``kv_shard_rank`` of ``kv_shard_size``); the planner keeps the positions
whose logical page it owns, so what a pair moves depends on the request's page ids, not its length.

The agent plans its blocks from these duties (``pdfabric_agent.memory.plan``) and the operator's status
predicts its bytes from them (``pdfabric_core.traffic``), so the two cannot disagree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pdfabric_core.policy.aux_path import AuxPath, choose_aux_path
from pdfabric_core.policy.cp_dedup import should_skip_state_transfer
from pdfabric_core.policy.kv_shard import cyclic_pages_per_source, sharded_sources
from pdfabric_core.policy.rank_mapping import (
    KvRoute,
    cp_page_shard,
    decode_pp_stage,
    pp_layer_range,
    primary_source,
    routes_from_prefill,
    sending_cp_ranks,
    sends_request_rows,
    state_layer_shard,
)
from pdfabric_core.policy.state_slices import StateSlice, state_slices
from pdfabric_core.spec import PDClusterSpec

__all__ = [
    "Duties",
    "PairDuties",
    "decode_targets",
    "expected_sources",
    "kv_shard_size",
    "pair_duties",
    "receives_request_rows",
    "replica_duties",
    "routes_for_decode",
    "sender_duties",
]


@dataclass(frozen=True)
class Duties:
    """What one prefill rank owes one decode rank for one room."""

    route: KvRoute
    pages: range  # positions in the request (cp_page_shard)
    state_layers: range  # the state tensors it owns; empty when this rank sends no state
    state_skipped: bool  # True when the dedup rule dropped this rank's state
    send_aux: bool
    aux_path: AuxPath
    dst_layer_offset: int = 0  # decode local layer = prefill local layer + this (PP stages)
    state_slices: tuple[StateSlice, ...] = ()  # what moves of each state tensor, per state index
    skipped_state_bytes: int = 0  # per state index, what the dedup rule dropped
    # Draft KV layers (model.draftLayers) this pair moves by the same route and page shard: the
    # last PP stage's, into the decode rank's draft layers (SGLang: only that stage runs the draft).
    draft_layers: int = 0
    # MLA KV cache sharding: of ``pages``, only the positions whose logical page l has
    # l % kv_shard_size == kv_shard_rank move, from local page l // kv_shard_size (1: not sharded).
    kv_shard_size: int = 1
    kv_shard_rank: int = 0

    @property
    def sharded(self) -> bool:
        return self.kv_shard_size > 1

    @property
    def predicted_pages(self) -> int:
        """KV pages this pair moves: its positions, or under sharding the share a request whose
        pages the allocator drew cyclically from owner 0 gives it (the real share depends on the
        request's page ids; over every source of a decode rank they sum to the request's pages)."""
        if not self.sharded:
            return len(self.pages)
        return cyclic_pages_per_source(len(self.pages), self.kv_shard_size, 0)[self.kv_shard_rank]

    @property
    def state_bytes(self) -> int:
        """Bytes of state this pair moves per state index (slot, row or page)."""
        return sum(s.nbytes for s in self.state_slices)


@dataclass(frozen=True)
class PairDuties:
    """The duties of one (prefill rank, decode rank) pair of one replica pair."""

    prefill_tp_rank: int
    cp_rank: int
    pp_stage: int
    decode_tp_rank: int
    decode_stage: int
    duties: Duties


# The routes depend on three sizes only and are asked for on every room: computed once per sizes.
@functools.lru_cache(maxsize=1024)
def _routes_from(
    prefill_tp_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int, sharded: bool = False
) -> tuple[KvRoute, ...]:
    if sharded:
        # Whole latent pages from every prefill rank to every decode rank (SGLang's
        # _resolve_rank_mapping under MLA KV sharding: target_tp_ranks is every prefill rank).
        return tuple(
            KvRoute(prefill_tp_rank, d, 0, 0, 1, 1, 1)
            for d in range(decode_tp)
            if prefill_tp_rank in sharded_sources(d, prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_cp=1)
        )
    return tuple(routes_from_prefill(prefill_tp_rank, prefill_tp, decode_tp, kv_heads))


@functools.lru_cache(maxsize=1024)
def _primary(decode_tp_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int, sharded: bool = False) -> int:
    if sharded:
        return 0  # every prefill rank is a source: the lowest sends the request's rows
    return primary_source(decode_tp_rank, prefill_tp, decode_tp, kv_heads)


def kv_shard_size(spec: PDClusterSpec) -> int:
    """Prefill ranks the request's KV pages are striped over (1: not sharded)."""
    return spec.prefill.tp if spec.prefill.kv_cache_sharding else 1


def decode_targets(spec: PDClusterSpec, prefill_tp_rank: int) -> list[KvRoute]:
    p = spec.prefill
    return list(_routes_from(prefill_tp_rank, p.tp, spec.decode.tp, spec.model.tp_kv_heads, p.kv_cache_sharding))


def prefill_rank_sends(spec: PDClusterSpec, prefill_tp_rank: int, cp_rank: int) -> bool:
    """Whether a prefill rank moves anything: its CP rank sends for this spec, and some decode rank
    takes its heads. With KV heads replicated (prefill TP above the KV head count, above decode
    TP), a decode rank reads each head from one prefill rank of the replicas; the others have no
    route. SGLang's scheduler still polls every rank and takes the MIN, so such a rank must go
    WaitingForInput and Success with nothing to move, never wait for a decode announcement."""
    p = spec.prefill
    sending_cp = sending_cp_ranks(
        p.cp, all_cp_ranks_transfer=p.all_cp_ranks_transfer, dsa_cache_layer_split=p.dsa_cache_layer_split
    )
    return cp_rank in sending_cp and bool(decode_targets(spec, prefill_tp_rank))


def sender_duties(
    spec: PDClusterSpec, route: KvRoute, cp_rank: int, num_pages: int, pp_stage: int = 0
) -> Duties | None:
    """Duties of prefill (route.prefill_tp_rank, cp_rank, pp_stage) for route's decode rank (at
    the decode stage ``decode_pp_stage`` names); None: nothing."""
    cp = spec.prefill.cp
    split = spec.prefill.dsa_cache_layer_split
    if cp_rank not in sending_cp_ranks(
        cp, all_cp_ranks_transfer=spec.prefill.all_cp_ranks_transfer, dsa_cache_layer_split=split
    ):
        return None
    sharded = spec.prefill.kv_cache_sharding
    primary = route.prefill_tp_rank == _primary(
        route.decode_tp_rank, spec.prefill.tp, spec.decode.tp, spec.model.tp_kv_heads, sharded
    )
    skip = should_skip_state_transfer(cp, cp_rank, dsa_cache_layer_split=split)
    m = spec.model
    pp, dpp, layers = spec.prefill.pp, spec.decode.pp, m.layers
    rows = sends_request_rows(pp_stage, pp)
    primary = primary and rows
    owned = state_layer_shard(m.state_layers, cp, cp_rank, dsa_cache_layer_split=split)
    slices = state_slices(
        m.state_kind,
        m.state_tensors,
        m.state_sharded,
        owned if (rows and m.state_tensors) else range(0),
        route,
        prefill_tp=spec.prefill.tp,
        decode_tp=spec.decode.tp,
        kv_heads=m.tp_kv_heads,
        page_tokens=m.page_size_tokens,
        primary=primary,
        blocks=m.state_tensor_blocks,
    )
    offset = pp_layer_range(layers, pp, pp_stage).start
    offset -= pp_layer_range(layers, dpp, decode_pp_stage(pp_stage, pp, dpp)).start
    return Duties(
        route=route,
        pages=cp_page_shard(num_pages, cp, cp_rank, all_ranks_send=spec.prefill.all_cp_ranks_send),
        state_layers=owned if (slices and not skip) else range(0),
        state_skipped=bool(slices) and skip,
        send_aux=primary and cp_rank == 0,
        aux_path=choose_aux_path(spec.transfer.mem_pool, aux_over_tcp=spec.transfer.aux_over_tcp),
        dst_layer_offset=offset,
        state_slices=() if skip else slices,
        skipped_state_bytes=sum(s.nbytes for s in slices) if skip else 0,
        draft_layers=m.draft_layers_on(pp, pp_stage),
        kv_shard_size=kv_shard_size(spec),
        kv_shard_rank=route.prefill_tp_rank if sharded else 0,
    )


def pair_duties(
    spec: PDClusterSpec, prefill_tp_rank: int, cp_rank: int, pp_stage: int, decode_tp_rank: int, num_pages: int
) -> Duties | None:
    """``sender_duties`` of one prefill rank toward one decode rank it has a route to (both sides
    ask it: the sender to plan, the receiver to hold reports to the plan)."""
    route = next(r for r in decode_targets(spec, prefill_tp_rank) if r.decode_tp_rank == decode_tp_rank)
    return sender_duties(spec, route, cp_rank, num_pages, pp_stage)


def replica_duties(spec: PDClusterSpec, num_pages: int) -> list[PairDuties]:
    """Every duty one prefill replica has towards the decode replica it feeds for a request of
    ``num_pages`` pages: each prefill rank's ``sender_duties`` for each of its ``decode_targets``,
    exactly as its agent plans them; ranks that owe nothing are left out."""
    p = spec.prefill
    out: list[PairDuties] = []
    for stage in range(p.pp):
        decode_stage = decode_pp_stage(stage, p.pp, spec.decode.pp)
        for tp_rank in range(p.tp):
            for route in decode_targets(spec, tp_rank):
                for cp_rank in range(p.cp):
                    duties = sender_duties(spec, route, cp_rank, num_pages, stage)
                    if duties is not None:
                        out.append(PairDuties(tp_rank, cp_rank, stage, route.decode_tp_rank, decode_stage, duties))
    return out


def expected_sources(spec: PDClusterSpec, decode_tp_rank: int, decode_stage: int = 0) -> list[tuple[int, int, int]]:
    """(prefill tp rank, cp rank, pp stage) a decode rank waits for before its room is complete."""
    cps = sending_cp_ranks(
        spec.prefill.cp,
        all_cp_ranks_transfer=spec.prefill.all_cp_ranks_transfer,
        dsa_cache_layer_split=spec.prefill.dsa_cache_layer_split,
    )
    tps = sorted(
        {r.prefill_tp_rank for r in routes_for_decode(spec, decode_tp_rank)},
    )
    pp, dpp = spec.prefill.pp, spec.decode.pp
    stages = [s for s in range(pp) if decode_pp_stage(s, pp, dpp) == decode_stage]
    return [(p, c, s) for s in stages for p in tps for c in cps]


def receives_request_rows(spec: PDClusterSpec, decode_stage: int) -> bool:
    """The decode stage the last prefill stage sends aux and state to."""
    pp = spec.prefill.pp
    return decode_stage == decode_pp_stage(pp - 1, pp, spec.decode.pp)


def routes_for_decode(spec: PDClusterSpec, decode_tp_rank: int) -> list[KvRoute]:
    return [r for p in range(spec.prefill.tp) for r in decode_targets(spec, p) if r.decode_tp_rank == decode_tp_rank]
