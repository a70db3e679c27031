"""The status prediction equals what the agents plan, over every layout (issue 10, item 12).

For each layout (prefill TP 1-8, decode TP 1-8, prefill CP 1-8, PP 1-4 with decode PP equal or 1,
layer split on/off, all-ranks transfer on/off, with state and aux, half of them with a draft KV
group (model.draftLayers); parse_spec rejects the invalid
ones) the bytes ``traffic.pair_traffic`` predicts for every (prefill rank, decode rank) pair, per
kind, equal the bytes ``plan_transfer`` plans for it the way the sender does (its
``decode_targets`` and ``sender_duties``, real ``PoolLayout``s of each rank's PP stage, real page
lists), and ``estimate_traffic``'s totals and busiest ranks equal their sums.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from pdfabric_agent.memory.plan import (
    Bases,
    TransferPlan,
    TransferSide,
    decode_targets,
    plan_transfer,
    receives_request_rows,
    sender_duties,
)
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_core.policy.rank_mapping import decode_pp_stage
from pdfabric_core.policy.types import KvKind
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec, validate_spec
from pdfabric_core.traffic import PairBytes, estimate_traffic, pair_traffic

SRC = Bases(kv=0x10000000, state=0x20000000, aux=0x30000000)
DST = Bases(kv=0x40000000, state=0x50000000, aux=0x60000000)
STATE_LAYER_BYTES = 24
AUX_ROW = [16, 8, 40]
# 1: every TP 1-8 valid, heads replicated; 2: replicated head slices; 8: head slices; MLA: one
# latent buffer per layer (not K and V), whole on every rank
KV_HEADS: tuple[int | str, ...] = (1, 2, 8, "MLA")
MLA_LATENT = {"kvKind": "MLA", "kvLoraRank": 3, "qkRopeHeadDim": 2}  # 5 elements, a width no head has
LAYERS = 5  # uneven over 2, 3 and 4 PP stages
PAGE_TOKENS = 4

Pair = tuple[tuple[int, int, int], tuple[int, int]]


def base_spec(kv_heads: int | str, ptp: int, dtp: int, pp: int, dpp: int) -> PDClusterSpec | None:
    """The TP and PP part of a layout as a parsed spec, or None where parse_spec refuses it."""
    raw: dict[str, Any] = {
        "prefill": {"tp": ptp, "pp": pp},
        "decode": {"tp": dtp, "pp": dpp},
        "transfer": {"transport": "tcp"},
        "model": {
            "layers": LAYERS,
            **({"kvHeads": kv_heads} if isinstance(kv_heads, int) else MLA_LATENT),
            "headDim": 2,
            "pageSizeTokens": PAGE_TOKENS,
            "dtype": "float32",
            "stateLayers": 2,
            "stateBytesPerRequest": 2 * STATE_LAYER_BYTES,
            "auxRowBytes": AUX_ROW,
            "draftLayers": (ptp + dtp + pp) % 2,  # a draft KV group (EAGLE/MTP) in half the layouts
        },
        "placement": {"fallback": "TCP"},
    }
    try:
        return parse_spec(raw)
    except SpecError:
        return None


def with_cp(base: PDClusterSpec, cp: int, split: bool, all_ranks: bool) -> PDClusterSpec | None:
    """``base`` with its CP part, checked by the cross-field rules parse_spec applies
    (validate_spec); parsing every variant again would take seconds."""
    state_layers = 2 * cp  # the layer split needs CP to divide the state layers
    spec = dataclasses.replace(
        base,
        prefill=dataclasses.replace(base.prefill, cp=cp, all_cp_ranks_transfer=all_ranks, dsa_cache_layer_split=split),
        model=dataclasses.replace(
            base.model, state_layers=state_layers, state_bytes_per_request=state_layers * STATE_LAYER_BYTES
        ),
    )
    try:
        validate_spec(spec)
    except SpecError:
        return None
    return spec


@functools.cache
def layouts() -> tuple[tuple[str, PDClusterSpec, int], ...]:
    """(name, spec, pages) of every valid layout. Each TP pair takes the KV head counts of
    KV_HEADS it is valid with in turn across its PP and CP variants, and the request alternates
    between 11 pages (uneven CP shards) and 3 (fewer pages than CP ranks)."""
    out: list[tuple[str, PDClusterSpec, int]] = []
    for ptp, dtp, pp in itertools.product(range(1, 9), range(1, 9), range(1, 5)):
        for dpp in sorted({pp, 1}):
            bases = [b for b in (base_spec(kv, ptp, dtp, pp, dpp) for kv in KV_HEADS) if b is not None]
            for cp, split, all_ranks in itertools.product(range(1, 9), (False, True), (False, True)):
                if not bases:
                    continue
                spec = with_cp(bases[(cp + pp + dpp) % len(bases)], cp, split, all_ranks)
                if spec is not None:
                    kind = "mla" if spec.model.kv_kind is KvKind.MLA else f"kv{spec.model.kv_heads}"
                    name = f"{kind}-tp{ptp}to{dtp}-cp{cp}-pp{pp}to{dpp}" + "-split" * split
                    name += "-draft" * bool(spec.model.draft_layers)
                    out.append((name + "-allranks" * all_ranks, spec, (11, 3)[len(out) % 2]))
    return tuple(out)


def _plan_bytes(plan: TransferPlan) -> tuple[int, int, int, int]:
    assert plan.kv_pages is not None
    kv = plan.kv_pages.nbytes
    if plan.kv:  # planned with engine blocks: they carry the same bytes
        assert kv == sum(b.length for b in plan.kv)
    state = sum(b.length for b in plan.state)
    aux = sum(b.length for b in plan.aux) + sum(n for _, _, n in plan.aux_tcp)
    return kv, state, plan.state_skipped_bytes, aux


def planned(
    spec: PDClusterSpec, pages: int, state_slots: int = 1, *, kv_blocks: bool = False, coalesce: bool = True
) -> dict[Pair, tuple[int, int, int, int]]:
    """(kv, state, state skipped, aux) ``plan_transfer`` plans per pair, the way the sender plans
    a room (sender.targets.plan_target) and the harness hands out slots (aux to the row-receiving stage)."""
    p, d, geo = spec.prefill, spec.decode, spec.model
    out: dict[Pair, tuple[int, int, int, int]] = {}
    dst_pages = [3 * i + 1 for i in range(pages)]  # scattered: coalescing must not change the bytes
    for stage in range(p.pp):
        dstage = decode_pp_stage(stage, p.pp, d.pp)
        slots = {"kv_pages": 4 * pages + 8, "state_slots": 2 * state_slots + 1, "aux_slots": 4}
        src_layout = PoolLayout.from_geometry(geo, p.tp, pp=p.pp, pp_stage=stage, **slots)
        dst_layout = PoolLayout.from_geometry(geo, d.tp, pp=d.pp, pp_stage=dstage, **slots)
        for tp_rank, cp_rank in itertools.product(range(p.tp), range(p.cp)):
            for route in decode_targets(spec, tp_rank):
                duties = sender_duties(spec, route, cp_rank, pages, stage)
                if duties is None:
                    continue
                with_state = bool(duties.state_layers or duties.state_skipped)
                plan = plan_transfer(
                    duties,
                    TransferSide(
                        src_layout,
                        SRC,
                        list(range(2, 2 + len(duties.pages))),
                        list(range(state_slots)) if with_state else [],
                        1,
                    ),
                    TransferSide(
                        dst_layout,
                        DST,
                        dst_pages,
                        list(range(state_slots, 2 * state_slots)) if with_state else [],
                        2 if receives_request_rows(spec, dstage) else None,
                    ),
                    kv_blocks=kv_blocks,
                    coalesce=coalesce,
                )
                out[((tp_rank, cp_rank, stage), (route.decode_tp_rank, dstage))] = _plan_bytes(plan)
    return out


def _as_tuple(b: PairBytes) -> tuple[int, int, int, int]:
    return b.kv, b.state, b.state_skipped, b.aux


# A deterministic sample for quick runs (-m "not slow"); the full sweep is marked slow.
STEP = 29


def sample() -> range:
    return range(0, len(layouts()), STEP)


@functools.cache
def _planned(index: int) -> dict[Pair, tuple[int, int, int, int]]:
    _, spec, pages = layouts()[index]
    return planned(spec, pages)


def _pair_mismatches(indices: Iterable[int]) -> list[str]:
    wrong: list[str] = []
    for i in indices:
        name, spec, pages = layouts()[i]
        want = _planned(i)
        got = {k: _as_tuple(v) for k, v in pair_traffic(spec, pages).items()}
        if got != want:
            diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            wrong.append(f"{name} ({pages} pages): {[(k, got.get(k), want.get(k)) for k in diff[:3]]}")
    return wrong


def _estimate_mismatches(indices: Iterable[int]) -> list[str]:
    """Totals per kind, and the busiest rank on each side with and without dedup, against the
    sums of the planned pairs."""
    wrong: list[str] = []
    for i in indices:
        name, spec, pages = layouts()[i]
        est = estimate_traffic(spec, prompt_tokens=pages * PAGE_TOKENS - 1)  # rounds up to `pages`
        want = _planned(i)
        sent: Counter[Any] = Counter()
        sent_nodedup: Counter[Any] = Counter()
        recv: Counter[Any] = Counter()
        recv_nodedup: Counter[Any] = Counter()
        for (src, dst), (kv, state, skipped, aux) in want.items():
            sent[src] += kv + state + aux
            recv[dst] += kv + state + aux
            sent_nodedup[src] += kv + state + skipped + aux
            recv_nodedup[dst] += kv + state + skipped + aux
        kv, state, skipped, aux = (sum(v[k] for v in want.values()) for k in range(4))
        expect = (pages, kv, state, state + skipped, aux)
        expect += tuple(max(c.values()) for c in (sent, sent_nodedup, recv, recv_nodedup))
        got = (est.pages, est.kv_bytes, est.state_bytes, est.state_bytes_without_dedup, est.aux_bytes)
        got += (
            est.max_prefill_rank_bytes,
            est.max_prefill_rank_bytes_without_dedup,
            est.max_decode_rank_bytes,
            est.max_decode_rank_bytes_without_dedup,
        )
        if got != expect:
            wrong.append(f"{name} ({pages} pages): {got} != {expect}")
        # And against the geometry alone (the synthetic engine's count): every decode rank gets
        # each page's local heads once, one copy of the state and of the aux row.
        geo, d = spec.model, spec.decode
        assert kv == pages * (geo.layers + geo.draft_layers) * geo.kv_buffers * d.tp * geo.kv_page_bytes(d.tp), name
        assert state == d.tp * geo.state_bytes_per_request, name
        assert aux == d.tp * sum(geo.aux_row_bytes), name
        copies = spec.prefill.cp if spec.prefill.all_cp_ranks_send and not spec.prefill.dsa_cache_layer_split else 1
        assert state + skipped == copies * state, name
    return wrong


def test_sweep_covers_the_layouts() -> None:
    specs = [s for _, s, _ in layouts()]
    assert {(s.prefill.tp, s.decode.tp) for s in specs} == {
        (a, b) for a in range(1, 9) for b in range(1, 9) if a % b == 0 or b % a == 0
    }
    assert {(s.prefill.cp, pages) for _, s, pages in layouts()} == {(cp, n) for cp in range(1, 9) for n in (3, 11)}
    assert {(s.prefill.pp, s.decode.pp) for s in specs} == {(pp, dpp) for pp in range(1, 5) for dpp in {pp, 1}}
    assert {(s.prefill.dsa_cache_layer_split, s.prefill.all_cp_ranks_transfer) for s in specs} == set(
        itertools.product((False, True), repeat=2)
    )
    assert {"MLA" if s.model.kv_kind is KvKind.MLA else s.model.kv_heads for s in specs} == set(KV_HEADS)
    mla = [s for s in specs if s.model.kv_kind is KvKind.MLA]
    assert {(s.prefill.tp > s.decode.tp, s.prefill.tp < s.decode.tp, s.prefill.cp > 1) for s in mla} >= {
        (True, False, False), (False, True, False), (False, False, True)
    }  # fmt: skip
    drafted = [s for s in specs if s.model.draft_layers]
    assert {(s.model.kv_kind, s.prefill.tp != s.decode.tp, s.prefill.pp > 1, s.prefill.cp > 1) for s in drafted} >= {
        (KvKind.MLA, True, False, False), (KvKind.MHA, True, False, False), (KvKind.MHA, False, True, False),
        (KvKind.MHA, False, False, True), (KvKind.MLA, False, False, True),
    }  # fmt: skip
    routes = [r for s in specs for p in range(s.prefill.tp) for r in decode_targets(s, p)]
    assert any(not r.whole_page and r.src_local_heads > r.num_heads for r in routes)  # slices sent
    assert any(not r.whole_page and r.dst_local_heads > r.num_heads for r in routes)  # slices received


def test_predicted_bytes_equal_planned_bytes_sample() -> None:
    wrong = _pair_mismatches(sample()) + _estimate_mismatches(sample())
    assert not wrong, f"{len(wrong)} of {len(sample())} sampled layouts differ, e.g. {wrong[:5]}"


@pytest.mark.slow
def test_predicted_bytes_equal_planned_bytes_for_every_pair_of_every_layout() -> None:
    wrong = _pair_mismatches(range(len(layouts())))
    assert not wrong, f"{len(wrong)} of {len(layouts())} layouts differ, e.g. {wrong[:5]}"


@pytest.mark.slow
def test_estimate_sums_the_planned_pairs_of_every_layout() -> None:
    wrong = _estimate_mismatches(range(len(layouts())))
    assert not wrong, f"{len(wrong)} of {len(layouts())} layouts differ, e.g. {wrong[:5]}"


def test_planned_kv_blocks_carry_the_planned_bytes() -> None:
    """The sweep counts KV by ``KvPages.nbytes``, as the agent does; the engine blocks, coalesced
    or not, carry the same bytes (``_plan_bytes`` checks each plan)."""
    for i in sample():
        _, spec, pages = layouts()[i]
        for coalesce in (True, False):
            assert planned(spec, pages, kv_blocks=True, coalesce=coalesce) == _planned(i)
