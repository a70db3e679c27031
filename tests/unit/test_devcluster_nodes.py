"""Fake GPU node shapes for the local control plane: parsing and the Node objects built from them."""

from __future__ import annotations

import pytest

from pdfabric_devcluster.nodes import GpuNodeShape, build_gpu_node, default_node_shapes, parse_node_shapes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h200:2", [GpuNodeShape("h200", 2)]),
        (
            "gb200:4:clique=c1,rdma=rdma/hca;h200:1:gpus=4",
            [GpuNodeShape("gb200", 4, clique="c1", rdma_resource="rdma/hca"), GpuNodeShape("h200", 1, gpus=4)],
        ),
        ("a:1:product=NVIDIA-B200,rdmaCount=2", [GpuNodeShape("a", 1, product="NVIDIA-B200", rdma_count=2)]),
        (" ; ", []),
    ],
    ids=["plain", "clique-rdma-and-second-shape", "product-and-rdma-count", "empty"],
)
def test_parse_node_shapes(text: str, expected: list[GpuNodeShape]) -> None:
    assert parse_node_shapes(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("h200", "must look like prefix:count"),
        ("h200:2:gpus", "must be key=value"),
        ("h200:2:colour=red", "unknown node shape options ['colour']"),
        ("H200:2", "must be a DNS label"),
        ("h200:-1", "must not be negative"),
    ],
    ids=["no-count", "option-without-value", "unknown-option", "not-dns", "negative"],
)
def test_parse_node_shapes_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_node_shapes(text)


def test_gpu_node_carries_feature_discovery_labels_and_capacity() -> None:
    node = build_gpu_node("gb200-0", GpuNodeShape("gb200", 1, clique="c1", rdma_resource="rdma/ib", rdma_count=4))
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.clique"] == "c1"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["status"]["allocatable"]["rdma/ib"] == "4"
    assert node["status"]["capacity"] == node["status"]["allocatable"]
    assert "taints" not in node["spec"]


def test_node_without_clique_or_rdma_has_neither() -> None:
    node = build_gpu_node("h200-0", GpuNodeShape("h200", 1))
    assert "nvidia.com/gpu.clique" not in node["metadata"]["labels"]
    assert not any(k.startswith("rdma/") for k in node["status"]["allocatable"])


def test_default_fleet_has_an_nvlink_domain_rdma_nodes_and_plain_nodes() -> None:
    shapes = default_node_shapes()
    assert sum(s.count for s in shapes if s.clique) >= 2
    assert sum(s.count for s in shapes if s.rdma_resource) >= 2
    assert any(not s.clique and not s.rdma_resource for s in shapes)
    assert all(s.gpus == 8 for s in shapes)
