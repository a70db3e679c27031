"""Level-based repair: scale changes, deleted children, lost nodes and deletion all converge."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from typing import Any

import pytest
from cryptography import x509
from prometheus_client import REGISTRY

from pdfabric_core.rankmap import RankMap
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import (
    agent_pods,
    apply_pdc,
    children,
    condition,
    pdc,
    selector,
    wait_ready,
    wait_until,
)

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator


def _rankmap(cluster: Any, namespace: str) -> RankMap:
    return RankMap.from_json(cluster.get_json("configmap", "pd-rankmap", "-n", namespace)["data"]["rankmap.json"])


def _gpus_by_node(cluster: Any, namespace: str) -> dict[str, int]:
    """GPUs of the cluster's agent pods on each node (a node may carry several of its pods)."""
    return h.gpus_by_node(cluster, namespace, "pd")


def _no_duplicates(cluster: Any, namespace: str) -> None:
    """No unit with two pods on a node, no rank held twice (see the harness)."""
    h.assert_no_duplicates(cluster, namespace, "pd")


def test_scale_up_and_down(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 3)
    builder = pdcluster().prefill(replicas=1, tp=4).decode(replicas=1, tp=4).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    assert sum(_gpus_by_node(cluster, namespace).values()) == 8

    apply_pdc(cluster, builder.prefill(replicas=2).decode(replicas=2).manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["status"]["prefillReady"] == "2/2" and obj["status"]["decodeReady"] == "2/2"
    wait_until(lambda: sum(_gpus_by_node(cluster, namespace).values()) == 16, timeout=30, what="16 GPUs of agents")
    _no_duplicates(cluster, namespace)
    # A pod per replica, packed onto two of the three nodes (best fit).
    agents = _rankmap(cluster, namespace).agents
    assert len(agents) == 4 and len({a.node for a in agents}) == 2, agents

    apply_pdc(cluster, builder.prefill(replicas=1).decode(replicas=1).manifest(), namespace)
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["status"]["prefillReady"] == "1/1"
    wait_until(lambda: sum(_gpus_by_node(cluster, namespace).values()) == 8, timeout=30, what="back to 8 GPUs")
    _no_duplicates(cluster, namespace)


def test_deleted_children_come_back(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 2)
    apply_pdc(
        cluster,
        pdcluster().prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).manifest(),
        namespace,
    )
    wait_ready(cluster, namespace, "pd")
    before = children(cluster, namespace, "pd")
    token = cluster.get_json("secret", "pd-engine-token", "-n", namespace)["data"]["token"]
    pod = before["pods"][0]
    serial = _cert_serial(cluster, namespace, pod)
    cluster.kubectl("delete", "pod", pod, "-n", namespace, "--wait=false")
    cluster.kubectl("delete", "configmap/pd-rankmap", "service/pd-agents", "secret/pd-engine-token", "-n", namespace)
    wait_until(lambda: children(cluster, namespace, "pd") == before, timeout=30, what="children recreated")
    wait_ready(cluster, namespace, "pd")
    _no_duplicates(cluster, namespace)
    # A lost Secret gets a new token (agents re-read it); it is never empty.
    assert cluster.get_json("secret", "pd-engine-token", "-n", namespace)["data"]["token"] not in ("", token)
    # The replaced pod came with a new certificate (rotation); the other agent kept its own.
    assert _cert_serial(cluster, namespace, pod) != serial


def _cert_serial(cluster: Any, namespace: str, agent: str) -> str:
    secret = cluster.get_json("secret", f"{agent}-peer-tls", "-n", namespace)
    return str(secret["metadata"]["annotations"]["pdfabric.dev/cert-serial"])


def test_operator_issues_the_peer_ca_and_one_certificate_per_agent_pod(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("n", 2)
    apply_pdc(
        cluster,
        pdcluster().prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).manifest(),
        namespace,
    )
    wait_ready(cluster, namespace, "pd")
    pods = agent_pods(cluster, namespace, "pd")
    kids = children(cluster, namespace, "pd")
    want = ["pd-engine-token", "pd-peer-ca", *sorted(f"{p['metadata']['name']}-peer-tls" for p in pods)]
    assert kids["secrets"] == sorted(want)
    ca_secret = cluster.get_json("secret", "pd-peer-ca", "-n", namespace)
    ca = x509.load_pem_x509_certificate(base64.b64decode(ca_secret["data"]["tls.crt"]))
    uid = pdc(cluster, namespace, "pd")["metadata"]["uid"]
    for secret in [ca_secret, *(cluster.get_json("secret", n, "-n", namespace) for n in want[:1] + want[2:])]:
        assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [uid]
    for pod in pods:
        name = pod["metadata"]["name"]
        # Each pod mounts its own certificate and the engine token, never the CA's key or another's.
        mounted = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        assert mounted == {"pd-engine-token", f"{name}-peer-tls"}
        data = cluster.get_json("secret", f"{name}-peer-tls", "-n", namespace)["data"]
        assert set(data) == {"tls.crt", "tls.key", "ca.crt"}
        cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
        cert.verify_directly_issued_by(ca)
        assert base64.b64decode(data["ca.crt"]) == base64.b64decode(ca_secret["data"]["tls.crt"])
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [f"{name}.pd-agents.{namespace}.svc"]
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == name
    # Only the cluster's own agents reach its agents (the peer door, Mooncake's listeners).
    policy = cluster.get_json("networkpolicy", "pd-agents", "-n", namespace)
    assert policy["spec"]["podSelector"]["matchLabels"]["pdfabric.dev/cluster-uid"] == uid
    assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [uid]
    # The headless Service carries the peer door (and metrics), not the engine door.
    svc = cluster.get_json("service", "pd-agents", "-n", namespace)
    assert sorted((p["name"], p["port"]) for p in svc["spec"]["ports"]) == [("metrics", 9400), ("peer", 7401)]


@pytest.mark.parametrize("how", ["not-ready", "deleted"])
def test_lost_node_ranks_are_replaced(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, how: str) -> None:
    gpu_nodes("n", 3)
    builder = pdcluster().prefill(replicas=2, tp=4).decode(replicas=1, tp=4).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    before = _gpus_by_node(cluster, namespace)
    victim = sorted(before)[0]
    if how == "not-ready":
        cluster.set_node_down(victim)
    else:
        cluster.delete_nodes([victim])
    wait_until(
        lambda: (
            victim not in _gpus_by_node(cluster, namespace) and sum(_gpus_by_node(cluster, namespace).values()) == 12
        ),
        timeout=90,
        what=f"ranks moved off {victim}",
    )
    obj = wait_ready(cluster, namespace, "pd", timeout=60)
    assert victim not in {p["node"] for p in obj["status"]["placement"]}
    # Ranks on healthy nodes stayed where they were.
    after = _gpus_by_node(cluster, namespace)
    for node, gpus in before.items():
        if node != victim:
            assert after.get(node, 0) >= gpus
    _no_duplicates(cluster, namespace)
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "False", (degraded, obj["status"].get("placement"))
    if how == "not-ready":
        cluster.set_node_down(victim, down=False)


def test_deletion_leaves_no_orphans(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 2)
    apply_pdc(
        cluster,
        pdcluster().prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).manifest(),
        namespace,
    )
    obj = wait_ready(cluster, namespace, "pd")
    assert obj["metadata"]["finalizers"] == ["pdfabric.dev/finalizer"]
    cluster.kubectl("delete", "pdcluster", "pd", "-n", namespace, "--wait=false")
    wait_until(lambda: not cluster.get_json("pdclusters", "-n", namespace)["items"], timeout=30, what="PDCluster gone")
    empty = {"pods": [], "configmaps": [], "services": [], "secrets": []}
    wait_until(lambda: children(cluster, namespace, "pd") == empty, timeout=30, what="children gone")
    # A namesake created afterwards starts from scratch (children are keyed by uid, not name).
    apply_pdc(cluster, pdcluster().placement(nodeSelector=selector(namespace)).manifest(), namespace)
    new = wait_ready(cluster, namespace, "pd")
    assert new["metadata"]["uid"] != obj["metadata"]["uid"]
    labels = {p["metadata"]["labels"]["pdfabric.dev/cluster-uid"] for p in agent_pods(cluster, namespace, "pd")}
    assert labels == {new["metadata"]["uid"]}


def test_deletion_keeps_a_users_objects_that_carry_a_childs_name(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any
) -> None:
    gpu_nodes("n", 1)
    # Names of children a fabric-only cluster never makes (engine Services, the router's), the
    # user's own: neither the unplaceable path nor the finalizer's cleanup may delete them.
    for name in ("pd-prefill", "pd-router"):
        cluster.kubectl("create", "service", "clusterip", name, "--tcp=80:80", "-n", namespace)
    cluster.kubectl("create", "configmap", "pd-router", "--from-literal=a=b", "-n", namespace)
    too_big = pdcluster().prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, too_big.manifest(), namespace)
    wait_until(
        lambda: (condition(pdc(cluster, namespace, "pd"), "Placed") or {}).get("reason") == "InsufficientGPUs",
        timeout=30,
        what="pd unplaced",
    )
    apply_pdc(cluster, pdcluster().placement(nodeSelector=selector(namespace)).manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    cluster.kubectl("delete", "pdcluster", "pd", "-n", namespace)
    wait_until(
        lambda: not cluster.get_json("secrets", "-n", namespace, "-l", "pdfabric.dev/cluster=pd")["items"],
        timeout=30,
        what="the cluster's own children gone",
    )
    kept = {s["metadata"]["name"] for s in cluster.get_json("services", "-n", namespace)["items"]}
    assert {"pd-prefill", "pd-router"} <= kept
    assert cluster.get_json("configmap", "pd-router", "-n", namespace)["data"] == {"a": "b"}


def test_status_not_rewritten_when_steady(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 1)
    apply_pdc(cluster, pdcluster().placement(nodeSelector=selector(namespace)).manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    rv = pdc(cluster, namespace, "pd")["metadata"]["resourceVersion"]
    before = REGISTRY.get_sample_value("pdfabric_operator_reconciles_total", {"result": "ready"}) or 0
    # Several reconcile intervals (1 s in tests) pass; nothing changed, so nothing is written.
    time.sleep(4)
    after = REGISTRY.get_sample_value("pdfabric_operator_reconciles_total", {"result": "ready"}) or 0
    assert after - before >= 2, "the periodic reconcile ran"
    assert pdc(cluster, namespace, "pd")["metadata"]["resourceVersion"] == rv


def test_agent_image_change_rolls_out(cluster: Any, namespace: str, gpu_nodes: Any, operator: Any) -> None:
    gpu_nodes("n", 3)
    builder = pdcluster().prefill(replicas=2, tp=8).decode(tp=8).placement(nodeSelector=selector(namespace))
    apply_pdc(cluster, builder.manifest(), namespace)
    wait_ready(cluster, namespace, "pd")
    nodes_before = _gpus_by_node(cluster, namespace)
    # Every Ready the operator writes during the roll, from a watch (fake pods turn Ready at once,
    # so the steps are too quick to sample).
    ready_path = '{.status.conditions[?(@.type=="Ready")].status}/{.status.conditions[?(@.type=="Ready")].reason}'
    watch = subprocess.Popen(
        [
            str(cluster.bin_dir / "kubectl"),
            "get",
            "pdc",
            "pd",
            "-n",
            namespace,
            "-w",
            "-o",
            f'jsonpath={ready_path}{{"\\n"}}',
        ],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        apply_pdc(cluster, builder.agent(image="pdfabric/agent:v2").manifest(), namespace)

        def rolled() -> bool:
            pods = agent_pods(cluster, namespace, "pd")
            return len(pods) == 3 and all(p["spec"]["containers"][0]["image"] == "pdfabric/agent:v2" for p in pods)

        wait_until(rolled, timeout=60, what="every agent on the new image")
        obj = wait_ready(cluster, namespace, "pd")
    finally:
        watch.terminate()
    seen = (watch.communicate(timeout=10)[0] or "").split()
    assert condition(obj, "Ready")["reason"] == "AgentsReady"  # type: ignore[index]
    # Old pods serve while they wait for their turn: Ready is True between replacements (False
    # only while a replaced node's agent is gone).
    assert seen.count("True/RollingUpdate") >= 2, seen
    assert _gpus_by_node(cluster, namespace) == nodes_before, "an image change moves no ranks"
    rankmap = json.loads(cluster.get_json("configmap", "pd-rankmap", "-n", namespace)["data"]["rankmap.json"])
    assert rankmap["spec"]["agent"]["image"] == "pdfabric/agent:v2"
