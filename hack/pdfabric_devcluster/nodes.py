"""Fake GPU nodes: Node objects that look like GPU-operator-labelled machines, managed by kwok."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
NODE_DOWN_ANNOTATION = "pdfabric.dev/fake-node-down"
FAKE_NODE_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}


@dataclass(frozen=True)
class GpuNodeShape:
    """`count` identical nodes named `<prefix>-<i>`."""

    prefix: str
    count: int
    gpus: int = 8
    product: str = "NVIDIA-H200"
    gpu_memory_mib: int = 143771
    clique: str | None = None  # nvidia.com/gpu.clique: NVLink fabric domain shared across nodes
    rdma_resource: str | None = None  # e.g. "rdma/hca"
    rdma_count: int = 1
    labels: dict[str, str] = field(default_factory=dict)
    taint_fake: bool = False  # add the kwok NoSchedule taint (pods must tolerate it)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.prefix):
            raise ValueError(f"node prefix {self.prefix!r} must be a DNS label (lowercase letters, digits, '-')")
        if self.count < 0 or self.gpus < 0:
            raise ValueError("node count and GPUs per node must not be negative")

    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.count)]


def default_node_shapes() -> list[GpuNodeShape]:
    """The demo/test fleet: an NVLink-domain rack with RDMA, RDMA-only nodes, and plain TCP nodes."""
    return [
        GpuNodeShape(
            "gb200", 2, product="NVIDIA-GB200", gpu_memory_mib=189471, clique="clique-a.1", rdma_resource="rdma/hca"
        ),
        GpuNodeShape("h200-rdma", 2, rdma_resource="rdma/hca"),
        GpuNodeShape("h200", 2),
    ]


def parse_node_shapes(text: str) -> list[GpuNodeShape]:
    """Parse `prefix:count[:key=value,...]` entries separated by ';' (CLI and env form).

    Keys: gpus, product, clique, rdma (resource name), rdmaCount. Example:
    "gb200:4:clique=c1,rdma=rdma/hca;h200:2:gpus=8".
    """
    shapes = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split(":", 2)
        if len(parts) < 2:
            raise ValueError(f"node shape {entry!r} must look like prefix:count[:key=value,...]")
        opts: dict[str, Any] = {}
        if len(parts) == 3 and parts[2]:
            for kv in parts[2].split(","):
                key, sep, value = kv.partition("=")
                if not sep:
                    raise ValueError(f"node shape option {kv!r} must be key=value")
                opts[key] = value
        unknown = set(opts) - {"gpus", "product", "clique", "rdma", "rdmaCount"}
        if unknown:
            raise ValueError(f"unknown node shape options {sorted(unknown)} in {entry!r}")
        shapes.append(
            GpuNodeShape(
                parts[0],
                int(parts[1]),
                gpus=int(opts.get("gpus", 8)),
                product=opts.get("product", "NVIDIA-H200"),
                clique=opts.get("clique"),
                rdma_resource=opts.get("rdma"),
                rdma_count=int(opts.get("rdmaCount", 1)),
            )
        )
    return shapes


def build_gpu_node(name: str, shape: GpuNodeShape) -> dict[str, Any]:
    """A Node with GPU feature-discovery labels and GPU/RDMA capacity, managed by kwok."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": shape.product,
        "nvidia.com/gpu.count": str(shape.gpus),
        "nvidia.com/gpu.memory": str(shape.gpu_memory_mib),
        **shape.labels,
    }
    if shape.clique:
        labels["nvidia.com/gpu.clique"] = shape.clique
    resources = {
        "cpu": "128",
        "memory": "2Ti",
        "pods": "110",
        "ephemeral-storage": "2Ti",
        "nvidia.com/gpu": str(shape.gpus),
    }
    if shape.rdma_resource:
        resources[shape.rdma_resource] = str(shape.rdma_count)
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_ANNOTATION: "fake"}},
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }
    if shape.taint_fake:
        node["spec"]["taints"] = [dict(FAKE_NODE_TAINT)]
    return node
