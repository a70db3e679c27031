"""Replicas over several nodes on the real control plane, under the operator with the chart's RBAC
(issue 45): a group's node pods are created on distinct nodes, and when one of them is deleted (a
kill, an eviction), even while no operator ran, the next operator deletes the rest of the group so
it starts again whole, leaving every other pod alone (the group's incarnation is on its pods). A group the scheduler cannot bind whole is released:
every pod of it deleted and created again after a hold, the status saying why. (The engines' side of it, with SGLang's servers: tests/e2e/test_sglang_multinode.py;
a group that does not fit: test_pdcluster_placement.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes

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
    cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path
) -> None:
    gpu_nodes("g", 3, gpus=2)
    builder = (
        pdcluster()
        .prefill(tp=2, nodesPerReplica=2)
        .decode(tp=2, nodesPerReplica=2)
        .engine(prefill={"args": GROUP_ARGS}, decode={"args": GROUP_ARGS})
        .placement(nodeSelector=h.selector(namespace))
    )
    peering = f"pdfabric-{namespace}"
    with h.running_operator(cluster, operator_kubeconfig, peering):
        h.apply_pdc(cluster, builder.manifest(), namespace)
        pods = h.wait_until(lambda: (p := _pods(cluster, namespace)) and len(p) == 4 and p, timeout=60, what="4 pods")
        for unit in ("pd-prefill-0-", "pd-decode-0-"):
            nodes = [node for name, (_, node) in pods.items() if name.startswith(unit)]
            assert len(nodes) == len(set(nodes)) == 2, (unit, pods)  # a block per node, never two on one
        # Once both members run, each group's incarnation (its pods' uids) is written on its pods.
        words = h.wait_until(
            lambda: len(w := _incarnations(cluster, namespace)) == 4 and w, timeout=60, what="the incarnations"
        )
    for unit in ("pd-prefill-0-", "pd-decode-0-"):
        uids = sorted(uid for name, (uid, _) in pods.items() if name.startswith(unit))
        assert {w for name, w in words.items() if name.startswith(unit)} == {",".join(f"{u}=0/0" for u in uids)}

    # One node rank is killed while no operator runs (an upgrade, a crash): the operator that comes
    # next reads the incarnation from the pods and restarts the group whole.
    prefill = sorted(n for n in pods if n.startswith("pd-prefill-0-"))
    decode = {n: pods[n][0] for n in pods if n.startswith("pd-decode-0-")}
    cluster.kubectl("delete", "pod", prefill[1], "-n", namespace)

    def restarted() -> dict[str, tuple[str, str]] | None:
        now = _pods(cluster, namespace)
        anew = all(n in now and now[n][0] != pods[n][0] for n in prefill)
        return now if anew and len(now) == 4 else None

    with h.running_operator(cluster, operator_kubeconfig, peering):
        now = h.wait_until(restarted, timeout=60, what="both prefill pods replaced (the group restarted whole)")
        assert {n: now[n][0] for n in decode} == decode  # the decode group was left alone
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=GroupRestart")
        assert prefill[0] in events.stdout, events.stdout
        h.delete_all_pdclusters(cluster, namespace)


def _incarnations(cluster: Any, namespace: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: word
        for p in h.agent_pods(cluster, namespace, "pd")
        if (word := p["metadata"].get("annotations", {}).get("pdfabric.dev/group-incarnation"))
    }


def test_a_group_the_scheduler_cannot_bind_whole_is_released_not_left_half_running(
    cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path
) -> None:
    # The planner counts GPUs; the scheduler also counts memory. A pod that is not ours holds most
    # of one node's memory, so of the prefill group only the block planned on the other node binds.
    nodes = gpu_nodes("r", 2, gpus=2)
    filler = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "memory-hog", "namespace": namespace},
        "spec": {
            "nodeName": nodes[1],
            "containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"memory": "1800Gi"}}}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(filler))
    prefill_engine = {"args": GROUP_ARGS, "resources": {"requests": {"memory": "1Ti"}}}
    builder = (
        pdcluster()
        .prefill(tp=2, nodesPerReplica=2)
        .decode(tp=1)
        .engine(prefill=prefill_engine, decode={})
        .placement(nodeSelector=h.selector(namespace))
    )
    env = {"PDFABRIC_GROUP_BIND_TIMEOUT": "3"}
    with h.running_operator(cluster, operator_kubeconfig, f"pdfabric-{namespace}", extra_env=env):
        h.apply_pdc(cluster, builder.manifest(), namespace)

        def released() -> str:
            out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=GroupReleased")
            return str(out.stdout) if "prefill-0 released" in out.stdout else ""

        words = h.wait_until(released, timeout=60, what="the prefill group released")
        assert "Insufficient memory" in words, words

        # Held: none of the group's pods exists (the bound one was deleted too), and the status says why.
        def held() -> dict[str, Any] | None:
            pods = [n for n in _pods(cluster, namespace) if n.startswith("pd-prefill-0-")]
            ready = h.condition(h.pdc(cluster, namespace, "pd"), "Ready") or {}
            return ready if not pods and "group prefill-0 released" in ready.get("message", "") else None

        ready = h.wait_until(held, timeout=30, what="the group held with no pod, the status saying why")
        assert ready["status"] == "False", ready
        # Room again: the group is created once its hold ends and binds whole.
        cluster.kubectl("delete", "pod", "memory-hog", "-n", namespace)

        def bound_whole() -> bool:
            pods = [
                p for p in h.agent_pods(cluster, namespace, "pd") if p["metadata"]["name"].startswith("pd-prefill-0-")
            ]
            return len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods)

        h.wait_until(bound_whole, timeout=60, what="the prefill group bound whole after its hold")
        h.delete_all_pdclusters(cluster, namespace)


def test_kubectl_scale_adds_and_removes_whole_groups(
    cluster: Any, namespace: str, gpu_nodes: Any, operator_kubeconfig: Path
) -> None:
    gpu_nodes("s", 4, gpus=2)
    builder = (
        pdcluster()
        .prefill(tp=2, nodesPerReplica=2)
        .decode(tp=1)
        .engine(prefill={"args": GROUP_ARGS}, decode={})
        .placement(nodeSelector=h.selector(namespace))
    )
    with h.running_operator(cluster, operator_kubeconfig, f"pdfabric-{namespace}"):
        h.apply_pdc(cluster, builder.manifest(), namespace)
        first = h.wait_until(lambda: (p := _pods(cluster, namespace)) and len(p) == 3 and p, timeout=60, what="3 pods")
        cluster.kubectl("scale", "pdrole/pd-prefill", "--replicas", "2", "-n", namespace)

        def grown() -> dict[str, tuple[str, str]] | None:
            pods = _pods(cluster, namespace)
            return pods if len(pods) == 5 else None

        pods = h.wait_until(grown, timeout=60, what="a second prefill group of two pods")
        added = [n for n in pods if n.startswith("pd-prefill-1-")]
        assert len(added) == 2 and len({pods[n][1] for n in added}) == 2, pods  # on two distinct nodes
        assert all(pods[n] == first[n] for n in first), (first, pods)  # what ran was left alone
        placed = h.wait_until(
            lambda: (
                (s := h.pdc(cluster, namespace, "pd").get("status", {})).get("prefill", {}).get("placed") == 2 and s
            ),
            timeout=30,
            what="status counting two prefill replicas (groups)",
        )
        assert placed["prefill"]["desired"] == 2, placed["prefill"]

        cluster.kubectl("scale", "pdrole/pd-prefill", "--replicas", "1", "-n", namespace)
        back = h.wait_until(
            lambda: (p := _pods(cluster, namespace)) and len(p) == 3 and p, timeout=60, what="the second group gone"
        )
        assert back == first  # both of its pods went, nothing else moved
        h.delete_all_pdclusters(cluster, namespace)
