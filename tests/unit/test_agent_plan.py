"""Planning a room into engine blocks: exact blocks for each rule, no engine involved."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_agent.memory.plan import (
    Bases,
    Block,
    TransferSide,
    decode_targets,
    expected_sources,
    plan_transfer,
    sender_duties,
)
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_core.policy.aux_path import AuxPath
from pdfabric_core.spec import PDClusterSpec, parse_spec

SRC = Bases(kv=0x10000000, state=0x20000000, aux=0x30000000)
DST = Bases(kv=0x40000000, state=0x50000000, aux=0x60000000)


def make_spec(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, layers: int = 1, **transfer: Any
) -> PDClusterSpec:
    model = {"layers": layers, "kvHeads": 4, "headDim": 8, "pageSizeTokens": 2, "dtype": "float32"}
    model.update({"stateBytesPerRequest": 64, "stateLayers": 2, "auxRowBytes": [8, 16]})
    return parse_spec(
        {
            "prefill": prefill or {},
            "decode": decode or {},
            "transfer": transfer,
            "model": model,
            "placement": {"fallback": "TCP"},
        }
    )


def layout(spec: PDClusterSpec, tp: int) -> PoolLayout:
    return PoolLayout.from_geometry(spec.model, tp, kv_pages=16, state_slots=4, aux_slots=4)


def plan(spec: PDClusterSpec, p: int, cp: int, d: int, src_pages: list[int], dst_pages: list[int], **kw: Any) -> Any:
    route = next(r for r in decode_targets(spec, p) if r.decode_tp_rank == d)
    duties = sender_duties(spec, route, cp, len(dst_pages))
    assert duties is not None
    args: dict[str, Any] = {"src_state": [0], "dst_state": [2], "src_aux": 1, "dst_aux": 3, "coalesce": True, **kw}
    return duties, plan_transfer(
        duties,
        TransferSide(layout(spec, spec.prefill.tp), SRC, src_pages, args.pop("src_state"), args.pop("src_aux")),
        TransferSide(layout(spec, spec.decode.tp), DST, dst_pages, args.pop("dst_state"), args.pop("dst_aux")),
        **args,
    )


# Page bytes at TP1: 4 heads x 2 tokens x 8 dims x 4 bytes = 256; one head = 64.
PAGE = 256
HEAD = 64


def test_equal_tp_coalesces_runs_per_layer_and_kv() -> None:
    spec = make_spec()
    _, p = plan(spec, 0, 0, 0, [0, 1, 2, 7], [4, 5, 6, 9])
    v = 16 * PAGE  # V half of the layer starts after 16 K pages
    assert p.kv == [
        Block(SRC.kv + 0, DST.kv + 4 * PAGE, 3 * PAGE),
        Block(SRC.kv + 7 * PAGE, DST.kv + 9 * PAGE, PAGE),
        Block(SRC.kv + v + 0, DST.kv + v + 4 * PAGE, 3 * PAGE),
        Block(SRC.kv + v + 7 * PAGE, DST.kv + v + 9 * PAGE, PAGE),
    ]


def test_without_coalescing_every_page_is_a_block() -> None:
    spec = make_spec()
    _, p = plan(spec, 0, 0, 0, [0, 1, 2, 7], [4, 5, 6, 9], coalesce=False)
    assert len(p.kv) == 8
    assert sum(b.length for b in p.kv) == 8 * PAGE


def test_decode_tp_larger_sends_head_slices() -> None:
    spec = make_spec({"tp": 1}, {"tp": 2})
    half = 2 * HEAD  # decode pages hold 2 heads
    _, p = plan(spec, 0, 0, 1, [0, 1], [5, 6])
    v_src, v_dst = 16 * PAGE, 16 * half
    assert p.kv == [
        Block(SRC.kv + 0 * PAGE + 2 * HEAD, DST.kv + 5 * half, 2 * HEAD),
        Block(SRC.kv + 1 * PAGE + 2 * HEAD, DST.kv + 6 * half, 2 * HEAD),
        Block(SRC.kv + v_src + 0 * PAGE + 2 * HEAD, DST.kv + v_dst + 5 * half, 2 * HEAD),
        Block(SRC.kv + v_src + 1 * PAGE + 2 * HEAD, DST.kv + v_dst + 6 * half, 2 * HEAD),
    ]


def test_decode_tp_smaller_writes_into_its_head_offset() -> None:
    spec = make_spec({"tp": 2}, {"tp": 1})
    half = 2 * HEAD
    _, p = plan(spec, 1, 0, 0, [3], [8])
    assert p.kv[0] == Block(SRC.kv + 3 * half, DST.kv + 8 * PAGE + 2 * HEAD, 2 * HEAD)
    # State and aux come from the primary source (prefill rank 0) only.
    assert (p.state, p.aux) == ([], [])
    _, p0 = plan(spec, 0, 0, 0, [3], [8])
    assert p0.state and p0.aux


@pytest.mark.parametrize(
    ("prefill", "cp_rank", "pages", "state_layers", "skipped"),
    [
        ({"cp": 4, "allCpRanksTransfer": True}, 0, range(0, 2), range(0, 2), 0),
        ({"cp": 4, "allCpRanksTransfer": True}, 2, range(4, 6), range(0), 64),
        ({"cp": 2, "dsaCacheLayerSplit": True}, 1, range(5, 10), range(1, 2), 0),
        ({"cp": 2, "dsaCacheLayerSplit": True}, 0, range(0, 5), range(0, 1), 0),
    ],
    ids=["cp4-rank0-state", "cp4-rank2-dedup", "split-rank1-own-layer", "split-rank0-own-layer"],
)
def test_cp_duties(prefill: dict[str, Any], cp_rank: int, pages: range, state_layers: range, skipped: int) -> None:
    spec = make_spec(prefill)
    route = decode_targets(spec, 0)[0]
    duties = sender_duties(spec, route, cp_rank, 10 if "dsaCacheLayerSplit" in prefill else 8)
    assert duties is not None
    assert (duties.pages, duties.state_layers, duties.send_aux) == (pages, state_layers, cp_rank == 0)
    n = len(duties.pages)
    _, p = plan(spec, 0, cp_rank, 0, list(range(n)), list(range(10 if "dsaCacheLayerSplit" in prefill else 8)))
    assert p.state_skipped_bytes == skipped
    assert sum(b.length for b in p.state) == 32 * len(state_layers)


def test_non_sending_cp_rank_has_no_duties() -> None:
    spec = make_spec({"cp": 4})
    assert sender_duties(spec, decode_targets(spec, 0)[0], 1, 8) is None


@pytest.mark.parametrize(
    ("transfer", "path"),
    [
        ({}, AuxPath.ENGINE),
        ({"memPool": "INTRA_NODE_NVLINK"}, AuxPath.ENGINE),  # the substring trap: must stay on the engine
        ({"memPool": "NVLINK"}, AuxPath.TCP),
        ({"auxOverTcp": True}, AuxPath.TCP),
    ],
    ids=["default", "intra-node-nvlink-engine", "nvlink-tcp", "flag-tcp"],
)
def test_aux_blocks_follow_the_aux_path(transfer: dict[str, Any], path: AuxPath) -> None:
    spec = make_spec(**transfer)
    duties, p = plan(spec, 0, 0, 0, [0], [0])
    assert duties.aux_path is path
    engine = [Block(SRC.aux + 8, DST.aux + 24, 8), Block(SRC.aux + 32 + 16, DST.aux + 32 + 48, 16)]
    tcp = [(b.src, b.dst, b.length) for b in engine]  # the same rows, by address
    assert (p.aux, p.aux_tcp) == ((engine, []) if path is AuxPath.ENGINE else ([], tcp))


@pytest.mark.parametrize(
    ("prefill", "decode", "d", "stage", "expected"),
    [
        ({"tp": 2}, {"tp": 4}, 3, 0, [(1, 0, 0)]),
        ({"tp": 4}, {"tp": 2}, 1, 0, [(2, 0, 0), (3, 0, 0)]),
        ({"cp": 4}, {}, 0, 0, [(0, 0, 0)]),
        ({"cp": 4, "allCpRanksTransfer": True}, {}, 0, 0, [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0)]),
        ({"pp": 2}, {}, 0, 0, [(0, 0, 0), (0, 0, 1)]),
        ({"pp": 2}, {"pp": 2}, 0, 1, [(0, 0, 1)]),
    ],
    ids=["decode-more", "decode-fewer", "cp-rank0-only", "cp-all-ranks", "pp2-into-pp1", "pp2-stage-to-stage"],
)
def test_expected_sources(
    prefill: dict[str, Any], decode: dict[str, Any], d: int, stage: int, expected: list[tuple[int, int, int]]
) -> None:
    assert expected_sources(make_spec(prefill, decode), d, stage) == expected


@pytest.mark.parametrize(
    ("decode", "stage", "offset", "rows"),
    [({}, 0, 0, False), ({}, 1, 1, True), ({"pp": 2}, 0, 0, False), ({"pp": 2}, 1, 0, True)],
    ids=["pp1-decode-stage0", "pp1-decode-stage1-shifted", "pp2-stage0", "pp2-stage1-local-numbering"],
)
def test_pp_stage_duties(decode: dict[str, Any], stage: int, offset: int, rows: bool) -> None:
    spec = make_spec({"pp": 2}, decode, layers=2)
    duties = sender_duties(spec, decode_targets(spec, 0)[0], 0, 4, stage)
    assert duties is not None
    assert (duties.dst_layer_offset, duties.send_aux, bool(duties.state_layers)) == (offset, rows, rows)


def test_pp_stage_writes_into_its_decode_layers() -> None:
    spec = make_spec({"pp": 2}, {}, layers=2)
    duties = sender_duties(spec, decode_targets(spec, 0)[0], 0, 1, 1)
    assert duties is not None
    src_layout = PoolLayout.from_geometry(spec.model, 1, kv_pages=16, state_slots=4, aux_slots=4, pp=2, pp_stage=1)
    p = plan_transfer(duties, TransferSide(src_layout, SRC, [0], [0], 1), TransferSide(layout(spec, 1), DST, [5], [2], 3))  # fmt: skip
    # The stage holds one layer (its local layer 0 = global layer 1): K and V land in decode layer 1.
    assert p.kv == [
        Block(SRC.kv, DST.kv + (2 * 16 + 5) * PAGE, PAGE),
        Block(SRC.kv + 16 * PAGE, DST.kv + (3 * 16 + 5) * PAGE, PAGE),
    ]


def test_source_page_count_must_match_the_shard() -> None:
    spec = make_spec({"cp": 2, "allCpRanksTransfer": True})
    with pytest.raises(ValueError, match=r"sends request pages 3\.\.5"):
        plan(spec, 0, 1, 0, [1, 2], [0, 1, 2, 3, 4, 5])


def test_duties_are_core_s_the_ones_the_traffic_prediction_sums() -> None:
    """The agent plans from the duties in pdfabric_core.duties (the status prediction's source);
    the old names stay importable from here."""
    from pdfabric_agent.memory import plan as agent_plan
    from pdfabric_core import duties

    for name in ("Duties", "decode_targets", "sender_duties", "expected_sources", "receives_request_rows"):
        assert getattr(agent_plan, name) is getattr(duties, name)
    assert agent_plan.routes_for_decode is duties.routes_for_decode
