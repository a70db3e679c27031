"""Where the KV, state and metadata/aux buffers live.

Metadata/aux (sglang #26707, MetadataBuffers device choice). Upstream order: NPU first; then any
custom pool of type NVLINK or BAREX keeps them on the CPU (upstream TODO: cuda once the MNNVL
transport is bug-free); INTRA_NODE_NVLINK puts them on the GPU, which is required because
Mooncake's intra-node NVLink transport refuses host memory; everything else stays on the CPU.

KV and state: the agent's own pools on the GPU for the NVLink transports (intra-node and
multi-node NVLink move GPU memory only), in host memory for tcp and rdma. A serving engine's own
buffers may also be GPU memory on tcp (``engine_kv_devices``): the agent maps them by CUDA IPC and
Mooncake's TCP transport moves device memory through host memory itself.

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


def engine_kv_devices(transport: Transport) -> frozenset[Device]:
    """Devices a serving engine's own KV and state buffers may be on for the transport the agent runs."""
    return transport_traits(transport).engine_kv_devices


def engine_gpu_transports() -> tuple[Transport, ...]:
    """The transports that move an engine's GPU KV, in the enum's order (for messages and docs)."""
    return tuple(t for t in Transport if Device.CUDA in transport_traits(t).engine_kv_devices)
