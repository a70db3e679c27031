"""The planner: transport-specific placement, capacity across clusters, stickiness, precise failures."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_core.policy.types import Transport
from pdfabric_core.rankmap import Rank
from pdfabric_operator.placement import AgentPlacement, PlacedPod, Placement, PlacementFailure, PlacementReason
from pdfabric_operator.planner import plan_placement, usable_nodes
from pdfabric_operator.scheduling import Taint
from tests.builders import busy, gpu_node, pdcluster

UID = "uid-1"


def _layout(result: Placement) -> dict[str, list[str]]:
    return {a.node: [r.rank_id for r in a.ranks] for a in result.agents}


def _gpus(result: Placement) -> dict[str, int]:
    """GPUs placed per node, over the node's pods."""
    out: dict[str, int] = {}
    for a in result.agents:
        out[a.node] = out.get(a.node, 0) + a.gpus
    return out


# (id, builder, nodes, placed pods, expected node -> GPUs)
PLACED_CASES = [
    (
        "tcp-single-node-best-fit",
        pdcluster().prefill(tp=2).decode(tp=2),
        [gpu_node("a", 8), gpu_node("b", 4)],
        [],
        {"b": 4},
    ),
    (
        "tcp-other-cluster-capacity-counted",
        pdcluster().prefill(tp=4).decode(tp=4),
        [gpu_node("a", 8), gpu_node("b", 8)],
        [busy("a", 6)],
        {"b": 8},
    ),
    (
        "tcp-replica-split-when-no-node-fits",
        pdcluster().prefill(tp=8, replicas=1).decode(tp=1),
        [gpu_node("a", 4), gpu_node("b", 6)],
        [],
        {"a": 3, "b": 6},
    ),
    (
        "rdma-only-rdma-nodes",
        pdcluster().transport("rdma").prefill(tp=2).decode(tp=2),
        [gpu_node("plain", 8), gpu_node("r1", 8, rdma=4)],
        [],
        {"r1": 4},
    ),
    (
        "nvlink-intra-group-on-one-node",
        pdcluster().transport("nvlink-intra").prefill(replicas=2, tp=2).decode(replicas=4, tp=1),
        [gpu_node("a", 4), gpu_node("b", 4), gpu_node("c", 8)],
        [],
        {"a": 4, "b": 4},
    ),
    (
        "nvlink-one-clique",
        pdcluster().transport("nvlink").prefill(replicas=2, tp=4).decode(replicas=2, tp=4),
        [gpu_node("x1", 8, clique="x"), gpu_node("y1", 8, clique="y"), gpu_node("y2", 8, clique="y")],
        [],
        {"y1": 8, "y2": 8},
    ),
    (
        "tcp-leaves-rdma-and-nvlink-nodes-free",
        pdcluster().prefill(tp=4).decode(tp=4),
        [gpu_node("a-rdma", 8, rdma=1), gpu_node("b-clique", 8, clique="x"), gpu_node("c-plain", 8)],
        [],
        {"c-plain": 8},
    ),
    (
        "best-fit-beats-scarcity",
        pdcluster().prefill(tp=2).decode(tp=2),
        [gpu_node("a-rdma", 4, rdma=1), gpu_node("c-plain", 8)],
        [],
        {"a-rdma": 4},
    ),
    (
        "node-selector-honoured",
        pdcluster().placement(nodeSelector={"pool": "pd"}),
        [gpu_node("a", 8), gpu_node("b", 8, labels={"pool": "pd"})],
        [],
        {"b": 2},
    ),
    (
        "not-ready-and-cordoned-skipped",
        pdcluster(),
        [gpu_node("a", 8, ready=False), gpu_node("b", 8, schedulable=False), gpu_node("c", 8)],
        [],
        {"c": 2},
    ),
    (
        "untolerated-noschedule-and-noexecute-skipped",
        pdcluster(),
        [
            gpu_node("a", 8, taints=(Taint("dedicated", "training", "NoSchedule"),)),
            gpu_node("b", 8, taints=(Taint("maintenance", "", "NoExecute"),)),
            gpu_node("c", 8),
        ],
        [],
        {"c": 2},
    ),
    (
        "gpu-taint-tolerated-prefer-no-schedule-ignored",
        pdcluster(),
        [
            gpu_node("a", 4, taints=(Taint("nvidia.com/gpu", "present", "NoSchedule"),)),
            gpu_node("b", 2, taints=(Taint("soft", "", "PreferNoSchedule"),)),
        ],
        [],
        {"b": 2},
    ),
    (
        "users-toleration-lets-a-tainted-node-in",
        pdcluster().agent(pod={"tolerations": [{"key": "dedicated", "operator": "Exists"}]}),
        [gpu_node("a", 4, taints=(Taint("dedicated", "inference", "NoSchedule"),)), gpu_node("b", 8)],
        [],
        {"a": 2},
    ),
    (
        "users-required-node-affinity-honoured",
        pdcluster().agent(
            pod={
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}
                            ]
                        }
                    }
                }
            }
        ),
        [gpu_node("a", 4, labels={"zone": "a"}), gpu_node("b", 8, labels={"zone": "b"})],
        [],
        {"b": 2},
    ),
    (
        "own-pods-do-not-block-replan",
        pdcluster().prefill(tp=4).decode(tp=4),
        [gpu_node("a", 8)],
        [PlacedPod("a", {"nvidia.com/gpu": 8}, UID)],
        {"a": 8},
    ),
]


@pytest.mark.parametrize(
    ("builder", "nodes", "placed", "expected"), [c[1:] for c in PLACED_CASES], ids=[c[0] for c in PLACED_CASES]
)
def test_placement_uses_expected_nodes(builder, nodes, placed, expected) -> None:
    result = plan_placement(builder.spec(), nodes, placed, cluster_uid=UID)
    assert isinstance(result, Placement), result
    assert _gpus(result) == expected
    assert not result.is_fallback


# (id, builder, nodes, placed pods, reason, fragment of the message)
FAILURE_CASES = [
    ("no-nodes", pdcluster(), [], [], "NoGPUNodes", "add GPU nodes"),
    (
        "too-few-gpus",
        pdcluster().prefill(replicas=2, tp=8).decode(tp=8),
        [gpu_node("a", 8), gpu_node("b", 8)],
        [],
        "InsufficientGPUs",
        "needs 8 GPUs but ready nodes have 0 free",
    ),
    (
        "other-cluster-holds-the-gpus",
        pdcluster().prefill(tp=4).decode(tp=4),
        [gpu_node("a", 8)],
        [busy("a", 4)],
        "InsufficientGPUs",
        "have 0 free",
    ),
    (
        "no-rdma-nodes",
        pdcluster().transport("rdma"),
        [gpu_node("a", 8), gpu_node("b", 8)],
        [],
        "NoRDMANodes",
        "allocatable rdma/hca",
    ),
    (
        "rdma-resource-all-taken",
        pdcluster().transport("rdma"),
        [gpu_node("a", 8, rdma=1)],
        [PlacedPod("a", {"rdma/hca": 1}, "other")],
        "NoRDMANodes",
        "fully requested",
    ),
    (
        "no-nvlink-domain-label",
        pdcluster().transport("nvlink"),
        [gpu_node("a", 8)],
        [],
        "NoNVLinkDomain",
        "nvidia.com/gpu.clique",
    ),
    (
        "nvlink-domain-too-small",
        pdcluster().transport("nvlink").prefill(replicas=2, tp=8).decode(tp=8),
        [gpu_node("x1", 8, clique="x"), gpu_node("x2", 8, clique="x"), gpu_node("y1", 8, clique="y")],
        [],
        "NVLinkDomainTooSmall",
        "needs all 24 GPUs inside one NVLink domain",
    ),
    (
        "intra-node-group-does-not-fit",
        pdcluster().transport("nvlink-intra").prefill(tp=4).decode(tp=4),
        [gpu_node("a", 8), gpu_node("b", 8)],
        [busy("a", 2), busy("b", 1)],
        "NoNodeForIntraNodeGroup",
        "needs 8 free GPUs on one node",
    ),
    (
        "only-node-tainted",
        pdcluster(),
        [gpu_node("a", 8, taints=(Taint("dedicated", "training", "NoSchedule"),))],
        [],
        "NoGPUNodes",
        "(leaving out 1 with a taint the node pods do not tolerate: a dedicated=training:NoSchedule)",
    ),
    (
        "selector-matches-nothing",
        pdcluster().placement(nodeSelector={"pool": "none"}),
        [gpu_node("a", 8)],
        [],
        "NoGPUNodes",
        "relax placement.nodeSelector",
    ),
]


@pytest.mark.parametrize(
    ("builder", "nodes", "placed", "reason", "fragment"),
    [c[1:] for c in FAILURE_CASES],
    ids=[c[0] for c in FAILURE_CASES],
)
def test_unplaceable_reports_reason(builder, nodes, placed, reason, fragment) -> None:
    result = plan_placement(builder.spec(), nodes, placed, cluster_uid=UID)
    assert isinstance(result, PlacementFailure), result
    assert result.reason is PlacementReason(reason)
    assert fragment in result.message


def test_every_placement_reason_has_a_failure_case() -> None:
    # The metric pre-creates a series per PlacementReason; each must be reachable.
    assert {c[4] for c in FAILURE_CASES} == {r.value for r in PlacementReason}


def test_declared_tcp_fallback_is_flagged() -> None:
    spec = pdcluster().transport("rdma").placement(fallback="TCP").spec()
    result = plan_placement(spec, [gpu_node("a", 8)], [], cluster_uid=UID)
    assert isinstance(result, Placement)
    assert result.transport is Transport.TCP
    assert result.requested_transport is Transport.RDMA
    assert result.is_fallback
    assert result.fallback_reason is not None and result.fallback_reason.startswith("NoRDMANodes")


def test_fallback_that_does_not_fit_reports_both() -> None:
    spec = pdcluster().transport("rdma").placement(fallback="TCP").prefill(tp=8).decode(tp=8).spec()
    result = plan_placement(spec, [gpu_node("a", 8)], [], cluster_uid=UID)
    assert isinstance(result, PlacementFailure)
    assert result.reason == "NoRDMANodes"
    assert "TCP fallback does not fit either" in result.message


def test_nvlink_pair_stays_in_one_clique() -> None:
    spec = pdcluster().transport("nvlink").prefill(replicas=2, tp=4).decode(replicas=2, tp=4).spec()
    nodes = [gpu_node(f"{d}{i}", 8, clique=d) for d in "xy" for i in range(2)]
    result = plan_placement(spec, nodes, [busy("x0", 2)], cluster_uid=UID)
    assert isinstance(result, Placement)
    assert result.domain == "y"
    assert {a.domain for a in result.agents} == {"y"}
    assert result.feeds == {}  # every prefill replica feeds every decode replica: none spelled out


def test_intra_node_feeds_stay_with_their_prefill() -> None:
    spec = pdcluster().transport("nvlink-intra").prefill(replicas=2, tp=2).decode(replicas=4, tp=1).spec()
    result = plan_placement(spec, [gpu_node("a", 4), gpu_node("b", 4)], [], cluster_uid=UID)
    assert isinstance(result, Placement)
    assert result.feeds == {0: (0, 1), 1: (2, 3)}
    assert _layout(result) == {
        "a": ["prefill-0-tp0-cp0", "prefill-0-tp1-cp0", "decode-0-tp0", "decode-1-tp0"],
        "b": ["prefill-1-tp0-cp0", "prefill-1-tp1-cp0", "decode-2-tp0", "decode-3-tp0"],
    }


def test_a_pod_per_unit_and_node_with_gpu_indices_dense_per_pod() -> None:
    spec = pdcluster().prefill(tp=2, cp=2).decode(tp=4).spec()
    result = plan_placement(spec, [gpu_node("a", 8)], [], cluster_uid=UID)
    assert isinstance(result, Placement)
    assert [(a.node, a.unit) for a in result.agents] == [("a", "decode-0"), ("a", "prefill-0")]
    assert [[r.gpu for r in a.ranks] for a in result.agents] == [[0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("shape", ["one-node", "node-per-replica"])
def test_scaling_a_role_adds_and_removes_pods_and_leaves_the_others_exactly_as_they_were(shape: str) -> None:
    """decode 1 -> 3, prefill 1 -> 2, decode 3 -> 1: every pod of a unit that stays keeps its node,
    its ranks and their GPU indices (the pod the builders make from it is the same)."""
    nodes = [gpu_node("a", 16)] if shape == "one-node" else [gpu_node(n, 2) for n in "abcdef"]
    steps = [(1, 1), (1, 3), (2, 3), (2, 1)]
    previous: dict[str, Any] = {}
    before: dict[str, AgentPlacement] = {}
    for prefill, decode in steps:
        spec = pdcluster().transport("tcp").prefill(replicas=prefill, tp=2).decode(replicas=decode, tp=2).spec()
        result = plan_placement(spec, nodes, [], cluster_uid=UID, previous=previous)
        assert isinstance(result, Placement), result
        pods = {a.unit: a for a in result.agents}
        assert sorted(pods) == sorted([f"prefill-{r}" for r in range(prefill)] + [f"decode-{r}" for r in range(decode)])
        for unit in set(pods) & set(before):
            assert pods[unit] == before[unit], unit
        before, previous = pods, result.ranks_by_node()


def test_lost_node_moves_only_its_ranks() -> None:
    spec = pdcluster().prefill(replicas=2, tp=4).decode(replicas=2, tp=4).spec()
    nodes = [gpu_node(n, 8) for n in "abc"]
    first = plan_placement(spec, nodes, [], cluster_uid=UID)
    assert isinstance(first, Placement)
    before = first.ranks_by_node()
    lost = first.agents[0].node
    nodes_after = [gpu_node(n, 8, ready=n != lost) for n in "abc"]
    second = plan_placement(spec, nodes_after, [], cluster_uid=UID, previous=before)
    assert isinstance(second, Placement)
    after = second.ranks_by_node()
    assert lost not in after
    for node, ranks in before.items():
        if node != lost:
            assert after[node] == ranks, "ranks on healthy nodes must not move"
    assert sum(len(r) for r in after.values()) == 16


def test_scale_up_keeps_existing_ranks() -> None:
    nodes = [gpu_node(n, 8) for n in "abcd"]
    small = plan_placement(pdcluster().prefill(tp=8).decode(tp=8).spec(), nodes, [], cluster_uid=UID)
    assert isinstance(small, Placement)
    big = plan_placement(
        pdcluster().prefill(tp=8, replicas=2).decode(tp=8, replicas=2).spec(),
        nodes,
        [],
        cluster_uid=UID,
        previous=small.ranks_by_node(),
    )
    assert isinstance(big, Placement)
    for node, ranks in small.ranks_by_node().items():
        assert big.ranks_by_node()[node] == ranks


def test_previous_node_without_room_is_left() -> None:
    spec = pdcluster().prefill(tp=4).decode(tp=4).spec()
    previous = {"a": (Rank("prefill", 0, t, 0, 0, t) for t in range(4))}
    result = plan_placement(
        spec,
        [gpu_node("a", 8), gpu_node("b", 8)],
        [busy("a", 6)],
        cluster_uid=UID,
        previous={"a": tuple(previous["a"])},
    )
    assert isinstance(result, Placement)
    assert _gpus(result) == {"b": 8}


def test_plan_is_deterministic() -> None:
    spec = pdcluster().prefill(replicas=3, tp=2).decode(replicas=3, tp=2).spec()
    nodes = [gpu_node(f"n{i}", 4) for i in range(5)]
    results = {repr(plan_placement(spec, list(order), [], cluster_uid=UID)) for order in (nodes, nodes[::-1])}
    assert len(results) == 1


def test_tainted_node_moves_its_ranks_like_a_cordoned_one() -> None:
    spec = pdcluster().prefill(replicas=2, tp=4).decode(replicas=2, tp=4).spec()
    first = plan_placement(spec, [gpu_node(n, 8) for n in "abc"], [], cluster_uid=UID)
    assert isinstance(first, Placement)
    before = first.ranks_by_node()
    tainted = first.agents[0].node
    taint = (Taint("dedicated", "training", "NoSchedule"),)
    nodes = [gpu_node(n, 8, taints=taint if n == tainted else ()) for n in "abc"]
    second = plan_placement(spec, nodes, [], cluster_uid=UID, previous=before)
    assert isinstance(second, Placement)
    after = second.ranks_by_node()
    assert tainted not in after
    assert all(after[n] == r for n, r in before.items() if n != tainted), "untainted nodes keep their ranks"
    full = [gpu_node("a", 8, taints=taint), gpu_node("b", 8), gpu_node("c", 8)]
    failure = plan_placement(spec, full, [busy("b", 8), busy("c", 8)], cluster_uid=UID)
    assert isinstance(failure, PlacementFailure) and failure.reason is PlacementReason.INSUFFICIENT_GPUS
    assert "(leaving out 1 with a taint the node pods do not tolerate: a dedicated=training:NoSchedule)" in (
        failure.message
    )


def test_usable_nodes_are_ready_uncordoned_and_tolerated() -> None:
    nodes = [
        gpu_node("a", 8),
        gpu_node("b", 8, ready=False),
        gpu_node("c", 8, schedulable=False),
        gpu_node("d", 8, taints=(Taint("x", "", "NoSchedule"),)),
        gpu_node("e", 8, taints=(Taint("nvidia.com/gpu", "", "NoSchedule"),)),
    ]
    assert usable_nodes(pdcluster().spec(), nodes) == {"a", "e"}


def test_rdma_gives_each_pod_a_device_so_a_node_takes_as_many_pods_as_it_has_devices() -> None:
    spec = pdcluster().transport("rdma").prefill(tp=2).decode(tp=2).spec()
    one_each = plan_placement(spec, [gpu_node(n, 8, rdma=1) for n in "ab"], [], cluster_uid=UID)
    assert isinstance(one_each, Placement)
    assert sorted((a.unit, a.node) for a in one_each.agents) in (
        [("decode-0", "a"), ("prefill-0", "b")],
        [("decode-0", "b"), ("prefill-0", "a")],
    )
    shared = plan_placement(spec, [gpu_node("a", 8, rdma=2)], [], cluster_uid=UID)
    assert isinstance(shared, Placement) and {a.node for a in shared.agents} == {"a"}
    short = plan_placement(spec, [gpu_node("a", 8, rdma=1)], [], cluster_uid=UID)
    assert isinstance(short, PlacementFailure) and short.reason == "NoRDMANodes"
    assert "each pod holds one" in short.message
