"""The kube-scheduler binds the node pods the planner chose: taints, cordons and fit apply, and a
pod it will not bind is reported with its own words."""

from __future__ import annotations

import json
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import (
    agent_pods,
    apply_pdc,
    condition,
    pdc,
    pods_by_unit,
    selector,
    wait_ready,
    wait_until,
)

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator


def _scheduled_by_the_scheduler(pod: dict[str, Any], node: str) -> None:
    """Bound to `node` through its affinity (the operator named no node), by the scheduler."""
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [node]}]
    assert pod["spec"]["nodeName"] == node
    assert pod["metadata"]["annotations"]["pdfabric.dev/node"] == node
    scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled and scheduled[0]["status"] == "True"
    # No field manager of the operator's owns spec.nodeName: the binding was the scheduler's.
    owned = json.dumps([m.get("fieldsV1", {}) for m in pod["metadata"].get("managedFields") or []])
    assert '"f:nodeName"' not in owned


def _each_bound_to(cluster: Any, namespace: str, name: str, node: str) -> list[dict[str, Any]]:
    """The cluster's node pods, a pod per replica (prefill-0, decode-0), each bound to `node` by the
    scheduler."""
    pods = pods_by_unit(cluster, namespace, name)
    assert sorted(pods) == ["decode-0", "prefill-0"], sorted(pods)
    for pod in pods.values():
        _scheduled_by_the_scheduler(pod, node)
    return list(pods.values())


def _unplaced(cluster: Any, namespace: str, name: str, reason: str) -> dict[str, Any] | None:
    obj = pdc(cluster, namespace, name)
    cond = condition(obj, "Placed")
    return obj if cond and (cond["status"], cond["reason"]) == ("False", reason) else None


def test_a_tainted_node_without_a_toleration_gets_no_pod(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    (tainted,) = gpu_nodes("t", 1)
    (plain,) = gpu_nodes("u", 1)
    cluster.kubectl("taint", "node", tainted, "dedicated=training:NoSchedule")
    sel = selector(namespace)
    # 8 GPUs: either node fits it, and best fit would take the tainted one (first by name).
    apply_pdc(cluster, pdcluster().prefill(tp=4).decode(tp=4).placement(nodeSelector=sel).manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    _each_bound_to(cluster, namespace, "pd", plain)
    # A second cluster finds only the tainted node free: no pod, and the status names the taint.
    apply_pdc(cluster, pdcluster("pd2").prefill(tp=4).decode(tp=4).placement(nodeSelector=sel).manifest(), namespace)
    obj = wait_until(lambda: _unplaced(cluster, namespace, "pd2", "InsufficientGPUs"), timeout=30, what="pd2 unplaced")
    assert (
        f"with a taint the node pods do not tolerate: {tainted} dedicated=training:NoSchedule"
        in (condition(obj, "Placed")["message"])
    )
    assert agent_pods(cluster, namespace, "pd2") == []
    # The taint goes: the waiting cluster is placed there, by the scheduler.
    cluster.kubectl("taint", "node", tainted, "dedicated-")
    wait_ready(cluster, namespace, "pd2", timeout=60)
    _each_bound_to(cluster, namespace, "pd2", tainted)


def test_a_cordoned_node_gets_no_new_pod(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    (cordoned,) = gpu_nodes("c", 1)
    (plain,) = gpu_nodes("d", 1)
    cluster.kubectl("cordon", cordoned)
    sel = selector(namespace)
    apply_pdc(cluster, pdcluster().prefill(tp=4).decode(tp=4).placement(nodeSelector=sel).manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    _each_bound_to(cluster, namespace, "pd", plain)
    apply_pdc(cluster, pdcluster("pd2").prefill(tp=4).decode(tp=4).placement(nodeSelector=sel).manifest(), namespace)
    wait_until(lambda: _unplaced(cluster, namespace, "pd2", "InsufficientGPUs"), timeout=30, what="pd2 unplaced")
    assert agent_pods(cluster, namespace, "pd2") == []
    cluster.kubectl("uncordon", cordoned)
    wait_ready(cluster, namespace, "pd2", timeout=60)
    _each_bound_to(cluster, namespace, "pd2", cordoned)


def test_a_pod_the_scheduler_cannot_bind_is_reported_with_its_reason(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    (node,) = gpu_nodes("n", 1)  # 128 CPUs: the planner counts GPUs, the scheduler counts CPUs too
    builder = pdcluster().placement(nodeSelector=selector(namespace)).agent(resources={"requests": {"cpu": "500"}})
    apply_pdc(cluster, builder.manifest(), namespace)

    def unschedulable() -> dict[str, Any] | None:
        obj = pdc(cluster, namespace, "pd")
        cond = condition(obj, "Ready")
        return obj if cond and cond["reason"] == "PodUnschedulable" else None

    obj = wait_until(unschedulable, timeout=60, what="Ready=False/PodUnschedulable")
    ready, placed = condition(obj, "Ready"), condition(obj, "Placed")
    assert ready["status"] == "False" and "Insufficient cpu" in ready["message"], ready
    assert f"to its node {node}: 0/" in ready["message"]
    assert (placed["status"], placed["reason"], placed["message"]) == ("False", "PodUnschedulable", ready["message"])
    pods = pods_by_unit(cluster, namespace, "pd")
    assert sorted(pods) == ["decode-0", "prefill-0"], sorted(pods)
    for pod in pods.values():
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    events = wait_until(
        lambda: [
            e
            for e in cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=pd")["items"]
            if e["reason"] == "PodUnschedulable"
        ],
        timeout=30,
        what="a PodUnschedulable event",
    )
    assert events[0]["type"] == "Warning" and "Insufficient cpu" in events[0]["message"]
    # Asking for what fits replaces the unbound pod at once (no roll waits on it), and it is bound.
    apply_pdc(cluster, builder.agent(resources={"requests": {"cpu": "1"}}).manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd", timeout=60)
    assert condition(obj, "Placed")["reason"] == "Placed"
    _each_bound_to(cluster, namespace, "pd", node)


def test_the_users_required_node_affinity_joins_the_pin(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    (first,) = gpu_nodes("a", 1, labels={"pdfabric.dev/test-zone": "a"})
    (second,) = gpu_nodes("b", 1, labels={"pdfabric.dev/test-zone": "b"})
    zone_b = {"key": "pdfabric.dev/test-zone", "operator": "In", "values": ["b"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [zone_b]}]}
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"team": "x"}},
                    },
                }
            ]
        },
    }
    # Best fit alone would take the first node (by name); the user's affinity admits only the second.
    builder = pdcluster().placement(nodeSelector=selector(namespace)).agent(pod={"affinity": affinity})
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    for pod in _each_bound_to(cluster, namespace, "pd", second):
        (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert zone_b in term["matchExpressions"]
        assert pod["spec"]["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]
    assert first != second
