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

import copy
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


def node_pod_tolerations(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """The node pod's tolerations: the operator's, then the user's (spec.agent.pod), each once."""
    out: list[dict[str, Any]] = []
    for t in [*operator_tolerations(spec), *spec.agent.pod.tolerations]:
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


def pin_term(node: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The node selector term pinning a pod to `node` (by name: matchFields, which node labels
    cannot spoof) and to the `labels` the placement chose it for (its nodeSelector, its NVLink
    domain): should they change before the pod is bound, the scheduler refuses it and says why."""
    term: dict[str, Any] = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    if labels:
        term["matchExpressions"] = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(labels.items())]
    return term


def _required_terms(affinity: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return None
    return list(required.get("nodeSelectorTerms") or [])


def node_affinity(node: str, labels: Mapping[str, str], user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pod's affinity: the user's (pod affinity, anti-affinity, preferred node affinity as
    written) with every required node selector term ANDed with the pin to `node` (terms are ORed,
    so the pin joins each of them; none: the pin alone)."""
    pin = pin_term(node, labels)
    user = copy.deepcopy(dict(user or {}))
    terms = _required_terms(user)
    merged = [
        {
            **term,
            "matchExpressions": [*(term.get("matchExpressions") or []), *pin.get("matchExpressions", [])],
            "matchFields": [*(term.get("matchFields") or []), *pin["matchFields"]],
        }
        for term in terms or []
        if term.get("matchExpressions") or term.get("matchFields")  # an empty term matches no node
    ]
    for term in merged:
        if not term["matchExpressions"]:
            del term["matchExpressions"]
    node_aff = dict(user.get("nodeAffinity") or {})
    if terms is None:
        merged = [pin]
    elif not merged:  # the user's terms admit no node: neither may the merge (the planner places none)
        merged = [dict(t) for t in terms]
    node_aff["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": merged}
    user["nodeAffinity"] = node_aff
    return user


def _requirement_holds(req: Mapping[str, Any], value: str | None) -> bool:
    """One NodeSelectorRequirement against a node's label (or field) value, None when absent."""
    op, values = req.get("operator"), [str(v) for v in req.get("values") or []]
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def affinity_allows(node: str, labels: Mapping[str, str], affinity: Mapping[str, Any]) -> bool:
    """Whether the required node affinity `affinity` admits the node (the scheduler's NodeAffinity
    filter): no required terms admit every node; terms are ORed, the requirements of a term ANDed,
    and an empty term admits none."""
    terms = _required_terms(affinity)
    if terms is None:
        return True
    for term in terms:
        exprs, fields_ = term.get("matchExpressions") or [], term.get("matchFields") or []
        if not exprs and not fields_:
            continue
        if all(_requirement_holds(r, labels.get(str(r.get("key")))) for r in exprs) and all(
            _requirement_holds(r, node if r.get("key") == "metadata.name" else None) for r in fields_
        ):
            return True
    return False


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


def unschedulable_since(conditions: Iterable[Mapping[str, Any]] | None) -> str:
    """When the scheduler first said an unbound pod cannot be bound (its PodScheduled=False
    lastTransitionTime, RFC 3339), "" while it has said nothing."""
    for cond in conditions or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("lastTransitionTime") or "")
    return ""
