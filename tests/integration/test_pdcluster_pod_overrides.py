"""Pod overrides on the real API server: a PDCluster with a weights volume, a pull secret, a
toleration and a priority class produces node and router pods that carry them, admitted under the
"restricted" Pod Security level and bound by the scheduler to the tainted node they tolerate."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, condition, pdc, selector, wait_ready, wait_until

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

ENFORCE = "pod-security.kubernetes.io/enforce"
TOLERATION = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}


@pytest.fixture
def priority_class(cluster: Any, namespace: str) -> Iterator[str]:
    """A PriorityClass of this test's own (they are cluster-wide)."""
    name = f"{namespace}-high"[:253]
    body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}, "value": 1000}
    cluster.apply(body)
    yield name
    cluster.kubectl("delete", "priorityclass", name, "--ignore-not-found", check=False)


@pytest.fixture
def weights_claim(cluster: Any, namespace: str) -> Iterator[str]:
    """A PersistentVolumeClaim bound to a static volume (no provisioner here): the model weights."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-weights"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": "/srv/weights"},
            "claimRef": {"namespace": namespace, "name": "weights"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv["metadata"]["name"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    cluster.apply(pv)
    cluster.apply(pvc, namespace=namespace)
    wait_until(
        lambda: cluster.get_json("pvc", "weights", "-n", namespace)["status"].get("phase") == "Bound",
        timeout=60,
        what="the weights claim to be bound",
    )
    yield "weights"
    cluster.kubectl("delete", "pv", pv["metadata"]["name"], "--wait=false", "--ignore-not-found", check=False)


def _pull_secret(cluster: Any, namespace: str) -> None:
    config = base64.b64encode(json.dumps({"auths": {}}).encode()).decode()
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "registry", "namespace": namespace},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": config},
        },
        namespace=namespace,
    )


def _overrides(priority: str) -> dict[str, Any]:
    return {
        "labels": {"team": "inference"},
        "annotations": {"example.com/owner": "ml-platform"},
        "tolerations": [TOLERATION],
        "priorityClassName": priority,
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}],
        "volumeMounts": [{"name": "weights", "mountPath": "/models", "readOnly": True}],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    }


def _carries(pod: dict[str, Any], priority: str, node: str) -> None:
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert {"name": "weights", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    assert {"name": "weights", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert TOLERATION in spec["tolerations"]
    # The Priority admission plugin resolved the class: the scheduler orders and preempts by it.
    assert (spec["priorityClassName"], spec["priority"]) == (priority, 1000)
    assert pod["metadata"]["labels"]["team"] == "inference"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    assert spec["nodeName"] == node, "the scheduler bound it to the tainted node it tolerates"


def test_weights_pull_secret_toleration_and_priority_reach_the_pods_under_restricted(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, priority_class: str, weights_claim: str
) -> None:
    cluster.kubectl("label", "namespace", namespace, f"{ENFORCE}=restricted", f"{ENFORCE}-version=latest")
    (node,) = gpu_nodes("w", 1, gpus=8)
    cluster.kubectl("taint", "node", node, "dedicated=inference:NoSchedule")
    _pull_secret(cluster, namespace)
    sel = selector(namespace)
    pod = _overrides(priority_class)

    # Without the toleration the only node is out of reach, and the status says why.
    apply_pdc(cluster, pdcluster("bare").placement(nodeSelector=sel).manifest(), namespace)
    placed = wait_until(
        lambda: (lambda c: c if c and c["reason"] == "NoGPUNodes" else None)(
            condition(pdc(cluster, namespace, "bare"), "Placed")
        ),
        timeout=30,
        what="bare to be unplaced",
    )
    assert "dedicated=inference:NoSchedule" in placed["message"]
    cluster.kubectl("delete", "pdcluster", "bare", "-n", namespace)

    fabric = pdcluster("weights").prefill(tp=2).decode(tp=2).placement(nodeSelector=sel).agent(pod=pod)
    apply_pdc(cluster, fabric.manifest(), namespace)
    obj = wait_ready(cluster, namespace, "weights", timeout=60)
    assert condition(obj, "Ready")["reason"] == "AgentsReady"  # type: ignore[index]
    agents = h.pods_by_unit(cluster, namespace, "weights")
    assert sorted(agents) == ["decode-0", "prefill-0"], "a node pod per replica"
    for agent in agents.values():
        _carries(agent, priority_class, node)

    serving = pdcluster("serving").placement(nodeSelector=sel).agent(pod=pod).engine().router(nodeSelector=sel, pod=pod)
    apply_pdc(cluster, serving.manifest(), namespace)
    engine_pods = wait_until(
        lambda: (lambda b: b if len(b) == 2 else None)(
            [p for p in agent_pods(cluster, namespace, "serving") if p["spec"].get("nodeName")]
        ),
        timeout=60,
        what="the engine node pods (a pod per replica), bound",
    )
    assert sorted(h.pod_unit(p) for p in engine_pods) == ["decode-0", "prefill-0"]
    for engine_pod in engine_pods:
        _carries(engine_pod, priority_class, node)
    router = wait_until(
        lambda: [
            p
            for p in cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=router")["items"]
            if p["spec"].get("nodeName")
        ],
        timeout=60,
        what="the router's pod, admitted under restricted and bound",
    )
    _carries(router[0], priority_class, node)
    ready = condition(pdc(cluster, namespace, "serving"), "Ready")
    assert ready is not None and ready["reason"] not in ("PodRejected", "PodUnschedulable"), ready


def test_a_missing_priority_class_is_reported_by_the_api_servers_word(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("m", 1, gpus=8)
    spec = pdcluster().placement(nodeSelector=selector(namespace)).agent(pod={"priorityClassName": "no-such-class"})
    apply_pdc(cluster, spec.manifest(), namespace)

    def refused() -> dict[str, Any] | None:
        ready = condition(pdc(cluster, namespace, "pd"), "Ready")
        return ready if ready is not None and ready["reason"] == "PodRejected" else None

    ready = wait_until(refused, timeout=60, what="Ready=False/PodRejected")
    assert "no-such-class" in ready["message"], ready
    assert not agent_pods(cluster, namespace, "pd")


def test_a_volume_or_variable_reading_the_operators_secrets_is_refused_by_the_operator(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("s", 1, gpus=8)
    sel = selector(namespace)
    # CEL cannot see a volume's source: the API server accepts these, the operator refuses them.
    cases = {
        "vol": {"volumes": [{"name": "ca", "secret": {"secretName": "vol-peer-ca"}}]},
        "env": {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "env-peer-ca", "key": "tls.key"}}}]},
    }
    for name, pod in cases.items():
        apply_pdc(cluster, pdcluster(name).placement(nodeSelector=sel).agent(pod=pod).manifest(), namespace)
    for name in cases:
        ready = wait_until(
            lambda n=name: (lambda c: c if c and c["reason"] == "InvalidSpec" else None)(
                condition(pdc(cluster, namespace, n), "Ready")
            ),
            timeout=30,
            what=f"{name}: Ready=False/InvalidSpec",
        )
        assert f"{name}-peer-ca" in ready["message"], ready
        assert agent_pods(cluster, namespace, name) == []
