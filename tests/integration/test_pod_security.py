"""The pods the operator makes under the API server's own Pod Security admission: a namespace that
enforces the "restricted" standard admits the node pods (fabric-only and with spec.engine) and
the router's; a PDCluster whose pods it refuses (root, spec.agent.runAsUser 0) says so in its
Ready condition and an Event, and is created once the namespace's level allows it."""

from __future__ import annotations

from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, condition, pdc, selector, wait_ready, wait_until

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

ENFORCE = "pod-security.kubernetes.io/enforce"


def _enforce(cluster: Any, namespace: str, level: str) -> None:
    cluster.kubectl(
        "label", "namespace", namespace, f"{ENFORCE}={level}", f"{ENFORCE}-version=latest", "--overwrite"
    )  # fmt: skip


def test_restricted_namespace_admits_the_node_pods_and_the_router(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    _enforce(cluster, namespace, "restricted")
    gpu_nodes("r", 2, gpus=8)
    fabric = pdcluster("fabric").prefill(tp=2).decode(tp=2).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, fabric.manifest(), namespace)
    wait_ready(cluster, namespace, "fabric")
    serving = (
        pdcluster("serving")
        .prefill(tp=1)
        .decode(tp=1)
        .placement(nodeSelector=selector(namespace))
        .engine()
        .router(nodeSelector=selector(namespace))
    )
    apply_pdc(cluster, serving.manifest(), namespace)
    # A node pod per replica, each admitted.
    pods = wait_until(
        lambda: (lambda p: p if len(p) == 2 else None)(agent_pods(cluster, namespace, "serving")),
        timeout=60,
        what="the engine node pods",
    )
    assert sorted(h.pod_unit(p) for p in pods) == ["decode-0", "prefill-0"]
    for pod in pods:
        ctx = pod["spec"]["securityContext"]
        assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["seccompProfile"]["type"]) == (
            True,
            65532,
            "RuntimeDefault",
        )
    router = wait_until(
        lambda: cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=router")["items"],
        timeout=60,
        what="the router's pod (its ReplicaSet admitted by Pod Security)",
    )
    assert router[0]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert condition(pdc(cluster, namespace, "serving"), "Ready")["reason"] != "PodRejected"  # type: ignore[index]


def test_a_refused_node_pod_is_reported_and_created_once_admitted(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    _enforce(cluster, namespace, "restricted")
    gpu_nodes("p", 1, gpus=8)
    root = pdcluster("root").placement(nodeSelector=selector(namespace)).agent(runAsUser=0)
    apply_pdc(cluster, root.manifest(), namespace)

    def refused() -> dict[str, Any] | None:
        ready = condition(pdc(cluster, namespace, "root"), "Ready")
        return ready if ready is not None and ready["reason"] == "PodRejected" else None

    ready = wait_until(refused, timeout=60, what="Ready=False with reason PodRejected")
    assert ready["status"] == "False"
    assert 'violates PodSecurity "restricted:latest"' in ready["message"], ready["message"]
    assert "runAsNonRoot" in ready["message"], ready["message"]  # the server says what to change
    assert not agent_pods(cluster, namespace, "root")
    events = wait_until(
        lambda: [
            e
            for e in cluster.get_json("events", "-n", namespace)["items"]
            if e.get("reason") == "PodRejected" and e["involvedObject"]["name"] == "root"
        ],
        timeout=30,
        what="a PodRejected Event on the PDCluster",
    )
    assert events[0]["type"] == "Warning"

    _enforce(cluster, namespace, "baseline")  # root is baseline
    obj = wait_ready(cluster, namespace, "root")
    assert condition(obj, "Ready")["reason"] == "AgentsReady"  # type: ignore[index]
    pods = h.pods_by_unit(cluster, namespace, "root")
    assert sorted(pods) == ["decode-0", "prefill-0"]
    for pod in pods.values():
        ctx = pod["spec"]["securityContext"]
        assert ctx["runAsUser"] == 0 and "runAsNonRoot" not in ctx
