"""Where the KV, state and metadata/aux buffers live.

Metadata/aux (sglang #26707, MetadataBuffers device choice). Upstream order: NPU first; then any
custom pool of type NVLINK or BAREX keeps them on the CPU (upstream TODO: cuda once the MNNVL
transport is bug-free); INTRA_NODE_NVLINK puts them on the GPU, which is required because
Mooncake's intra-node NVLink transport refuses host memory; everything else stays on the CPU.

KV and state: on the GPU for the NVLink transports (intra-node and multi-node NVLink move GPU
memory only), in host memory for tcp and rdma.

Both come from the tables in ``policy/transports.py``.
"""

from __future__ import annotations

from pdfabric_core.policy.transports import mem_pool_traits, transport_traits
from pdfabric_core.policy.types import Device, MemPool, Transport


def metadata_buffer_device(pool: MemPool, *, is_npu: bool = False) -> Device:
    if is_npu:
        return Device.NPU
    return mem_pool_traits(pool).metadata_device


def kv_buffer_device(transport: Transport) -> Device:
    """Device of a rank's KV and state pools for the transport the agent runs."""
    return transport_traits(transport).kv_device
