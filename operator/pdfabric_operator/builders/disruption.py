"""The node pods' PodDisruptionBudgets: one per role (prefill, decode), or one for the pods of
intra-node NVLink units (a prefill replica and the decode replicas it feeds, on one node). Each
counts its pods by the LABEL_DISRUPTION_BUDGET label, so a pod is in exactly one budget (the
eviction API refuses a pod that two budgets select). A drain then evicts at most the role's
maxUnavailable replicas at a time and waits until the operator has placed them again, Ready,
before the next eviction."""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import DISRUPTION_BUDGETS, ClusterRef, disruption_budget_name, object_meta
from pdfabric_operator.placement import AgentPlacement, Placement

UNITS = DISRUPTION_BUDGETS[2]  # the budget of pods holding ranks of both roles


def budget_of(agent: AgentPlacement) -> str:
    """Which budget counts the agent's pod: its role, or UNITS when it holds both."""
    roles = {r.role for r in agent.ranks}
    return next(iter(roles)).value if len(roles) == 1 else UNITS


def max_unavailable_pods(spec: PDClusterSpec, budget: str) -> int:
    """The role's maxUnavailable in pods: each replica is nodesPerReplica pods (a group's pods go
    together: one evicted, the rest are deleted with it). A units pod holds one prefill replica."""
    if budget == UNITS:
        return spec.prefill.max_unavailable
    role = spec.role(budget)
    return role.max_unavailable * role.nodes_per_replica


def build_disruption_budgets(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> dict[str, dict[str, Any]]:
    """Budget name -> the PodDisruptionBudget, for each budget some placed pod falls in.

    It says minAvailable (the budget's pods less the role's maxUnavailable in pods), not
    maxUnavailable: the disruption controller resolves maxUnavailable only through the pods'
    controller's scale subresource, and node pods are the PDCluster's, which has none (such a
    budget would allow no eviction at all). So the operator rewrites it when the pods change."""
    pods = Counter(budget_of(a) for a in placement.agents)
    out: dict[str, dict[str, Any]] = {}
    for budget in sorted(pods):
        name = disruption_budget_name(ref.name, budget)
        out[name] = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": object_meta(ref, name, **{c.LABEL_COMPONENT: c.COMPONENT_AGENT}),
            "spec": {
                "minAvailable": max(0, pods[budget] - max_unavailable_pods(spec, budget)),
                "selector": {
                    "matchLabels": {
                        c.LABEL_CLUSTER_UID: ref.uid,
                        c.LABEL_COMPONENT: c.COMPONENT_AGENT,
                        c.LABEL_DISRUPTION_BUDGET: budget,
                    }
                },
                # A pod that is not Ready (its engine crash-looping, its node going) serves nothing:
                # a drain may evict it whatever the budget says, as Kubernetes recommends.
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    return out
