"""The agent images `make images` produces (docs/images.md) and which one a transport needs.

Two agent images come from images/Containerfile: the CPU one (Mooncake's non-CUDA engine, CPU
pools: tcp, rdma) and the CUDA 13 one (torch's CUDA wheels, Mooncake's cuda13 engine). The
transports that keep KV in GPU memory (the transport row's ``kv_device``: nvlink-intra, nvlink)
cannot run on the CPU image: torch there sees no GPU, and the agent stays not ready (NoGpu). So
the default follows the transport, and a spec that names the CPU image for such a transport is
refused with the fix (spec.validate_spec), instead of a PDCluster that never becomes Ready.
"""

from __future__ import annotations

from pdfabric_core.policy.transports import transport_traits
from pdfabric_core.policy.types import Device, Transport

__all__ = [
    "AGENT_IMAGE",
    "AGENT_IMAGE_CUDA",
    "AGENT_REPOSITORY",
    "CUDA_SUFFIX",
    "default_agent_image",
    "names_cpu_agent_image",
    "needs_gpu_image",
]

# `make images` names: pdfabric/agent:<version> and pdfabric/agent:<version>-cuda13 (hack/images.sh;
# tests/images/test_image_names.py keeps these equal to what it produces).
AGENT_IMAGE = "pdfabric/agent:0.1.0"
CUDA_SUFFIX = "-cuda13"
AGENT_IMAGE_CUDA = AGENT_IMAGE + CUDA_SUFFIX
AGENT_REPOSITORY = "pdfabric/agent"


def needs_gpu_image(transport: Transport) -> bool:
    """The transport keeps KV in GPU memory: its agent needs CUDA."""
    return transport_traits(transport).kv_device is Device.CUDA


def default_agent_image(transport: Transport) -> str:
    """The agent image of a PDCluster that leaves spec.agent.image out."""
    return AGENT_IMAGE_CUDA if needs_gpu_image(transport) else AGENT_IMAGE


def names_cpu_agent_image(image: str) -> bool:
    """`image` is one of `make images`' CPU agent images: repository .../pdfabric/agent (any registry
    in front) with a tag that is not a CUDA one. A digest, or another repository, is not judged."""
    if "@" in image:
        return False
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag (a registry port is no tag): `latest`
        name, tag = image, "latest"
    return (name == AGENT_REPOSITORY or name.endswith("/" + AGENT_REPOSITORY)) and "cuda" not in tag
