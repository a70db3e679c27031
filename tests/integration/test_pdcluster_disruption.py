"""The node pods' PodDisruptionBudgets on the real control plane, under the operator with the chart's
RBAC (issue 44): the eviction API lets one replica of a role go at a time, refuses the next until
the operator has placed the evicted one again and it is Ready, and `kubectl drain` of a node holding
prefill and decode pods completes with every pod placed again elsewhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes


def _evict(cluster: Any, namespace: str, pod: str) -> tuple[bool, str]:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
    proc = cluster.kubectl(
        "create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-",
        input=json.dumps(body), check=False,
    )  # fmt: skip
    return proc.returncode == 0, proc.stdout + proc.stderr


def _ready_pods(cluster: Any, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in h.agent_pods(cluster, namespace, "pd")
        if any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions", []))
    }


def _allowed(cluster: Any, namespace: str, name: str) -> int | None:
    proc = cluster.kubectl("get", "pdb", name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    status = json.loads(proc.stdout).get("status") or {}
    return int(status["disruptionsAllowed"]) if status.get("currentHealthy") == 2 else None


def test_evictions_take_one_replica_of_a_role_at_a_time_and_a_drain_completes(
    cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path
) -> None:
    nodes = gpu_nodes("d", 3, gpus=2)
    builder = pdcluster().prefill(replicas=2).decode(replicas=2).placement(nodeSelector=h.selector(namespace))
    peering = f"pdfabric-{namespace}"
    with h.running_operator(cluster, operator_kubeconfig, peering):
        h.apply_pdc(cluster, builder.manifest(), namespace)
        h.wait_until(lambda: len(_ready_pods(cluster, namespace)) == 4, timeout=60, what="4 node pods Ready")
        for budget in ("pd-prefill", "pd-decode"):
            h.wait_until(lambda b=budget: _allowed(cluster, namespace, b) == 1, timeout=60, what=f"{budget} allowing 1")

    # With no operator running, nothing places an evicted pod again (here the fake nodes' pods are
    # Ready at once, so a running operator may bring it back before the next request is sent).
    prefill = sorted(n for n in _ready_pods(cluster, namespace) if n.startswith("pd-prefill-"))
    ok, said = _evict(cluster, namespace, prefill[0])
    assert ok, said
    ok, said = _evict(cluster, namespace, prefill[1])  # the budget is spent until the first is back
    assert not ok and "disruption budget" in said, said
    with h.running_operator(cluster, operator_kubeconfig, peering):
        # The operator places the evicted replica again; once Ready, the budget lets the next one go.
        h.wait_until(lambda: _allowed(cluster, namespace, "pd-prefill") == 1, timeout=60, what="prefill back")
        ok, said = _evict(cluster, namespace, prefill[1])
        assert ok, said
        h.wait_until(lambda: len(_ready_pods(cluster, namespace)) == 4, timeout=60, what="4 node pods Ready again")

        # A drain of the node holding most pods: evictions as the budgets allow, each pod placed
        # again on another node (the drained one is cordoned), and the drain completes.
        by_node: dict[str, list[str]] = {}
        for name, pod in _ready_pods(cluster, namespace).items():
            by_node.setdefault(pod["spec"]["nodeName"], []).append(name)
        busiest = max(sorted(by_node), key=lambda n: len(by_node[n]))
        assert busiest in nodes
        drained = cluster.kubectl(
            "drain", busiest, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s", check=False, timeout=120
        )
        assert drained.returncode == 0, drained.stdout + drained.stderr

        def elsewhere() -> bool:
            pods = _ready_pods(cluster, namespace)
            return len(pods) == 4 and all(p["spec"]["nodeName"] != busiest for p in pods.values())

        h.wait_until(elsewhere, timeout=60, what="every pod Ready on the other nodes")
        h.delete_all_pdclusters(cluster, namespace)
