"""spec.engine on the real control plane: the node pods the operator builds (engine containers,
their GPUs, env, IPC and shared memory, probes), the per-role Services, the status a PD router
reads, rolling replacement on an engine change, and back to fabric-only. The operator runs under
the chart's ServiceAccount, so a missing RBAC rule fails here."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, selector, wait_ready, wait_until

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator


def _builder(namespace: str) -> Any:
    return (
        pdcluster()
        .prefill(replicas=2, tp=1)
        .decode(replicas=1, tp=2)
        .placement(nodeSelector=selector(namespace))
        .engine(decode={"resources": {"limits": {"memory": "2Gi"}}})
    )


def _engine_image(pod: dict[str, Any]) -> str:
    return next(c["image"] for c in pod["spec"]["containers"] if c["name"] != "agent")


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def test_engine_pods_services_and_status(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    (node,) = gpu_nodes("e", 1, gpus=8)
    apply_pdc(cluster, _builder(namespace).manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd")
    (pod,) = agent_pods(cluster, namespace, "pd")
    c = _containers(pod)
    assert list(c) == ["agent", "prefill-0", "prefill-1", "decode-0"]
    gpus = {n: (x["resources"].get("limits") or {}).get("nvidia.com/gpu") for n, x in c.items()}
    assert gpus == {"agent": None, "prefill-0": "1", "prefill-1": "1", "decode-0": "2"}
    assert c["decode-0"]["resources"]["limits"]["memory"] == "2Gi"
    spec = pod["spec"]
    assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork"))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    for x in c.values():
        assert not (x.get("securityContext") or {}).get("privileged")
        assert {m["name"]: m["mountPath"] for m in x["volumeMounts"]}["dshm"] == "/dev/shm"
    env = {e["name"]: e.get("value") for e in c["prefill-1"]["env"]}
    assert env["PDFABRIC_AGENT_ADDRESS"] == "127.0.0.1:7400"
    assert env["PDFABRIC_ENGINE_TOKEN_FILE"] == "/etc/pdfabric/engine-token/token"
    assert (env["PDFABRIC_REPLICA"], env["PDFABRIC_RANK"], env["PDFABRIC_PORT"]) == ("1", "prefill-1-tp0-cp0", "30001")
    assert not any(k in env for k in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))
    probe = c["prefill-1"]["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/health", "p-http-1")
    assert c["decode-0"]["startupProbe"]["httpGet"]["port"] == "d-http-0"

    # Status: engines per role, the conditions, and the endpoints a router takes.
    st = obj["status"]
    assert st["engines"] == {"prefill": {"desired": 2, "ready": 2}, "decode": {"desired": 1, "ready": 1}}
    assert (st["prefillEnginesReady"], st["decodeEnginesReady"]) == ("2/2", "1/1")
    assert h.condition(obj, "EnginesReady")["status"] == "True"
    host = f"{pod['metadata']['name']}.pd-agents.{namespace}.svc"
    assert [(e["url"], e["bootstrap"]) for e in st["endpoints"]["prefill"]] == [
        (f"http://{host}:30000", f"{host}:8998"),
        (f"http://{host}:30001", f"{host}:8999"),
    ]
    assert [e["url"] for e in st["endpoints"]["decode"]] == [f"http://{host}:31000"]
    assert st["services"] == {"prefill": "pd-prefill", "decode": "pd-decode"}
    table = cluster.kubectl("get", "pdc", "pd", "-n", namespace).stdout
    assert "PREFILL-ENGINES" in table and "2/2" in table

    # The per-role Services select this pod, ports named after the k-th engine.
    svc = cluster.get_json("service", "pd-prefill", "-n", namespace)
    assert svc["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http-0", 30000, "p-http-0"),
        ("boot-0", 8998, "p-boot-0"),
        ("http-1", 30001, "p-http-1"),
        ("boot-1", 8999, "p-boot-1"),
    ]
    assert pod["metadata"]["labels"]["pdfabric.dev/serves-prefill"] == "true"
    dsvc = cluster.get_json("service", "pd-decode", "-n", namespace)
    assert [p["targetPort"] for p in dsvc["spec"]["ports"]] == ["d-http-0"]

    # Back to fabric-only: one container with every GPU, the engines' Services and status gone.
    manifest = _builder(namespace).manifest()
    del manifest["spec"]["engine"]
    cluster.kubectl("replace", "-n", namespace, "-f", "-", input=json.dumps(manifest))

    def fabric_only() -> bool:
        pods = agent_pods(cluster, namespace, "pd")
        return len(pods) == 1 and [x["name"] for x in pods[0]["spec"]["containers"]] == ["agent"]

    wait_until(fabric_only, timeout=60, what="the pod without engines")
    obj = wait_ready(cluster, namespace, "pd")
    assert "engines" not in obj["status"] and "endpoints" not in obj["status"]
    assert h.condition(obj, "EnginesReady") is None
    wait_until(
        lambda: cluster.kubectl("get", "service", "pd-prefill", "-n", namespace, check=False).returncode != 0,
        timeout=30,
        what="the prefill engines' Service to go",
    )
    (pod,) = agent_pods(cluster, namespace, "pd")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod["spec"]["nodeName"] == node


def test_engine_change_rolls_pods_one_at_a_time(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("r", 3, gpus=8)
    builder = pdcluster().prefill(replicas=2, tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).engine()
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    before = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert len(before) == 3
    apply_pdc(cluster, builder.engine(image="pdfabric/refengine:v2").manifest(), namespace)

    most_gone = 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        items = cluster.get_json("pods", "-n", namespace, "-l", "pdfabric.dev/cluster=pd")["items"]
        live = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        new = [p for p in live if _engine_image(p) == "pdfabric/refengine:v2"]
        old_ready = [p for p in live if p not in new and p["metadata"]["uid"] in before.values()]
        most_gone = max(most_gone, 3 - len(old_ready) - len(new))
        if len(new) == 3 and all(p["status"].get("phase") == "Running" for p in new):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the engine image change did not reach every pod")
    assert most_gone <= 1, "more than one node pod was down at once"
    after = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert set(after) == set(before), "an engine change moves no ranks"
    assert not set(after.values()) & set(before.values()), "every pod was replaced"
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["status"]["engines"]["prefill"] == {"desired": 2, "ready": 2}
