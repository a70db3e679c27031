"""The node pods' PodDisruptionBudgets (builders/disruption.py): one per role, or one for intra-node
NVLink pods that hold both roles; every pod in exactly one (the eviction API refuses a pod that two
budgets select); a role's maxUnavailable counted in replicas, so a group's pods count together; and
the budget label outside the pod's hash, so changing a budget restarts nothing."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_core.spec import SpecError, parse_spec
from pdfabric_operator import constants as c
from pdfabric_operator.builders.agent_pod import build_agent_pods
from pdfabric_operator.builders.disruption import build_disruption_budgets
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.placement import Placement
from pdfabric_operator.planner import plan_placement
from tests.builders import gpu_node, pdcluster

REF = ClusterRef("ns", "pd", "uid-1")
GROUP_ARGS = [
    "--nnodes", "$(PDFABRIC_NNODES)", "--node-rank", "$(PDFABRIC_NODE_RANK)",
    "--dist-init-addr", "$(PDFABRIC_DIST_INIT_ADDR)",
]  # fmt: skip


def _built(builder: Any, nodes: int = 4, gpus: int = 8) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    spec = builder.spec()
    placement = plan_placement(spec, [gpu_node(f"n{i}", gpus) for i in range(nodes)], [], cluster_uid="uid-1")
    assert isinstance(placement, Placement), placement
    return build_disruption_budgets(REF, spec, placement), build_agent_pods(REF, spec, placement)


def _selects(budget: dict[str, Any], pod: dict[str, Any]) -> bool:
    wanted = budget["spec"]["selector"]["matchLabels"]
    return all(pod["metadata"]["labels"].get(k) == v for k, v in wanted.items())


def test_one_budget_per_role_each_pod_in_exactly_one() -> None:
    budgets, pods = _built(pdcluster().prefill(replicas=2, tp=2).decode(replicas=3, tp=1, maxUnavailable=2))
    assert sorted(budgets) == ["pd-decode", "pd-prefill"]
    # minAvailable: the disruption controller resolves maxUnavailable only through a scale subresource.
    assert budgets["pd-prefill"]["spec"]["minAvailable"] == 2 - 1  # maxUnavailable's default, 1
    assert budgets["pd-decode"]["spec"]["minAvailable"] == 3 - 2
    for b in budgets.values():
        assert b["apiVersion"] == "policy/v1" and b["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert b["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for pod in pods:
        selecting = [n for n, b in budgets.items() if _selects(b, pod)]
        role = pod["metadata"]["name"].split("-")[1]
        assert selecting == [f"pd-{role}"], (pod["metadata"]["name"], selecting)


def test_a_group_counts_its_pods_together() -> None:
    builder = (
        pdcluster()
        .prefill(replicas=2, tp=2, nodesPerReplica=2)
        .decode(tp=1)
        .engine(prefill={"args": GROUP_ARGS}, decode={})
    )
    budgets, _ = _built(builder, nodes=4, gpus=2)
    # One replica unavailable is two pods: the evicted one and the member the operator deletes with it.
    assert budgets["pd-prefill"]["spec"]["minAvailable"] == 4 - 2
    assert budgets["pd-decode"]["spec"]["minAvailable"] == 1 - 1


def test_intra_node_nvlink_pods_hold_both_roles_and_share_one_budget() -> None:
    budgets, pods = _built(pdcluster().transport("nvlink-intra").prefill(replicas=2, tp=2).decode(replicas=4, tp=1))
    assert list(budgets) == ["pd-units"]
    assert budgets["pd-units"]["spec"]["minAvailable"] == 2 - 1  # a pod per prefill replica
    assert pods and all(_selects(budgets["pd-units"], p) for p in pods)


def test_a_budget_change_restarts_no_pod() -> None:
    _, before = _built(pdcluster().prefill(replicas=2).decode(replicas=2))
    budgets, after = _built(pdcluster().prefill(replicas=2, maxUnavailable=0).decode(replicas=2, maxUnavailable=2))
    assert (budgets["pd-prefill"]["spec"]["minAvailable"], budgets["pd-decode"]["spec"]["minAvailable"]) == (2, 0)
    hashes = [[p["metadata"]["annotations"][c.ANN_POD_HASH] for p in pods] for pods in (before, after)]
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("value", [-1, 1025])
def test_max_unavailable_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(SpecError, match=r"decode\.maxUnavailable must be within 0\.\.1024"):
        parse_spec({"decode": {"maxUnavailable": value}})
