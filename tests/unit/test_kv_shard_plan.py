"""MLA KV cache sharding through the spec, the duties, the planner, the prediction and the decode
side's completion (``spec.prefill.kvCacheSharding``; the owner rule itself: test_kv_shard.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Bases, TransferSide, plan_transfer
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.rooms.landing import check_owed, unwritten_positions
from pdfabric_agent.rooms.room import DecodeRoom
from pdfabric_core.duties import PairDuties, decode_targets, expected_sources, pair_duties, replica_duties
from pdfabric_core.policy.kv_shard import owned_pages
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_core.traffic import duty_bytes, estimate_traffic, pair_traffic

MLA = {"layers": 2, "kvKind": "MLA", "kvLoraRank": 16, "qkRopeHeadDim": 8, "dtype": "float32", "pageSizeTokens": 4}
PAGE = 4 * 24 * 4
SRC = [3, 4, 9, 6, 11, 8, 13]  # logical pages: rank 1 owns positions 0, 2, 4, 6; rank 0 positions 1, 3, 5
DST = [7, 2, 5, 1, 3, 6, 4]


def spec(tp: int = 2, *, model: dict[str, Any] | None = None, **prefill: Any) -> PDClusterSpec:
    return parse_spec(
        {"prefill": {"tp": tp, "kvCacheSharding": True, **prefill}, "decode": {"tp": tp}, "model": model or MLA}
    )


# ---------------------------------------------------------------- the spec
@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"model": {**MLA, "kvKind": "MHA", "kvHeads": 2, "headDim": 8}}, "needs model.kvKind MLA"),
        ({"prefill": {"cp": 2}}, "prefill.cp 2"),
        ({"decode": {"tp": 1}}, "equal prefill and decode attention TP"),
        ({"model": {**MLA, "stateBytesPerRequest": 64}}, "state under KV cache sharding"),
        ({"model": {**MLA, "draftLayers": 1}}, "draftLayers"),
    ],
    ids=["gqa", "prefill-cp", "tp-mismatch", "state", "draft"],
)
def test_what_is_not_moved_sharded_is_refused_naming_the_field(raw: dict[str, Any], named: str) -> None:
    body: dict[str, Any] = {"prefill": {"tp": 2, "kvCacheSharding": True}, "decode": {"tp": 2}, "model": MLA}
    for section, values in raw.items():
        body[section] = {**body[section], **values}
    with pytest.raises(SpecError, match=named):
        parse_spec(body)


def test_the_crd_carries_the_field_and_its_cel_rules() -> None:
    crd = (Path(__file__).parents[2] / "crds" / "pdcluster.yaml").read_text()
    assert "kvCacheSharding:" in crd
    assert crd.count("!self.prefill.kvCacheSharding ||") == 2
    assert spec().prefill.kv_cache_sharding and not parse_spec({"model": MLA}).prefill.kv_cache_sharding


# ---------------------------------------------------------------- duties and plan
def test_every_prefill_rank_sends_every_decode_rank_and_the_lowest_the_aux_row() -> None:
    s = spec(4)
    for p in range(4):
        assert [r.decode_tp_rank for r in decode_targets(s, p)] == [0, 1, 2, 3]
        assert all(r.whole_page for r in decode_targets(s, p))
    for d in range(4):
        assert expected_sources(s, d) == [(p, 0, 0) for p in range(4)]
        for p in range(4):
            duties = pair_duties(s, p, 0, 0, d, len(SRC))
            assert duties is not None
            assert (duties.kv_shard_size, duties.kv_shard_rank, duties.pages) == (4, p, range(len(SRC)))
            assert duties.send_aux == (p == 0)
    # Without the option MLA decode takes the latent from one prefill rank (1:1 at equal TP).
    plain = parse_spec({"prefill": {"tp": 4}, "decode": {"tp": 4}, "model": MLA})
    assert [r.decode_tp_rank for r in decode_targets(plain, 2)] == [2]
    assert pair_duties(plain, 2, 0, 0, 2, 3).kv_shard_size == 1  # type: ignore[union-attr]


def layout(s: PDClusterSpec, pages: int) -> PoolLayout:
    return PoolLayout.from_geometry(s.model, s.prefill.tp, kv_pages=pages, state_slots=1, aux_slots=4)


def test_each_rank_plans_its_owned_positions_from_its_local_pages_and_together_every_page_once() -> None:
    s = spec()
    src_layout, dst_layout = layout(s, 8), layout(s, 8)
    src, dst = Bases(0, 1 << 20, 1 << 21), Bases(1 << 24, 1 << 25, 1 << 26)
    seen: list[int] = []
    for p in range(2):
        duties = pair_duties(s, p, 0, 0, 1, len(SRC))
        assert duties is not None
        plan = plan_transfer(
            duties,
            TransferSide(src_layout, src, SRC, [], 0),
            TransferSide(dst_layout, dst, DST, [], 2),
            coalesce=False,
        )
        owned = owned_pages(SRC, p, 2)
        assert plan.kv_positions == owned.positions == ((1, 3, 5) if p == 0 else (0, 2, 4, 6))
        assert plan.kv_pages is not None
        assert list(plan.kv_pages.src_pages) == [page // 2 for page in SRC if page % 2 == p]
        assert list(plan.kv_pages.dst_pages) == [DST[i] for i in owned.positions]
        assert sum(b.length for b in plan.kv) == len(owned.positions) * 2 * PAGE  # two layers
        src_page = {b.src for b in plan.kv}
        assert src_page == {src.kv + layer * 8 * PAGE + page * PAGE for layer in range(2) for page in owned.local}
        assert bool(plan.aux) == (p == 0)
        seen += plan.kv_positions
    assert sorted(seen) == list(range(len(SRC)))


def test_a_logical_page_past_the_owners_pool_is_refused() -> None:
    s = spec()
    duties = pair_duties(s, 1, 0, 0, 0, 2)
    assert duties is not None
    with pytest.raises(ValueError, match="local page 8 of shard rank 1, past its pool of 8 pages"):
        plan_transfer(
            duties, TransferSide(layout(s, 8), Bases(0, 0, 0), [3, 17], [], None),
            TransferSide(layout(s, 8), Bases(1 << 24, 0, 0), [1, 2], [], None),
        )  # fmt: skip


def test_the_prediction_gives_every_decode_rank_every_page_and_splits_the_sources() -> None:
    s, plain = spec(4), parse_spec({"prefill": {"tp": 4}, "decode": {"tp": 4}, "model": MLA})
    pages = 10
    pairs = pair_traffic(s, pages)
    assert len(pairs) == 16 and len(replica_duties(s, pages)) == 16
    for d in range(4):
        assert sum(b.kv for (_, dst), b in pairs.items() if dst == (d, 0)) == pages * 2 * PAGE
        # 10 pages over 4 owners, drawn cyclically from owner 0: 3, 3, 2, 2.
        assert [pairs[((p, 0, 0), (d, 0))].kv // (2 * PAGE) for p in range(4)] == [3, 3, 2, 2]
    sharded, whole = estimate_traffic(s, 40 * 4), estimate_traffic(plain, 40 * 4)
    assert sharded.kv_bytes == whole.kv_bytes == 4 * 40 * 2 * PAGE
    assert sharded.aux_bytes == whole.aux_bytes
    assert sharded.max_decode_rank_bytes == whole.max_decode_rank_bytes


@pytest.mark.parametrize("pages", [0, 1, 5, 8, 13])
def test_the_prediction_is_what_the_planner_plans_for_a_cyclic_draw_from_owner_0(pages: int) -> None:
    """The status's per-pair bytes are the plan's when logical page i is owned by i % N."""
    s = spec(4)
    logical = list(range(4, 4 + pages))  # page 4 + i: owner i % 4, local page 1 + i // 4
    for d in replica_duties(s, pages):
        plan = plan_transfer(
            d.duties,
            TransferSide(layout(s, 8), Bases(0, 1 << 20, 1 << 21), logical, [], 0),
            TransferSide(layout(s, 16), Bases(1 << 24, 1 << 25, 1 << 26), list(range(pages)), [], 1),
        )
        want = duty_bytes(s, PairDuties(d.prefill_tp_rank, 0, 0, d.decode_tp_rank, 0, d.duties))
        assert (sum(b.length for b in plan.kv), sum(b.length for b in plan.aux)) == (want.kv, want.aux)


# ---------------------------------------------------------------- the decode side's completion
def room(sharded: bool = True) -> DecodeRoom:
    per_page = {"kv": 2 * PAGE, "state": 0, "aux": 0}
    return DecodeRoom(
        rank="decode-0-tp0", room=9, submitted=0.0, deadline=1.0, dst_pages=list(DST), dst_state=[], dst_aux=None,
        expected={"prefill-0-tp0-cp0": "a", "prefill-0-tp1-cp0": "b"},
        owed={"prefill-0-tp0-cp0": per_page, "prefill-0-tp1-cp0": per_page}, sharded=sharded,
    )  # fmt: skip


def kv(pages: int) -> dict[str, dict[str, int]]:
    return {"mooncake": {"kv": pages * 2 * PAGE, "state": 0, "aux": 0}}


def test_a_sources_report_is_held_to_the_positions_it_names() -> None:
    r = room()
    check_owed(r, "prefill-0-tp0-cp0", kv(3), (1, 3, 5))
    with pytest.raises(ApiError, match="expects"):
        check_owed(r, "prefill-0-tp0-cp0", kv(2), (1, 3, 5))  # bytes of two pages for three positions
    with pytest.raises(ApiError, match="must name its kv_positions"):
        check_owed(r, "prefill-0-tp0-cp0", kv(3), None)
    with pytest.raises(ApiError, match=r"must rise within 0\.\.6"):
        check_owed(r, "prefill-0-tp0-cp0", kv(2), (3, 1))
    with pytest.raises(ApiError, match=r"must rise within 0\.\.6"):
        check_owed(r, "prefill-0-tp0-cp0", kv(1), (7,))
    r.positions["prefill-0-tp1-cp0"] = (0, 2, 4, 6)
    with pytest.raises(ApiError, match=r"positions \[2\] of room 9, another source's"):
        check_owed(r, "prefill-0-tp0-cp0", kv(2), (1, 2))
    with pytest.raises(ApiError, match="not KV-sharded"):
        check_owed(room(sharded=False), "prefill-0-tp0-cp0", kv(1), (1,))


def test_a_room_is_complete_only_when_every_position_came_once() -> None:
    r = room()
    r.positions = {"prefill-0-tp0-cp0": (1, 3), "prefill-0-tp1-cp0": (0, 2, 4, 6)}
    assert unwritten_positions(r) == "no source of the KV-sharded room wrote its pages at positions [5]"
    r.positions["prefill-0-tp0-cp0"] = (1, 3, 5, 6)
    assert "more than one source wrote positions [6]" in unwritten_positions(r)
    r.positions["prefill-0-tp0-cp0"] = (1, 3, 5)
    assert unwritten_positions(r) == ""


def test_done_reports_carry_their_positions_over_the_wire() -> None:
    report = DoneReport(9, "decode-0-tp0", "prefill-0-tp1-cp0", kv(4), ok=True, kv_positions=(0, 2, 4, 6))
    assert DoneReport.parse(report.to_json()) == report
    plain = dataclasses.replace(report, kv_positions=None)
    assert "kv_positions" not in plain.to_json() and DoneReport.parse(plain.to_json()) == plain
    with pytest.raises(ApiError, match="repeat"):
        DoneReport.parse({**report.to_json(), "kv_positions": [1, 1]})


# ---------------------------------------------------------------- the registration
def test_the_engines_shard_group_must_be_the_specs(tmp_path: Path) -> None:
    """A prefill engine that stripes its pages (SGLang's parallel state, read by the plugin) must
    run under a spec that says so, and the reverse; decode never shards."""
    from pdfabric_refengine import KVPool, kv_args
    from pdfabric_sglang.kvargs import registration
    from sglang.srt.runtime_context import get_parallel

    from pdfabric_agent.protocol.memory_registration import MemoryRegistration
    from pdfabric_agent.ranks.engine_memory import MemoryRules, engine_layout
    from pdfabric_core.policy.types import MemPool, Role, Transport
    from pdfabric_core.rankmap import Rank

    rules = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)
    pool = KVPool(layers=2, local_heads=1, head_dim=24, num_pages=4, page_size=4, shm_dir=str(tmp_path), mla=True)
    try:
        args = kv_args(pool, engine_rank=1, page_size=4, kv_head_num=1, total_kv_head_num=1)
        with get_parallel().override(enable_kv_cache_sharding=True, attn_tp_size=2, attn_cp_size=1):
            reg = registration("prefill-0-tp1-cp0", args, is_mla=True, gpu=None, aux_inline=True)
        assert reg.kv_shard_size == 2 and MemoryRegistration.parse(reg.to_json()).kv_shard_size == 2
        prefill, decode = Rank(Role.PREFILL, 0, 1), Rank(Role.DECODE, 0, 1)
        sharded, plain = spec(), parse_spec({"prefill": {"tp": 2}, "decode": {"tp": 2}, "model": MLA})
        assert engine_layout(reg, sharded, prefill, rules).kv_pages == 4
        with pytest.raises(ApiError, match=r"set spec\.prefill\.kvCacheSharding to match"):
            engine_layout(reg, plain, prefill, rules)
        unsharded = dataclasses.replace(reg, kv_shard_size=1)
        with pytest.raises(ApiError, match="holds 1 / 2 of them"):
            engine_layout(unsharded, sharded, prefill, rules)
        assert engine_layout(unsharded, sharded, decode, rules).kv_pages == 4
    finally:
        pool.close()
