"""Unplaceable specs say why and create nothing; declared fallback is visible; capacity is shared."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_core.rankmap import RankMap
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import (
    apply_pdc,
    children,
    condition,
    pdc,
    selector,
    wait_ready,
    wait_until,
)

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

NO_CHILDREN = {"pods": [], "configmaps": [], "services": [], "secrets": []}

# (id, node shapes, builder, Placed reason, message fragment)
UNPLACEABLE = [
    (
        "too-few-gpus",
        [("n", 1, {})],
        pdcluster().prefill(tp=8).decode(tp=8),
        "InsufficientGPUs",
        "needs 8 GPUs but ready nodes matching nodeSelector",
    ),
    (
        "no-nvlink-domain-large-enough",
        [("a", 1, {"clique": "dom-a"}), ("b", 1, {"clique": "dom-b"})],
        pdcluster().transport("nvlink").prefill(tp=8).decode(tp=8),
        "NVLinkDomainTooSmall",
        "needs all 16 GPUs inside one NVLink domain",
    ),
    (
        # A replica over two nodes on one node that could hold it: no block of it is placed.
        "group-needs-a-node-per-block",
        [("n", 1, {})],
        pdcluster().prefill(tp=2, nodesPerReplica=2),
        "InsufficientGPUs",
        "prefill-0 spans 2 nodes with 1 free GPUs each (nodesPerReplica)",
    ),
    (
        "no-rdma-nodes",
        [("n", 2, {})],
        pdcluster().transport("rdma"),
        "NoRDMANodes",
        "transport rdma needs nodes with allocatable rdma/hca",
    ),
]


def _placed_false(cluster: Any, namespace: str, reason: str) -> dict[str, Any] | None:
    obj = pdc(cluster, namespace, "pd")
    cond = condition(obj, "Placed")
    return obj if cond and cond["status"] == "False" and cond["reason"] == reason else None


@pytest.mark.parametrize(
    ("shapes", "builder", "reason", "fragment"), [c[1:] for c in UNPLACEABLE], ids=[c[0] for c in UNPLACEABLE]
)
def test_unplaceable_reports_why_and_creates_nothing(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, shapes: list, builder: Any, reason: str, fragment: str
) -> None:
    for prefix, count, opts in shapes:
        gpu_nodes(prefix, count, **opts)
    apply_pdc(cluster, builder.placement(nodeSelector=selector(namespace)).manifest(), namespace)
    obj = wait_until(lambda: _placed_false(cluster, namespace, reason), timeout=30, what=f"Placed=False/{reason}")
    assert fragment in condition(obj, "Placed")["message"]
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "TransportReady")["status"] == "False"
    assert obj["status"]["placement"] == []
    assert obj["status"]["prefillReady"] == "0/1"
    assert children(cluster, namespace, "pd") == NO_CHILDREN
    wide = cluster.kubectl("get", "pdc", "pd", "-n", namespace, "-o", "wide").stdout
    assert reason in wide
    # ... and `kubectl describe` shows it once as a Warning event.
    events = wait_until(
        lambda: [
            e
            for e in cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=pd")["items"]
            if e["reason"] == reason
        ],
        timeout=30,
        what=f"a {reason} event",
    )
    assert events[0]["type"] == "Warning" and fragment in events[0]["message"]


def test_declared_tcp_fallback_is_recorded(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 1)
    spec = pdcluster().transport("rdma").placement(nodeSelector=selector(namespace), fallback="TCP")
    apply_pdc(cluster, spec.manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd")
    status = obj["status"]
    assert (status["transport"], status["requestedTransport"]) == ("tcp", "rdma")
    assert condition(obj, "Placed")["reason"] == "FallbackTCP"
    assert "NoRDMANodes" in condition(obj, "Placed")["message"]
    assert condition(obj, "Degraded")["status"] == "True"
    assert condition(obj, "Degraded")["reason"] == "TransportFallback"
    assert condition(obj, "TransportReady")["status"] == "False"
    rankmap = RankMap.from_json(cluster.get_json("configmap", "pd-rankmap", "-n", namespace)["data"]["rankmap.json"])
    assert rankmap.transport == "tcp"
    row = cluster.kubectl("get", "pdc", "pd", "-n", namespace, "--no-headers").stdout.split()
    assert row[2] == "tcp", "the Transport column shows what runs, not what was asked"


def test_capacity_is_shared_between_clusters(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 1)
    sel = selector(namespace)
    apply_pdc(cluster, pdcluster("big").prefill(tp=4).decode(tp=4).placement(nodeSelector=sel).manifest(), namespace)
    wait_ready(cluster, namespace, "big")
    apply_pdc(cluster, pdcluster("pd").placement(nodeSelector=sel).manifest(), namespace)
    obj = wait_until(lambda: _placed_false(cluster, namespace, "InsufficientGPUs"), timeout=30, what="pd unplaced")
    assert "0 free" in condition(obj, "Placed")["message"]
    assert children(cluster, namespace, "pd") == NO_CHILDREN
    # Freeing the GPUs lets the waiting cluster in, without touching it (level-based retry).
    cluster.kubectl("delete", "pdcluster", "big", "-n", namespace)
    wait_ready(cluster, namespace, "pd", timeout=60)


def test_placed_once_nodes_arrive(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    apply_pdc(
        cluster, pdcluster().transport("nvlink").placement(nodeSelector=selector(namespace)).manifest(), namespace
    )
    wait_until(lambda: _placed_false(cluster, namespace, "NoGPUNodes"), timeout=30, what="NoGPUNodes")
    gpu_nodes("late", 1, clique="dom-late")
    obj = wait_ready(cluster, namespace, "pd", timeout=60)
    assert obj["status"]["nvlinkDomain"] == "dom-late"
