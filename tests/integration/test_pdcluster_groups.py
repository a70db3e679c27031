"""Replicas over several nodes on the real control plane, under the operator with the chart's RBAC
(issue 45): a group's node pods are created on distinct nodes, and when one of them is deleted (a
kill, an eviction) the operator deletes the rest of the group so it starts again whole, leaving
every other pod alone. (The engines' side of it, with SGLang's servers: tests/e2e/test_sglang_multinode.py;
a group that does not fit: test_pdcluster_placement.py.)"""

from __future__ import annotations

import time
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

GROUP_ARGS = [
    "--nnodes", "$(PDFABRIC_NNODES)", "--node-rank", "$(PDFABRIC_NODE_RANK)",
    "--dist-init-addr", "$(PDFABRIC_DIST_INIT_ADDR)",
]  # fmt: skip


def _pods(cluster: Any, namespace: str) -> dict[str, tuple[str, str]]:
    """name -> (uid, node) of the cluster's node pods that are not going away."""
    return {
        p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["labels"]["pdfabric.dev/node"])
        for p in h.agent_pods(cluster, namespace, "pd")
    }


def test_a_group_is_placed_on_distinct_nodes_and_restarts_whole(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("g", 3, gpus=2)
    builder = (
        pdcluster()
        .prefill(tp=2, nodesPerReplica=2)
        .decode(tp=2, nodesPerReplica=2)
        .engine(prefill={"args": GROUP_ARGS}, decode={"args": GROUP_ARGS})
        .placement(nodeSelector=h.selector(namespace))
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    pods = h.wait_until(lambda: (p := _pods(cluster, namespace)) and len(p) == 4 and p, timeout=60, what="4 pods")
    for unit in ("pd-prefill-0-", "pd-decode-0-"):
        nodes = [node for name, (_, node) in pods.items() if name.startswith(unit)]
        assert len(nodes) == len(set(nodes)) == 2, (unit, pods)  # a block per node, never two on one
    h.wait_until(
        lambda: all(p["status"].get("phase") == "Running" for p in h.agent_pods(cluster, namespace, "pd")),
        timeout=60,
        what="the pods running",
    )
    time.sleep(3)  # the reconcile their start wakes remembers the groups' incarnations

    prefill = sorted(n for n in pods if n.startswith("pd-prefill-0-"))
    decode = {n: pods[n][0] for n in pods if n.startswith("pd-decode-0-")}
    cluster.kubectl("delete", "pod", prefill[1], "-n", namespace, "--wait=false")  # one node rank killed

    def restarted() -> dict[str, tuple[str, str]] | None:
        now = _pods(cluster, namespace)
        anew = all(n in now and now[n][0] != pods[n][0] for n in prefill)
        return now if anew and len(now) == 4 else None

    now = h.wait_until(restarted, timeout=60, what="both prefill pods replaced (the group restarted whole)")
    assert {n: now[n][0] for n in decode} == decode  # the decode group was left alone
