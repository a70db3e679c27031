"""The planner on a scale step of a running cluster that the nodes cannot take in full (issue 40):
every running unit stays where it is, what fits of the step is placed and the rest is reported
as a shortfall; a cluster that does not run yet stays all-or-nothing."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from pdfabric_core.rankmap import Rank
from pdfabric_operator.placement import GpuNode, Placement, PlacementFailure, PlacementReason, Shortfall
from pdfabric_operator.planner import placed_spec, plan_placement
from tests.builders import gpu_node, pdcluster

UID = "uid-1"


def _tcp(prefill: int, decode: int) -> Any:
    return pdcluster().transport("tcp").prefill(replicas=prefill).decode(replicas=decode)


def _running(builder: Any, nodes: list[GpuNode]) -> Placement:
    placed = plan_placement(builder.spec(), nodes, [], cluster_uid=UID)
    assert isinstance(placed, Placement) and placed.shortfall is None, placed
    return placed


def _previous(placed: Placement) -> dict[str, tuple[Rank, ...]]:
    return placed.ranks_by_node()


def test_decode_one_past_capacity_keeps_every_unit_and_places_no_extra() -> None:
    nodes = [gpu_node(n, 1) for n in "abcd"]
    before = _running(_tcp(1, 3), nodes)
    over = _tcp(1, 4).spec()
    result = plan_placement(over, nodes, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, Placement), result
    assert result.agents == before.agents, "every running pod stays on its node with its ranks"
    assert result.feeds == before.feeds
    short = result.shortfall
    assert short is not None
    assert (short.prefill_asked, short.decode_asked, short.prefill_placed, short.decode_placed) == (1, 4, 1, 3)
    assert short.reason is PlacementReason.INSUFFICIENT_GPUS and "0 free" in short.message
    assert short.words.startswith("3 of 4 decode replicas placed: ")
    assert placed_spec(over, result) == _tcp(1, 3).spec(), "children are built for the replicas placed"
    # The same spec for a cluster that does not run yet: all or nothing, as before.
    fresh = plan_placement(over, nodes, [], cluster_uid=UID)
    assert isinstance(fresh, PlacementFailure) and fresh.reason is PlacementReason.INSUFFICIENT_GPUS


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1024), (1024, 3), (1024, 1024)])
def test_a_step_to_1024_replicas_plans_in_milliseconds_and_changes_nothing(prefill: int, decode: int) -> None:
    nodes = [gpu_node(n, 1) for n in "abcd"]
    before = _running(_tcp(1, 3), nodes)
    # CPU time of this thread, not wall time: CI runs this beside real servers that take the cores
    # (stop 54 measured 0.6 s of wall time for what takes 0.03 s on a quiet machine).
    # The garbage collector is off meanwhile: a full collection of a worker's heap after two
    # thousand tests (0.5 s in CI at stop 56's run 23) is not the planner's cost.
    gc.collect()
    gc.disable()
    try:
        started = time.thread_time()
        result = plan_placement(_tcp(prefill, decode).spec(), nodes, [], cluster_uid=UID, previous=_previous(before))
        took = time.thread_time() - started
    finally:
        gc.enable()
    assert isinstance(result, Placement) and result.shortfall is not None, result
    assert result.agents == before.agents
    assert (result.shortfall.prefill_placed, result.shortfall.decode_placed) == (1, 3)
    assert took < 0.5, f"planning {prefill}/{decode} replicas took {took:.3f} s of CPU"


def test_a_step_places_what_fits_of_it() -> None:
    nodes = [gpu_node(n, 1) for n in "abcdef"]
    before = _running(_tcp(1, 3), nodes)
    result = plan_placement(_tcp(2, 8).spec(), nodes, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, Placement) and result.shortfall is not None
    # Decode grows first (the role scaled most often), then prefill with what is left: none.
    assert (result.shortfall.prefill_placed, result.shortfall.decode_placed) == (1, 5)
    kept = {a.unit: a for a in before.agents}
    assert all(kept[a.unit] == a for a in result.agents if a.unit in kept), "running units stay put"
    assert sorted(a.unit for a in result.agents) == ["decode-0", "decode-1", "decode-2", "decode-3", "decode-4",
                                                     "prefill-0"]  # fmt: skip


def test_node_loss_shrinks_the_cluster_instead_of_removing_it() -> None:
    nodes = [gpu_node(n, 1) for n in "abcde"]
    before = _running(_tcp(1, 4), nodes)
    where = {a.unit: a.node for a in before.agents}
    for lost_unit in ("decode-1", "prefill-0"):
        lost = where[lost_unit]
        after = [gpu_node(n, 1, ready=n != lost) for n in "abcde"]
        result = plan_placement(_tcp(1, 4).spec(), after, [], cluster_uid=UID, previous=_previous(before))
        assert isinstance(result, Placement), (lost_unit, result)
        assert result.shortfall is not None and result.shortfall.decode_placed == 3, lost_unit
        assert lost not in {a.node for a in result.agents}
        moved = {a.unit for a in result.agents if where.get(a.unit) != a.node}
        # Only what sat on the lost node moves (prefill takes the last decode's node); decode-3 waits.
        assert moved == ({"prefill-0"} if lost_unit == "prefill-0" else {"decode-1"}), (lost_unit, moved)
        assert "decode-3" not in {a.unit for a in result.agents}


def test_every_node_lost_is_still_not_placed() -> None:
    nodes = [gpu_node(n, 1) for n in "abcd"]
    before = _running(_tcp(1, 3), nodes)
    gone = [gpu_node(n, 1, ready=False) for n in "abcd"]
    result = plan_placement(_tcp(1, 4).spec(), gone, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, PlacementFailure) and result.reason is PlacementReason.NO_GPU_NODES


def test_intra_node_groups_grow_and_shrink_whole() -> None:
    def groups(prefill: int) -> Any:  # each group: a prefill replica and the 2 decode replicas it feeds
        return pdcluster().transport("nvlink-intra").prefill(replicas=prefill).decode(replicas=2 * prefill)

    nodes = [gpu_node(n, 3) for n in "ab"] + [gpu_node("c", 2)]
    before = _running(groups(2), nodes)
    result = plan_placement(groups(4).spec(), nodes, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, Placement), result
    assert result.agents == before.agents and result.shortfall is not None
    assert (result.shortfall.prefill_placed, result.shortfall.decode_placed) == (2, 4)
    assert result.shortfall.reason is PlacementReason.NO_NODE_FOR_INTRA_NODE_GROUP
    lost = [gpu_node("a", 3, ready=False), gpu_node("b", 3), gpu_node("c", 2)]
    shrunk = plan_placement(groups(2).spec(), lost, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(shrunk, Placement) and shrunk.shortfall is not None
    assert (shrunk.shortfall.prefill_placed, shrunk.shortfall.decode_placed) == (1, 2)
    assert [a.node for a in shrunk.agents] == ["b"]


def test_the_requested_transport_keeps_running_when_the_fallback_places_no_more() -> None:
    rdma = pdcluster().transport("rdma").placement(fallback="TCP")
    nodes = [gpu_node(n, 1, rdma=1) for n in "abc"]
    before = _running(rdma.prefill(replicas=1).decode(replicas=2), nodes)
    result = plan_placement(rdma.decode(replicas=3).spec(), nodes, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, Placement) and not result.is_fallback, result
    assert result.agents == before.agents and result.shortfall is not None
    assert result.fallback_reason is None


def test_a_cluster_on_the_declared_fallback_stays_on_it() -> None:
    rdma = pdcluster().transport("rdma").placement(fallback="TCP")
    nodes = [gpu_node(n, 1) for n in "abc"]  # no RDMA anywhere: tcp by the declared fallback
    before = _running(rdma.prefill(replicas=1).decode(replicas=2), nodes)
    assert before.is_fallback
    result = plan_placement(rdma.decode(replicas=3).spec(), nodes, [], cluster_uid=UID, previous=_previous(before))
    assert isinstance(result, Placement) and result.is_fallback, result
    assert result.agents == before.agents
    assert result.fallback_reason and "NoRDMANodes" in result.fallback_reason
    assert result.shortfall == Shortfall(1, 3, 1, 2, PlacementReason.NO_RDMA_NODES, result.shortfall.message)
