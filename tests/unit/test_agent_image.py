"""The agent image follows the transport: the CUDA image where KV lives in GPU memory (nvlink-intra,
nvlink), the CPU image elsewhere; a spec that names the CPU image for a GPU transport is refused
with the fix, instead of a PDCluster that stays NotReady (docs/images.md)."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_core import images
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_operator.builders.agent_pod import build_agent_pods
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.placement import Placement
from pdfabric_operator.planner import plan_placement
from tests.builders import gpu_node, pdcluster

CPU, CUDA = "pdfabric/agent:0.1.0", "pdfabric/agent:0.1.0-cuda13"


def _pod_images(builder: Any, nodes: list[Any]) -> set[str]:
    placement = plan_placement(builder.spec(), nodes, [], cluster_uid="uid-1")
    assert isinstance(placement, Placement)
    pods = build_agent_pods(ClusterRef("ns", "pd", "uid-1"), builder.spec(), placement)
    return {c["image"] for p in pods for c in p["spec"]["containers"] if c["name"] == "agent"}


def test_the_names_are_make_images_names() -> None:
    assert (images.AGENT_IMAGE, images.AGENT_IMAGE_CUDA) == (CPU, CUDA)
    # A tcp PDCluster keeps the image it had before the default followed the transport: no roll-out.
    assert PDClusterSpec().agent_image == CPU


@pytest.mark.parametrize(
    ("transfer", "image"),
    [
        ({}, CPU),
        ({"transport": "rdma"}, CPU),
        ({"memPool": "BAREX"}, CPU),
        ({"memPool": "INTRA_NODE_NVLINK", "transport": "nvlink-intra"}, CUDA),
        ({"memPool": "INTRA_NODE_NVLINK"}, CUDA),  # auto: the pool implies nvlink-intra
        ({"memPool": "NVLINK", "transport": "nvlink"}, CUDA),
        ({"memPool": "NVLINK"}, CUDA),
    ],
    ids=["tcp", "rdma", "barex-rdma", "nvlink-intra", "intra-pool-auto", "nvlink", "nvlink-pool-auto"],
)
def test_the_default_follows_the_transport(transfer: dict[str, str], image: str) -> None:
    spec = parse_spec({"transfer": transfer})
    assert spec.agent.image == ""  # left out, as stored
    assert spec.agent_image == image


@pytest.mark.parametrize(
    ("transport", "nodes", "image"),
    [
        ("tcp", [gpu_node("n1", 8)], CPU),
        ("nvlink-intra", [gpu_node("n1", 8)], CUDA),
        ("nvlink", [gpu_node("x1", 4, clique="x"), gpu_node("x2", 4, clique="x")], CUDA),
    ],
)
def test_the_node_pods_run_the_image_the_transport_needs(transport: str, nodes: list[Any], image: str) -> None:
    builder = pdcluster().transport(transport).prefill(tp=4).decode(tp=4)
    assert _pod_images(builder, nodes) == {image}


def test_a_named_image_is_used_as_written() -> None:
    builder = pdcluster().transport("nvlink-intra").prefill(tp=4).decode(tp=4).agent(image="mirror:5000/ml/agent:7")
    assert _pod_images(builder, [gpu_node("n1", 8)]) == {"mirror:5000/ml/agent:7"}


@pytest.mark.parametrize(
    "image",
    [CPU, "pdfabric/agent:0.2.0", "mirror:5000/pdfabric/agent:0.1.0", "mirror/team/pdfabric/agent", "pdfabric/agent"],
)
@pytest.mark.parametrize("transfer", [{"memPool": "NVLINK", "transport": "nvlink"}, {"memPool": "INTRA_NODE_NVLINK"}])
def test_the_cpu_image_for_a_gpu_transport_is_refused_with_the_fix(image: str, transfer: dict[str, str]) -> None:
    with pytest.raises(SpecError, match="is the CPU agent image") as info:
        parse_spec({"transfer": transfer, "agent": {"image": image}})
    message = str(info.value)
    assert f"use {image}-cuda13" in message and f"leave agent.image out for {CUDA}" in message
    assert "keeps KV in GPU memory" in message


@pytest.mark.parametrize(
    "image",
    [CUDA, "mirror:5000/pdfabric/agent:0.1.0-cuda13", "pdfabric/agent@sha256:" + "0" * 64, "mirror/ml/agent:1"],
    ids=["cuda", "cuda-mirrored", "digest-not-judged", "other-repository-not-judged"],
)
def test_cuda_or_unknown_images_pass_for_gpu_transports(image: str) -> None:
    assert parse_spec({"transfer": {"memPool": "NVLINK"}, "agent": {"image": image}}).agent_image == image


def test_the_cpu_image_is_fine_where_kv_stays_in_host_memory() -> None:
    for transfer in ({}, {"transport": "rdma"}):
        assert parse_spec({"transfer": transfer, "agent": {"image": CPU}}).agent_image == CPU


def test_with_engines_the_agent_image_is_not_used_so_not_judged() -> None:
    engine = {
        "image": "sglang:pd",
        "prefill": {"command": ["serve"], "args": ["p"]},
        "decode": {"command": ["serve"], "args": ["d"]},
    }
    spec = parse_spec({"transfer": {"memPool": "INTRA_NODE_NVLINK"}, "agent": {"image": CPU}, "engine": engine})
    assert spec.engine is not None and spec.engine.image == "sglang:pd"


@pytest.mark.parametrize(
    ("image", "cpu"),
    [
        ("pdfabric/agent:0.1.0", True),
        ("pdfabric/agent", True),
        ("host:5000/pdfabric/agent", True),  # the port is no tag
        ("host:5000/a/pdfabric/agent:x", True),
        ("pdfabric/agent:0.1.0-cuda13", False),
        ("pdfabric/agent:cuda12", False),
        ("pdfabric/agent@sha256:abc", False),
        ("pdfabric/agents:0.1.0", False),
        ("mypdfabric/agent:0.1.0", False),
        ("pdfabric/operator:0.1.0", False),
    ],
)
def test_names_cpu_agent_image(image: str, cpu: bool) -> None:
    assert images.names_cpu_agent_image(image) is cpu
