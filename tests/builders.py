"""Fluent test objects, valid by default: pdcluster().prefill(tp=2).decode(tp=4), gpu_node(clique=...)."""

from __future__ import annotations

import copy
from typing import Any

from pdfabric_core.spec import PDClusterSpec, parse_spec
from pdfabric_operator.planner import GpuNode, PlacedPod


class PDClusterBuilder:
    """Builds a PDCluster manifest (camelCase spec as users write it)."""

    def __init__(self, name: str = "pd", namespace: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._spec: dict[str, Any] = {
            "backend": "mooncake",
            "prefill": {"replicas": 1, "tp": 1},
            "decode": {"replicas": 1, "tp": 1},
            "agent": {"image": "pdfabric/agent:test"},
        }

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
) -> GpuNode:
    all_labels = {"nvidia.com/gpu.product": "H200", "nvidia.com/gpu.count": str(gpus), **(labels or {})}
    if clique:
        all_labels["nvidia.com/gpu.clique"] = clique
    alloc = {"nvidia.com/gpu": gpus}
    if rdma:
        alloc["rdma/hca"] = rdma
    return GpuNode(name, all_labels, alloc, ready, schedulable)


def busy(node: str, gpus: int, owner: str | None = "other") -> PlacedPod:
    """A pod of someone else holding `gpus` GPUs on `node`."""
    return PlacedPod(node, {"nvidia.com/gpu": gpus}, owner)
