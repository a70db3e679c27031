"""What the kube-scheduler is told about a node pod, and the planner's mirror of its taint filter.

The planner chooses a node for each agent (it knows the PD rules the scheduler cannot: which
ranks must share a node or an NVLink domain). The pod does not name that node in spec.nodeName:
that would bypass the scheduler, and with it taints, cordons, fit, priority and quotas. It carries
a required node affinity instead, the way the DaemonSet controller pins its pods:
`matchFields metadata.name In [node]` plus the labels the placement relied on (the nodeSelector,
the NVLink domain), so the scheduler binds it there or says, in the pod's PodScheduled
condition, why not.

So that the planner does not choose a node the scheduler would refuse outright, it filters nodes
by the same taint rule the scheduler's TaintToleration plugin applies (NoSchedule and NoExecute
taints the pod does not tolerate; PreferNoSchedule only scores). The tolerations are the pod's own
(node_pod_tolerations), so planner and pod can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdfabric_core.spec import PDClusterSpec

# Effects the scheduler filters on; PreferNoSchedule only lowers a node's score.
FILTERED_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


def taints_from(raw: Iterable[Mapping[str, Any]] | None) -> tuple[Taint, ...]:
    """A Node's spec.taints as the API returns them."""
    return tuple(Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", ""))) for t in raw or ())


def operator_tolerations(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """What every node pod tolerates: the taint GPU clusters commonly put on GPU nodes (named after
    the GPU resource) so that only pods asking for GPUs land there; ours do."""
    return [{"key": spec.placement.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]


def node_pod_tolerations(spec: PDClusterSpec, extra: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The node pod's tolerations: the operator's, then the user's (`extra`), each once."""
    out: list[dict[str, Any]] = []
    for t in [*operator_tolerations(spec), *extra]:
        if dict(t) not in out:
            out.append(dict(t))
    return out


def tolerates(toleration: Mapping[str, Any], taint: Taint) -> bool:
    """Kubernetes' Toleration.ToleratesTaint: effect (empty: all), key (empty with Exists: all),
    then operator Exists, or Equal (the default) with an equal value."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.effect:
        return False
    key = toleration.get("key") or ""
    op = toleration.get("operator") or "Equal"
    if key and key != taint.key:
        return False
    if op == "Exists":
        return True
    if not key:  # an empty key is only valid with Exists (the API server refuses it otherwise)
        return False
    return op == "Equal" and str(toleration.get("value") or "") == taint.value


def untolerated(taints: Iterable[Taint], tolerations: Sequence[Mapping[str, Any]]) -> list[Taint]:
    """The taints that keep the scheduler from binding a pod with `tolerations` to the node."""
    return [t for t in taints if t.effect in FILTERED_EFFECTS and not any(tolerates(tol, t) for tol in tolerations)]


def node_affinity(node: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """Required node affinity pinning a pod to `node` (by name: matchFields, which node labels
    cannot spoof) and to the `labels` the placement chose it for (its nodeSelector, its NVLink
    domain): should they change before the pod is bound, the scheduler refuses it and says why."""
    term: dict[str, Any] = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    if labels:
        term["matchExpressions"] = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(labels.items())]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def placement_labels(spec: PDClusterSpec, domain: str | None) -> dict[str, str]:
    """The node labels a placement relies on: spec.placement.nodeSelector and the NVLink domain."""
    labels = dict(spec.placement.node_selector)
    if domain:
        labels[spec.placement.nvlink_domain_key] = domain
    return labels


def unschedulable_message(conditions: Iterable[Mapping[str, Any]] | None) -> str:
    """The scheduler's word on an unbound pod: its PodScheduled=False message (with the reason when
    it is not the usual Unschedulable, e.g. SchedulingGated), "" while it has said nothing."""
    for cond in conditions or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            reason = str(cond.get("reason") or "")
            message = str(cond.get("message") or reason or "not scheduled")
            return message if reason in ("", "Unschedulable") else f"{reason}: {message}"
    return ""
