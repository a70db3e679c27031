"""Valid PDClusters for each transport are placed, their agents Running and Ready, printer columns right."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pdfabric_core.rankmap import RankMap
from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, children, condition, selector, wait_ready

# Fixtures live in the harness; binding them here makes pytest see them in this module.
operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator

EFA = "vpc.amazonaws.com/efa"  # EKS's extended resource of EFA devices

# (id, node shapes: (prefix, count, options), builder, expected GPUs per agent pod (a pod per
# placement unit), expected GPUs per node (summed over its pods), the device resource each pod
# requests ("": none))
CASES = [
    # A pod per replica, both on one node (best fit).
    ("tcp", [("plain", 2, {})], pdcluster().prefill(tp=4).decode(tp=4), [4, 4], [8], ""),
    (
        "rdma",
        # Each pod holds an RDMA device of its own: two per node let a node take two pods.
        [("plain", 2, {}), ("rdma", 2, {"rdma_resource": "rdma/hca", "rdma_count": 2})],
        pdcluster().transport("rdma").prefill(replicas=2, tp=4).decode(replicas=1, tp=4),
        [4, 4, 4],
        [4, 8],
        "rdma/hca",
    ),
    (
        "efa",
        # NIXL over EFA: each pod takes one of its node's EFA devices (placement.rdmaResource names them).
        [("plain", 2, {}), ("efa", 2, {"rdma_resource": EFA, "rdma_count": 2})],
        pdcluster()
        .backend("nixl")
        .transport("efa")
        .placement(rdmaResource=EFA)
        .prefill(replicas=2, tp=4)
        .decode(replicas=1, tp=4),
        [4, 4, 4],
        [4, 8],
        EFA,
    ),
    (
        "nvlink-intra",
        [("plain", 2, {})],
        # 6-GPU groups (prefill TP4 + the decode TP2 it feeds): one per 8-GPU node
        pdcluster().transport("nvlink-intra").prefill(replicas=2, tp=4).decode(replicas=2, tp=2),
        [6, 6],
        [6, 6],
        "",
    ),
    (
        "nvlink",
        [("cl", 2, {"clique": "domain-x"}), ("plain", 2, {})],
        pdcluster().transport("nvlink").prefill(replicas=1, tp=8).decode(replicas=2, tp=4),
        [4, 4, 8],
        [8, 8],
        "",
    ),
]


@pytest.mark.parametrize(
    ("shapes", "builder", "gpus", "node_gpus", "device"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_transport_placed_and_ready(
    cluster: Any,
    namespace: str,
    gpu_nodes: Any,
    operator: Any,
    shapes: list,
    builder: Any,
    gpus: list[int],
    node_gpus: list[int],
    device: str,
) -> None:
    node_labels: dict[str, dict[str, str]] = {}
    for prefix, count, opts in shapes:
        for name in gpu_nodes(prefix, count, **opts):
            node_labels[name] = cluster.get_json("node", name)["metadata"]["labels"]
    manifest = builder.placement(
        nodeSelector=selector(namespace), **({"rdmaResource": device} if device else {})
    ).manifest()
    manifest["metadata"]["name"] = "pd"
    apply_pdc(cluster, manifest, namespace)
    obj = wait_ready(cluster, namespace, "pd")
    spec = builder.spec()
    transport = spec.transfer.effective_transport.value

    status = obj["status"]
    assert status["transport"] == transport
    assert condition(obj, "Placed")["status"] == "True"
    assert condition(obj, "TransportReady")["status"] == "True"
    assert condition(obj, "Degraded")["status"] == "False"
    assert status["prefillReady"] == f"{spec.prefill.replicas}/{spec.prefill.replicas}"
    assert status["decodeReady"] == f"{spec.decode.replicas}/{spec.decode.replicas}"
    assert status["expectedBytesPerRequest"]["total"] > 0

    pods = agent_pods(cluster, namespace, "pd")
    assert all(p["status"]["phase"] == "Running" for p in pods)
    per_pod = sorted(h.pod_gpus(p) for p in pods)
    assert per_pod == gpus
    assert sorted(h.gpus_by_node(cluster, namespace, "pd").values()) == node_gpus
    assert len(h.pods_by_unit(cluster, namespace, "pd")) == len(gpus), "a pod per placement unit"
    h.assert_no_duplicates(cluster, namespace, "pd")
    devices_on: dict[str, int] = {}
    for p in pods:
        limits = p["spec"]["containers"][0]["resources"]["limits"]
        assert [k for k in limits if k in ("rdma/hca", EFA)] == ([device] if device else [])
        if device:
            assert limits[device] == "1", "one RDMA (EFA) device per pod"
            devices_on[p["spec"]["nodeName"]] = devices_on.get(p["spec"]["nodeName"], 0) + 1
        labels = node_labels[p["spec"]["nodeName"]]
        if transport in ("rdma", "efa"):
            assert p["spec"]["nodeName"].split("-")[-2] == transport
        if transport == "nvlink":
            assert labels.get("nvidia.com/gpu.clique") == "domain-x"
        assert p["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
        assert env["PDFABRIC_RANKMAP"]["value"] == "/etc/pdfabric/rankmap.json"
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for node, taken in devices_on.items():
        assert taken <= int(cluster.get_json("node", node)["status"]["allocatable"][device]), node
    if transport == "nvlink-intra":
        # each node holds one prefill replica and exactly the decode replica it feeds
        rankmap = RankMap.from_json(
            cluster.get_json("configmap", "pd-rankmap", "-n", namespace)["data"]["rankmap.json"]
        )
        for agent in rankmap.agents:
            prefill = {r.replica for r in agent.ranks if r.role == "prefill"}
            decode = {r.replica for r in agent.ranks if r.role == "decode"}
            assert len(prefill) == 1
            assert decode == set(rankmap.feeds[prefill.pop()])

    kids = children(cluster, namespace, "pd")
    assert kids["configmaps"] == ["pd-rankmap"]
    assert kids["services"] == ["pd-agents"]
    assert kids["secrets"] == sorted(["pd-engine-token", "pd-peer-ca"] + [f"{p}-peer-tls" for p in kids["pods"]])
    assert len(kids["pods"]) == len(gpus)

    table = cluster.kubectl("get", "pdc", "pd", "-n", namespace).stdout.split("\n")
    # Cells by the header's column offsets: a fabric-only cluster leaves the engine columns empty.
    spans = [(m.group(), m.start()) for m in re.finditer(r"\S+", table[0])]
    ends = [start for _, start in spans[1:]] + [None]
    cells = {name: table[1][start:end].strip() for (name, start), end in zip(spans, ends, strict=True)}
    assert list(cells) == [
        "NAME",
        "BACKEND",
        "TRANSPORT",
        "PREFILL",
        "DECODE",
        "PREFILL-ENGINES",
        "DECODE-ENGINES",
        "READY",
        "AGE",
    ]
    assert [cells[k] for k in ("NAME", "BACKEND", "TRANSPORT", "PREFILL", "DECODE", "READY")] == [
        "pd",
        spec.backend.value,
        transport,
        f"{spec.prefill.replicas}/{spec.prefill.replicas}",
        f"{spec.decode.replicas}/{spec.decode.replicas}",
        "True",
    ]
    assert cells["PREFILL-ENGINES"] in ("", "<none>") and cells["DECODE-ENGINES"] in ("", "<none>")
