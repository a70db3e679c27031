"""The watch caches' entries (kopf indices), each read from an object's body: a GPU node, a pod
holding extended resources (any owner: capacity is allocatable minus all of them), one of our agent
pods. Pure: main.py registers the indices and hands these functions the bodies."""

from __future__ import annotations

from typing import Any

from pdfabric_operator import constants as c
from pdfabric_operator.placement import GpuNode, PlacedPod
from pdfabric_operator.scheduling import taints_from, unschedulable_message, unschedulable_since
from pdfabric_operator.snapshot import OwnPod


def _int_quantity(value: Any) -> int:
    # Extended resources are integers ("8"); anything else is not a device count.
    try:
        return int(str(value))
    except ValueError:
        return 0


def _extended(resources: dict[str, Any]) -> dict[str, int]:
    return {k: _int_quantity(v) for k, v in (resources or {}).items() if "/" in k}


def node_from_body(name: str, labels: Any, spec: Any, status: Any, meta: Any) -> GpuNode:
    conditions = {cond.get("type"): cond.get("status") for cond in status.get("conditions") or []}
    return GpuNode(
        name=name,
        labels=dict(labels),
        allocatable=_extended(status.get("allocatable") or {}),
        ready=conditions.get("Ready") == "True",
        schedulable=not spec.get("unschedulable") and not meta.get("deletionTimestamp"),
        taints=taints_from(spec.get("taints")),
    )


def placed_pod_from_body(spec: Any, status: Any, labels: Any, annotations: Any) -> PlacedPod | None:
    """The extended resources a pod holds on its node; None when it holds none (or none any more)."""
    node = spec.get("nodeName")
    if not node and labels.get(c.LABEL_MANAGED_BY) == c.MANAGED_BY:
        # Our agent pod before the scheduler binds it holds its planned node's GPUs already: after
        # a restart (an empty ledger) another PDCluster must not be planned onto them.
        node = annotations.get(c.ANN_NODE)
    if not node or status.get("phase") in ("Succeeded", "Failed"):
        return None
    requests: dict[str, int] = {}
    for container in spec.get("containers") or []:
        res = container.get("resources") or {}
        # Extended resources must be set in limits; requests default to them.
        for k, v in {**_extended(res.get("limits") or {}), **_extended(res.get("requests") or {})}.items():
            requests[k] = requests.get(k, 0) + v
    if not requests:
        return None
    return PlacedPod(node, requests, labels.get(c.LABEL_CLUSTER_UID))


def own_pod_from_body(
    name: str, namespace: str, uid: str, spec: Any, status: Any, meta: Any, annotations: Any
) -> OwnPod:
    """One of our agent pods as the reconcile reads it (its node, readiness, build hashes, ranks)."""
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True" for cond in status.get("conditions") or [])
    bound = spec.get("nodeName") or ""
    return OwnPod(
        name=name,
        namespace=namespace,
        uid=uid,
        # Until the scheduler binds it, the node the planner chose for it.
        node=bound or annotations.get(c.ANN_NODE, ""),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        pod_hash=annotations.get(c.ANN_POD_HASH, ""),
        ranks=annotations.get(c.ANN_RANKS, ""),
        failed=status.get("phase") in ("Failed", "Succeeded"),
        ip=status.get("podIP") or "",
        unschedulable="" if bound else unschedulable_message(status.get("conditions")),
        unschedulable_since="" if bound else unschedulable_since(status.get("conditions")),
        config_hash=annotations.get(c.ANN_CONFIG_HASH, ""),
        rankmap_hash=annotations.get(c.ANN_RANKMAP_HASH, ""),
        group_incarnation=annotations.get(c.ANN_GROUP_INCARNATION, ""),
        container_restarts=sum(int(s.get("restartCount") or 0) for s in status.get("containerStatuses") or []),
        budget=(meta.get("labels") or {}).get(c.LABEL_DISRUPTION_BUDGET, ""),
    )
