"""The local control plane is a real one: scheduler, kwok, garbage collector, RBAC, CRD validation."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from pdfabric_devcluster.binaries import wait_for


def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {"name": "main", "image": "example/worker:1", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            ]
        },
    }


def test_fake_gpu_nodes_look_like_gpu_operator_nodes(cluster: Any) -> None:
    nodes = {n["metadata"]["name"]: n for n in cluster.get_json("nodes")["items"]}
    assert {"gb200-0", "gb200-1", "h200-rdma-0", "h200-rdma-1", "h200-0", "h200-1"} <= set(nodes)
    for node in nodes.values():
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"].startswith("NVIDIA-")
    cliques = {n: nodes[n]["metadata"]["labels"].get("nvidia.com/gpu.clique") for n in nodes}
    assert cliques["gb200-0"] == cliques["gb200-1"] == "clique-a.1"
    assert cliques["h200-0"] is None
    assert nodes["h200-rdma-0"]["status"]["allocatable"]["rdma/hca"] == "1"
    assert "rdma/hca" not in nodes["h200-0"]["status"]["allocatable"]


def test_gpu_pod_is_scheduled_onto_a_gpu_node_and_runs(cluster: Any, namespace: str) -> None:
    cluster.apply(gpu_pod("worker", 4), namespace=namespace)

    def running() -> dict[str, Any] | None:
        pod = cluster.get_json("pod", "worker", "-n", namespace)
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_for(running, timeout=60, interval=0.25, what="the GPU pod to run")
    node = cluster.get_json("node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    ready = [c for c in pod["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def test_pod_needing_more_gpus_than_any_node_stays_pending_with_scheduler_reason(cluster: Any, namespace: str) -> None:
    cluster.apply(gpu_pod("too-big", 16), namespace=namespace)

    def unschedulable() -> dict[str, Any] | None:
        pod = cluster.get_json("pod", "too-big", "-n", namespace)
        conds = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return conds[0] if conds and conds[0].get("reason") == "Unschedulable" else None

    cond = wait_for(unschedulable, timeout=60, interval=0.25, what="the scheduler to report the pod unschedulable")
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    assert cluster.get_json("pod", "too-big", "-n", namespace)["status"]["phase"] == "Pending"


def test_deleting_an_owner_deletes_its_dependents(cluster: Any, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=a=b")
    owner = cluster.get_json("configmap", "owner", "-n", namespace)
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
            ],
        },
        "data": {"x": "y"},
    }
    cluster.apply(dependent, namespace=namespace)
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(
        lambda: cluster.kubectl("get", "configmap", "dependent", "-n", namespace, check=False).returncode != 0,
        timeout=60,
        interval=0.25,
        what="the garbage collector to delete the dependent",
    )


def test_service_account_is_refused_without_a_role_and_allowed_with_one(cluster: Any, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    reader = cluster.service_account_kubeconfig(namespace, "reader")

    def as_reader(*args: str) -> Any:
        return cluster.kubectl(*args, "-n", namespace, kubeconfig=reader, check=False)

    denied = as_reader("get", "pods")
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:reader" in denied.stderr

    cluster.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace)
    cluster.kubectl(
        "create", "rolebinding", "reader", "--role=pod-reader", f"--serviceaccount={namespace}:reader", "-n", namespace
    )
    allowed = wait_for(
        lambda: (r := as_reader("get", "pods")).returncode == 0 and r,
        timeout=30,
        interval=0.25,
        what="the RoleBinding to take effect",
    )
    assert allowed.returncode == 0
    # the Role grants pod reads only
    write = as_reader("create", "configmap", "nope", "--from-literal=a=b")
    assert write.returncode != 0 and "forbidden" in write.stderr.lower()


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.pdfabric.dev"},
    "spec": {
        "group": "test.pdfabric.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "min": {"type": "integer"},
                                    "max": {"type": "integer"},
                                },
                                "x-kubernetes-validations": [
                                    {"rule": "self.min <= self.max", "message": "min must not exceed max: lower min"}
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "test.pdfabric.dev/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def widget_crd(cluster: Any) -> None:
    cluster.apply(WIDGET_CRD)
    wait_for(
        lambda: cluster.kubectl("get", "widgets", "-A", check=False).returncode == 0,
        timeout=30,
        interval=0.25,
        what="the Widget CRD to be served",
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"size": 0, "min": 1, "max": 2}, "should be greater than or equal to 1"),
        ({"size": "big", "min": 1, "max": 2}, 'Invalid value: "string": spec.size in body must be of type integer'),
        ({"size": 1, "min": 3, "max": 2}, "min must not exceed max: lower min"),
    ],
    ids=["openapi-minimum", "openapi-type", "cel-rule"],
)
def test_crd_schema_and_cel_reject_invalid_objects(
    cluster: Any, namespace: str, widget_crd: None, spec: dict[str, Any], message: str
) -> None:
    proc = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(widget("bad", **spec)), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert cluster.kubectl("get", "widget", "bad", "-n", namespace, check=False).returncode != 0
    # a valid one passes
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(widget("good", size=1, min=1, max=2)))


def test_lost_node_reports_not_ready_and_comes_back(cluster: Any) -> None:
    from pdfabric_devcluster.nodes import GpuNodeShape

    (name,) = cluster.add_gpu_nodes([GpuNodeShape(f"flaky{int(time.time()) % 100000}", 1)])
    cluster.set_node_down(name)
    wait_for(lambda: name not in cluster.ready_nodes(), timeout=30, interval=0.25, what=f"{name} NotReady")
    cluster.set_node_down(name, down=False)
    cluster.wait_nodes_ready([name], timeout=30)
    cluster.delete_nodes([name])
