"""Rank mapping tables: which prefill rank sends which heads to which decode rank."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.rank_mapping import (
    KvRoute,
    all_cp_ranks_send,
    candidate_sources,
    contiguous_shard,
    cp_page_shard,
    decode_pp_stage,
    global_heads,
    kv_routes,
    pp_layer_range,
    primary_source,
    routes_from_prefill,
    sending_cp_ranks,
    sends_request_rows,
    state_layer_shard,
    validate_pp,
    validate_tp,
)
from pdfabric_core.spec import PrefillSpec


def r(p: int, d: int, so: int, do: int, n: int, sl: int, dl: int) -> KvRoute:
    return KvRoute(p, d, so, do, n, sl, dl)


@pytest.mark.parametrize(
    ("ptp", "dtp", "heads", "expected"),
    [
        (2, 2, 8, [r(0, 0, 0, 0, 4, 4, 4), r(1, 1, 0, 0, 4, 4, 4)]),
        (2, 4, 8, [r(0, 0, 0, 0, 2, 4, 2), r(0, 1, 2, 0, 2, 4, 2), r(1, 2, 0, 0, 2, 4, 2), r(1, 3, 2, 0, 2, 4, 2)]),
        (4, 2, 8, [r(0, 0, 0, 0, 2, 2, 4), r(1, 0, 0, 2, 2, 2, 4), r(2, 1, 0, 0, 2, 2, 4), r(3, 1, 0, 2, 2, 2, 4)]),
        (1, 2, 2, [r(0, 0, 0, 0, 1, 2, 1), r(0, 1, 1, 0, 1, 2, 1)]),
        # MLA-like: 1 KV head replicated; decode rank pulls from 4 prefill ranks, only the first sends.
        (4, 1, 1, [r(0, 0, 0, 0, 1, 1, 1)]),
        # 2 heads over 8 prefill ranks (4 copies each) to 2 decode ranks: one copy of each head.
        (8, 2, 2, [r(0, 0, 0, 0, 1, 1, 1), r(4, 1, 0, 0, 1, 1, 1)]),
        # Fewer heads than decode ranks: decode ranks 0,1 share head 0; 2,3 share head 1.
        (2, 4, 2, [r(0, 0, 0, 0, 1, 1, 1), r(0, 1, 0, 0, 1, 1, 1), r(1, 2, 0, 0, 1, 1, 1), r(1, 3, 0, 0, 1, 1, 1)]),
    ],
    ids=[
        "equal-tp2",
        "decode-tp4-from-tp2",
        "decode-tp2-from-tp4",
        "tp1-to-tp2",
        "mla-tp4-to-tp1",
        "replicated-tp8-to-tp2",
        "heads-lt-decode-tp",
    ],
)
def test_kv_routes(ptp: int, dtp: int, heads: int, expected: list[KvRoute]) -> None:
    assert kv_routes(ptp, dtp, heads) == expected


@pytest.mark.parametrize(
    ("ptp", "dtp", "heads", "whole"),
    [(2, 2, 8, True), (2, 4, 8, False), (4, 2, 8, False), (4, 1, 1, True)],
    ids=["equal", "decode-more", "decode-fewer", "mla"],
)
def test_whole_page_only_when_both_sides_hold_the_same_heads(ptp: int, dtp: int, heads: int, whole: bool) -> None:
    assert {route.whole_page for route in kv_routes(ptp, dtp, heads)} == {whole}


def test_routes_from_prefill_selects_one_rank() -> None:
    assert routes_from_prefill(1, 2, 4, 8) == [r(1, 2, 0, 0, 2, 4, 2), r(1, 3, 2, 0, 2, 4, 2)]


@pytest.mark.parametrize(
    ("d", "ptp", "dtp", "expected"),
    [(3, 2, 4, [1]), (1, 4, 2, [2, 3]), (0, 8, 2, [0, 1, 2, 3]), (1, 2, 2, [1])],
    ids=["decode-more", "decode-fewer", "decode-fewer-k4", "equal"],
)
def test_candidate_sources(d: int, ptp: int, dtp: int, expected: list[int]) -> None:
    assert candidate_sources(d, ptp, dtp) == expected


@pytest.mark.parametrize(
    ("d", "ptp", "dtp", "heads", "expected"),
    [(3, 2, 4, 8, 1), (1, 4, 2, 8, 2), (1, 8, 2, 2, 4), (0, 4, 1, 1, 0)],
    ids=["decode-more", "decode-fewer-lowest-source", "replicated-first-holder", "mla"],
)
def test_primary_source(d: int, ptp: int, dtp: int, heads: int, expected: int) -> None:
    assert primary_source(d, ptp, dtp, heads) == expected


@pytest.mark.parametrize(
    ("tp_rank", "tp", "heads", "expected"),
    [(1, 2, 8, range(4, 8)), (3, 8, 2, range(0, 1)), (4, 8, 2, range(1, 2)), (0, 1, 8, range(0, 8))],
    ids=["split", "replicated-first-half", "replicated-second-half", "tp1"],
)
def test_global_heads(tp_rank: int, tp: int, heads: int, expected: range) -> None:
    assert global_heads(tp_rank, tp, heads) == expected


@pytest.mark.parametrize(
    ("cp", "all_ranks", "split", "expected"),
    [(1, False, False, [0]), (4, False, False, [0]), (4, True, False, [0, 1, 2, 3]), (4, False, True, [0, 1, 2, 3])],
    ids=["no-cp", "cp4-rank0-only", "cp4-all-ranks", "cp4-layer-split"],
)
def test_sending_cp_ranks(cp: int, all_ranks: bool, split: bool, expected: list[int]) -> None:
    assert sending_cp_ranks(cp, all_cp_ranks_transfer=all_ranks, dsa_cache_layer_split=split) == expected


@pytest.mark.parametrize(
    ("pages", "cp", "rank", "all_send", "expected"),
    [
        (10, 4, 0, True, range(0, 3)),
        (10, 4, 1, True, range(3, 6)),
        (10, 4, 2, True, range(6, 8)),
        (10, 4, 3, True, range(8, 10)),
        (10, 4, 0, False, range(0, 10)),
        (10, 4, 2, False, range(0)),
        (2, 4, 3, True, range(2, 2)),
    ],
    ids=[
        "r0-takes-remainder",
        "r1-takes-remainder",
        "r2",
        "r3",
        "rank0-only-sends-all",
        "others-send-none",
        "fewer-pages-than-ranks",
    ],
)
def test_cp_page_shard(pages: int, cp: int, rank: int, all_send: bool, expected: range) -> None:
    assert cp_page_shard(pages, cp, rank, all_ranks_send=all_send) == expected


@pytest.mark.parametrize(
    ("layers", "cp", "rank", "split", "expected"),
    [(4, 4, 2, True, range(2, 3)), (8, 4, 1, True, range(2, 4)), (4, 4, 2, False, range(0, 4))],
    ids=["one-layer-each", "two-layers-each", "no-split-all-layers"],
)
def test_state_layer_shard(layers: int, cp: int, rank: int, split: bool, expected: range) -> None:
    assert state_layer_shard(layers, cp, rank, dsa_cache_layer_split=split) == expected


@pytest.mark.parametrize(
    ("layers", "pp", "stage", "expected"),
    [(32, 1, 0, range(0, 32)), (32, 2, 1, range(16, 32)), (10, 4, 0, range(0, 2)), (10, 4, 3, range(7, 10))],
    ids=["no-pp", "pp2-second-half", "uneven-first-stage-base", "uneven-last-takes-remainder"],
)
def test_pp_layer_range(layers: int, pp: int, stage: int, expected: range) -> None:
    assert pp_layer_range(layers, pp, stage) == expected


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 10, 27, 61])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_pp_layer_range_is_sglangs_split(layers: int, pp: int) -> None:
    """SGLang's own ``get_pp_indices`` (remainder on the last stages), every stage, when SGLang is
    installed; otherwise the split still covers every layer once, in order."""
    if layers < pp:
        return
    ranges = [pp_layer_range(layers, pp, stage) for stage in range(pp)]
    assert [i for r in ranges for i in r] == list(range(layers))
    try:
        from sglang.srt.distributed.utils import get_pp_indices
    except ImportError:
        return
    assert [(r.start, r.stop) for r in ranges] == [get_pp_indices(layers, s, pp) for s in range(pp)]


@pytest.mark.parametrize(
    ("stage", "ppp", "dpp", "expected"),
    [(0, 1, 1, 0), (1, 2, 2, 1), (1, 2, 1, 0), (3, 4, 1, 0)],
    ids=["no-pp", "stage-to-stage", "into-decode-pp1", "last-into-pp1"],
)
def test_decode_pp_stage(stage: int, ppp: int, dpp: int, expected: int) -> None:
    assert decode_pp_stage(stage, ppp, dpp) == expected


@pytest.mark.parametrize(
    ("stage", "pp", "rows"), [(0, 1, True), (0, 2, False), (1, 2, True)], ids=["no-pp", "first", "last"]
)
def test_request_rows_leave_from_the_last_stage(stage: int, pp: int, rows: bool) -> None:
    assert sends_request_rows(stage, pp) is rows


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: validate_tp(3, 8, role="prefill"), "do not divide"),
        (lambda: validate_tp(0, 8, role="decode"), "at least 1"),
        (lambda: candidate_sources(0, 3, 2), "must divide"),
        (lambda: validate_pp(2, 3), "decode PP"),
        (lambda: cp_page_shard(4, 2, 2, all_ranks_send=True), "outside"),
        (lambda: global_heads(2, 2, 8), "outside"),
        (lambda: primary_source(5, 2, 4, 8), "outside"),
        (lambda: pp_layer_range(8, 2, 2), "outside a pipeline"),
        (lambda: decode_pp_stage(0, 2, 3), "decode PP"),
        (lambda: decode_pp_stage(2, 2, 2), "outside a pipeline"),
    ],
    ids=[
        "tp-heads-indivisible",
        "tp-zero",
        "tp-sizes-indivisible",
        "pp-mismatch",
        "cp-rank-outside",
        "tp-rank-outside",
        "decode-rank-outside",
        "pp-stage-outside",
        "pp-mismatch-stage",
        "pp-stage-too-big",
    ],
)
def test_invalid_layouts_are_rejected(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("n", "parts", "expected"),
    [
        (10, 4, [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]),
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (2, 4, [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]),
        (5, 1, [range(0, 5)]),
        (0, 3, [range(0, 0)] * 3),
    ],
    ids=["remainder-to-first-shares", "even", "fewer-items-than-parts", "one-part", "nothing"],
)
def test_contiguous_shard(n: int, parts: int, expected: list[range]) -> None:
    shards = [contiguous_shard(n, parts, i) for i in range(parts)]
    assert shards == expected
    assert [i for s in shards for i in s] == list(range(n))


@pytest.mark.parametrize(("parts", "index"), [(0, 0), (3, 3), (3, -1)], ids=["no-parts", "past-end", "negative"])
def test_contiguous_shard_rejects_a_share_outside_the_split(parts: int, index: int) -> None:
    with pytest.raises(ValueError, match="outside a split"):
        contiguous_shard(10, parts, index)


@pytest.mark.parametrize(
    ("all_ranks", "split", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
    ids=["rank-0-only", "all-cp-ranks-transfer", "dsa-layer-split", "both"],
)
def test_all_cp_ranks_send(all_ranks: bool, split: bool, expected: bool) -> None:
    assert all_cp_ranks_send(all_cp_ranks_transfer=all_ranks, dsa_cache_layer_split=split) is expected
    spec = PrefillSpec(cp=4, all_cp_ranks_transfer=all_ranks, dsa_cache_layer_split=split)
    assert spec.all_cp_ranks_send is expected
    assert (
        sending_cp_ranks(4, all_cp_ranks_transfer=all_ranks, dsa_cache_layer_split=split) == [0, 1, 2, 3]
    ) is expected
