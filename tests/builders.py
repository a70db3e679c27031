"""Fluent test objects, valid by default: pdcluster().prefill(tp=2).decode(tp=4), gpu_node(clique=...)."""

from __future__ import annotations

import copy
from typing import Any

from pdfabric_core.spec import PDClusterSpec, parse_spec
from pdfabric_operator.placement import GpuNode, PlacedPod
from pdfabric_operator.scheduling import Taint

# A model small enough for real agents on 2 cores yet with every pool kind: KV pages of 4 tokens,
# 4 state layers (so CP4 layer split has one each) and three aux rows.
SMALL_MODEL: dict[str, Any] = {
    "layers": 2,
    "kvHeads": 4,
    "headDim": 32,
    "pageSizeTokens": 4,
    "stateBytesPerRequest": 1024,
    "stateLayers": 4,
    "auxRowBytes": [16, 8, 40],
}


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `patch` into a copy of `base` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class PDClusterBuilder:
    """Builds a PDCluster manifest (camelCase spec as users write it)."""

    def __init__(self, name: str = "pd", namespace: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._spec: dict[str, Any] = {
            "backend": "mooncake",
            "prefill": {"replicas": 1, "tp": 1},
            "decode": {"replicas": 1, "tp": 1},
        }  # no agent.image: the operator's default follows the transport (core images.py)

    def _section(self, key: str, **fields: Any) -> PDClusterBuilder:
        self._spec.setdefault(key, {}).update(fields)
        return self

    def backend(self, name: str) -> PDClusterBuilder:
        self._spec["backend"] = name
        return self

    def prefill(self, **fields: Any) -> PDClusterBuilder:
        return self._section("prefill", **fields)

    def decode(self, **fields: Any) -> PDClusterBuilder:
        return self._section("decode", **fields)

    def transfer(self, **fields: Any) -> PDClusterBuilder:
        return self._section("transfer", **fields)

    def model(self, **fields: Any) -> PDClusterBuilder:
        return self._section("model", **fields)

    def placement(self, **fields: Any) -> PDClusterBuilder:
        return self._section("placement", **fields)

    def agent(self, **fields: Any) -> PDClusterBuilder:
        return self._section("agent", **fields)

    def engine(self, image: str = "pdfabric/refengine:test", **fields: Any) -> PDClusterBuilder:
        """spec.engine with a launch line per role; `fields` merge over it (prefill={...}, ...)."""
        base: dict[str, Any] = {
            "image": image,
            "prefill": {
                "command": ["python3", "-m", "sglang.launch_server"],
                "args": ["--disaggregation-mode", "prefill"],
            },
            "decode": {
                "command": ["python3", "-m", "sglang.launch_server"],
                "args": ["--disaggregation-mode", "decode"],
            },
        }
        self._spec["engine"] = merge(base, fields)
        return self

    def router(self, image: str = "lmsysorg/sglang-router:test", **fields: Any) -> PDClusterBuilder:
        """spec.router (it needs spec.engine)."""
        self._spec["router"] = {"image": image, **fields}
        return self

    def transport(self, transport: str, mem_pool: str | None = None) -> PDClusterBuilder:
        pool = mem_pool or {"nvlink-intra": "INTRA_NODE_NVLINK", "nvlink": "NVLINK"}.get(transport, "NONE")
        return self.transfer(transport=transport, memPool=pool)

    def raw_spec(self) -> dict[str, Any]:
        return copy.deepcopy(self._spec)

    def spec(self) -> PDClusterSpec:
        return parse_spec(self._spec)

    def manifest(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self._name}
        if self._namespace:
            meta["namespace"] = self._namespace
        return {"apiVersion": "pdfabric.dev/v1alpha1", "kind": "PDCluster", "metadata": meta, "spec": self.raw_spec()}


def pdcluster(name: str = "pd", namespace: str | None = None) -> PDClusterBuilder:
    return PDClusterBuilder(name, namespace)


def gpu_node(
    name: str,
    gpus: int = 8,
    *,
    clique: str | None = None,
    rdma: int = 0,
    ready: bool = True,
    schedulable: bool = True,
    labels: dict[str, str] | None = None,
    taints: tuple[Taint, ...] = (),
) -> GpuNode:
    all_labels = {"nvidia.com/gpu.product": "H200", "nvidia.com/gpu.count": str(gpus), **(labels or {})}
    if clique:
        all_labels["nvidia.com/gpu.clique"] = clique
    alloc = {"nvidia.com/gpu": gpus}
    if rdma:
        alloc["rdma/hca"] = rdma
    return GpuNode(name, all_labels, alloc, ready, schedulable, taints)


def busy(node: str, gpus: int, owner: str | None = "other") -> PlacedPod:
    """A pod of someone else holding `gpus` GPUs on `node`."""
    return PlacedPod(node, {"nvidia.com/gpu": gpus}, owner)


# A valid spec.engine the invalid engine cases below start from.
ENGINE: dict[str, Any] = {
    "image": "pdfabric/refengine:test",
    "prefill": {"command": ["serve"], "args": ["p"]},
    "decode": {"command": ["serve"], "args": ["d"]},
}


def _engine(**patch: Any) -> dict[str, Any]:
    return {"engine": merge(ENGINE, patch)}


# Bad spec.engine cases: (id, spec patch, fragment of the API server's message, naming the field).
ENGINE_INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("engine-no-image", {"engine": {"prefill": ENGINE["prefill"], "decode": ENGINE["decode"]}}, "spec.engine.image"),
    ("engine-no-decode", {"engine": {"image": "e", "prefill": ENGINE["prefill"]}}, "spec.engine.decode"),
    ("engine-empty-image", _engine(image=""), "spec.engine.image"),
    (
        # The container's entrypoint is the agent: an engine without a command has no launch line.
        "engine-no-command",
        {"engine": {"image": "e", "prefill": ENGINE["prefill"], "decode": {"args": ["d"]}}},
        "spec.engine.decode.command",
    ),
    ("engine-empty-command", _engine(prefill={"command": []}), "spec.engine.prefill.command"),
    (
        "engine-env-pdfabric",
        _engine(prefill={"env": [{"name": "PDFABRIC_RANK", "value": "prefill-0-tp0"}]}),
        "PDFABRIC_* variables are set by the operator",
    ),
    (
        "engine-env-visible-devices",
        _engine(decode={"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}),
        "the device plugin's allocation is the only GPU grant",
    ),
    ("engine-env-no-name", _engine(prefill={"env": [{"value": "x"}]}), "spec.engine.prefill.env[0].name"),
    (
        "engine-gpus-in-resources",
        _engine(decode={"resources": {"limits": {"nvidia.com/gpu": 1}}}),
        "engine.prefill.resources and engine.decode.resources may not name placement.gpuResource",
    ),
    (
        "engine-ports-overlap",
        _engine(prefill={"port": 30000}, decode={"port": 30010}),
        "each start a range of 64 ports",
    ),
    ("engine-range-holds-agent-port", _engine(decode={"port": 7390}), "each start a range of 64 ports"),
    ("engine-dist-port-overlaps", _engine(decode={"distInitPort": 30020}), "each start a range of 64 ports"),
    ("engine-port-too-high", _engine(prefill={"port": 65500}), "spec.engine.prefill.port"),
    ("engine-health-path-relative", _engine(prefill={"healthPath": "health"}), "spec.engine.prefill.healthPath"),
    ("engine-startup-too-short", _engine(decode={"startupSeconds": 1}), "spec.engine.decode.startupSeconds"),
    # An unquoted `sandbox: Off` in YAML 1.1 is the boolean false; the word is Disabled.
    ("engine-sandbox-unknown", _engine(sandbox="Off"), 'spec.engine.sandbox: Unsupported value: "Off"'),
]


def _pod(**fields: Any) -> dict[str, Any]:
    return {"agent": {"pod": fields}}


# Bad pod overrides (agent.pod, router.pod): what would break the pods' contract.
POD_INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("pod-label-operators", _pod(labels={"pdfabric.dev/cluster-uid": "x"}), "are the operator's"),
    ("pod-label-managed-by", _pod(labels={"app.kubernetes.io/managed-by": "me"}), "are the operator's"),
    ("pod-annotation-operators", _pod(annotations={"pdfabric.dev/pod-hash": "x"}), "are the operator's"),
    ("pod-volume-name-taken", _pod(volumes=[{"name": "peer-tls", "emptyDir": {}}]), "the operator's volume names"),
    ("pod-volume-no-name", _pod(volumes=[{"emptyDir": {}}]), "spec.agent.pod.volumes[0].name"),
    ("pod-mount-over-rankmap", _pod(volumeMounts=[{"name": "w", "mountPath": "/etc/pdfabric"}]), "clear of"),
    ("pod-mount-above-home", _pod(volumeMounts=[{"name": "w", "mountPath": "/var/lib"}]), "clear of"),
    ("pod-mount-relative", _pod(volumeMounts=[{"name": "w", "mountPath": "models"}]), "clear of"),
    ("pod-env-pdfabric", _pod(env=[{"name": "PDFABRIC_RANKMAP", "value": "/x"}]), "are set by the operator"),
    ("pod-env-node-name", _pod(env=[{"name": "NODE_NAME", "value": "n"}]), "are set by the operator"),
    ("pod-toleration-operator", _pod(tolerations=[{"key": "k", "operator": "In"}]), "spec.agent.pod.tolerations"),
    (
        "router-pod-env-pdfabric",
        {**_engine(), "router": {"image": "r", "pod": {"env": [{"name": "PDFABRIC_X", "value": "1"}]}}},
        "are set by the operator",
    ),
]

# Specs the API server must reject (schema or CEL) and parse_spec must reject too:
# (id, spec patch applied over a valid default spec, fragment of the API server's message).
INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-backend", {"backend": "ucx"}, 'supported values: "mooncake", "mori", "nixl"'),
    ("unknown-mem-pool", {"transfer": {"memPool": "HBM"}}, "spec.transfer.memPool"),
    ("unknown-transport", {"transfer": {"transport": "infiniband"}}, "spec.transfer.transport"),
    ("prefill-tp-zero", {"prefill": {"tp": 0}}, "spec.prefill.tp"),
    ("draft-layers-negative", {"model": {"draftLayers": -1}}, "spec.model.draftLayers"),
    ("draft-layers-over-64", {"model": {"draftLayers": 65}}, "spec.model.draftLayers"),
    ("prefill-replicas-negative", {"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
    ("decode-cp-not-1", {"decode": {"cp": 2}}, "decode.cp must be 1"),
    # A replica over several nodes splits as SGLang's --nnodes does: equal (pp, tp) node blocks.
    ("nodes-per-replica-past-tp", {"prefill": {"tp": 2, "nodesPerReplica": 4}}, "prefill.nodesPerReplica must split"),
    (
        "nodes-per-replica-with-cp",
        {"prefill": {"tp": 2, "cp": 2, "nodesPerReplica": 2}},
        "prefill.nodesPerReplica must split",
    ),
    (
        "decode-nodes-per-replica-with-dp",
        {"decode": {"tp": 2, "dp": 2, "nodesPerReplica": 2}},
        "decode.nodesPerReplica must split",
    ),
    ("nodes-per-replica-over-64", {"decode": {"nodesPerReplica": 65}}, "spec.decode.nodesPerReplica"),
    ("group-topology-key-not-a-label", {"placement": {"groupTopologyKey": "rail id"}}, "placement.groupTopologyKey"),
    (
        "more-ranks-than-a-rank-map-holds",
        {"prefill": {"replicas": 1024, "tp": 8}, "decode": {"replicas": 1024, "tp": 8}},
        "at most 8192 ranks",
    ),
    ("decode-pp-mismatch", {"prefill": {"pp": 4}, "decode": {"pp": 2}}, "decode.pp must be 1 or equal prefill.pp"),
    (
        "tp-sizes-do-not-divide",
        {"model": {"kvHeads": 6}, "prefill": {"tp": 3}, "decode": {"tp": 2}},
        "prefill.tp and decode.tp must divide each other",
    ),
    (
        "prefill-tp-vs-kv-heads",
        {"prefill": {"tp": 3}, "decode": {"tp": 3}},
        "prefill.tp must divide model.kvHeads",
    ),
    (
        "decode-tp-vs-kv-heads",
        {"model": {"kvHeads": 12}, "decode": {"tp": 8}},
        "decode.tp must divide model.kvHeads",
    ),
    (
        "packed-latent-on-mha",
        {"model": {"kvPacking": "packedFp8", "dtype": "float8_e4m3fn"}},
        "it needs kvKind MLA, dtype float8_e4m3fn and kvLoraRank a multiple of 128",
    ),
    (
        "packed-latent-in-bfloat16",
        {"model": {"kvKind": "MLA", "kvPacking": "packedFp8"}},
        "it needs kvKind MLA, dtype float8_e4m3fn and kvLoraRank a multiple of 128",
    ),
    (
        "packed-latent-rank-not-whole-scale-blocks",
        {"model": {"kvKind": "MLA", "kvPacking": "packedFp8", "dtype": "float8_e4m3fn", "kvLoraRank": 200}},
        "it needs kvKind MLA, dtype float8_e4m3fn and kvLoraRank a multiple of 128",
    ),
    (
        "layer-split-cp-does-not-divide-state-layers",
        {"prefill": {"cp": 2, "dsaCacheLayerSplit": True}, "model": {"stateLayers": 3}},
        "model.stateLayers must be divisible by prefill.cp",
    ),
    (
        "nvlink-pool-on-rdma",
        {"transfer": {"memPool": "NVLINK", "transport": "rdma"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "intra-node-pool-on-tcp",
        {"transfer": {"memPool": "INTRA_NODE_NVLINK", "transport": "tcp"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "default-pool-on-nvlink-intra",
        {"transfer": {"transport": "nvlink-intra"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "barex-on-tcp",
        {"transfer": {"memPool": "BAREX", "transport": "tcp"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "mori-with-intra-node-pool",
        {"backend": "mori", "transfer": {"memPool": "INTRA_NODE_NVLINK"}},
        "only memPool NONE with transport",
    ),
    (
        "mori-with-nvlink",
        {"backend": "mori", "transfer": {"memPool": "NVLINK", "transport": "nvlink"}},
        "only memPool NONE with transport",
    ),
    (
        "nixl-with-intra-node-pool",
        {"backend": "nixl", "transfer": {"memPool": "INTRA_NODE_NVLINK"}},
        "only memPool NONE with transport",
    ),
    (
        "nixl-with-nvlink",
        {"backend": "nixl", "transfer": {"memPool": "NVLINK", "transport": "nvlink"}},
        "only memPool NONE with transport",
    ),
    (
        "mori-default-pool-on-nvlink-intra",
        {"backend": "mori", "transfer": {"transport": "nvlink-intra"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "default-pool-on-efa",
        {"transfer": {"transport": "efa"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "mori-default-pool-on-efa",
        {"backend": "mori", "transfer": {"transport": "efa"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "nixl-barex-on-efa",
        {"backend": "nixl", "transfer": {"memPool": "BAREX", "transport": "efa"}},
        "transfer.transport must fit transfer.memPool",
    ),
    (
        "nixl-nvlink-intra-decode-not-multiple",
        {
            "backend": "nixl",
            "transfer": {"transport": "nvlink-intra"},
            "prefill": {"replicas": 2},
            "decode": {"replicas": 3},
        },
        "decode.replicas must be a multiple of prefill.replicas",
    ),
    (
        "nixl-nvlink-intra-group-exceeds-node",
        {"backend": "nixl", "transfer": {"transport": "nvlink-intra"}, "prefill": {"tp": 8}, "decode": {"tp": 4}},
        "on one node, within placement.maxGpusPerNode",
    ),
    (
        "intra-node-group-exceeds-node",
        {"transfer": {"memPool": "INTRA_NODE_NVLINK"}, "prefill": {"tp": 8}, "decode": {"tp": 4}},
        "on one node, within placement.maxGpusPerNode",
    ),
    (
        "intra-node-group-exceeds-configured-max",
        {
            "transfer": {"memPool": "INTRA_NODE_NVLINK"},
            "prefill": {"tp": 2},
            "decode": {"tp": 2},
            "placement": {"maxGpusPerNode": 2},
        },
        "on one node, within placement.maxGpusPerNode",
    ),
    (
        "intra-node-decode-not-multiple",
        {"transfer": {"memPool": "INTRA_NODE_NVLINK"}, "prefill": {"replicas": 2}, "decode": {"replicas": 3}},
        "decode.replicas must be a multiple of prefill.replicas",
    ),
    (
        "ports-collide",
        {"agent": {"metricsPort": 7400, "apiPort": 7400}},
        "agent.metricsPort and agent.apiPort must differ",
    ),
    (
        "peer-port-collides",
        {"agent": {"peerPort": 9400}},
        "agent.peerPort must differ from agent.apiPort and agent.metricsPort",
    ),
    ("unknown-dtype", {"model": {"dtype": "int4"}}, "spec.model.dtype"),
    ("unknown-fallback", {"placement": {"fallback": "Retry"}}, "spec.placement.fallback"),
    ("batch-entries-zero", {"transfer": {"maxBatchEntries": 0}}, "spec.transfer.maxBatchEntries"),
    ("metrics-port-out-of-range", {"agent": {"metricsPort": 70000}}, "spec.agent.metricsPort"),
    ("page-size-zero", {"model": {"pageSizeTokens": 0}}, "spec.model.pageSizeTokens"),
    ("timeout-zero", {"transfer": {"timeoutSeconds": 0}}, "spec.transfer.timeoutSeconds"),
    (
        "router-metrics-on-its-port",
        {**_engine(), "router": {"image": "r", "port": 8000, "metricsPort": 8000}},
        "router.metricsPort must differ from router.port",
    ),
    *ENGINE_INVALID_SPECS,
    *POD_INVALID_SPECS,
]
