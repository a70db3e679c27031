"""Where the metadata/aux buffers live (sglang #26707, MetadataBuffers device choice).

Upstream order: NPU first; then any custom pool of type NVLINK or BAREX keeps them on the CPU
(upstream TODO: cuda once the MNNVL transport is bug-free); INTRA_NODE_NVLINK puts them on the
GPU, which is required because Mooncake's intra-node NVLink transport refuses host memory;
everything else stays on the CPU.
"""

from __future__ import annotations

from pdfabric_core.policy.types import Device, MemPool


def metadata_buffer_device(pool: MemPool, *, is_npu: bool = False) -> Device:
    if is_npu:
        return Device.NPU
    if pool in (MemPool.NVLINK, MemPool.BAREX):
        return Device.CPU
    if pool is MemPool.INTRA_NODE_NVLINK:
        return Device.CUDA
    return Device.CPU


def room_dtype(*, is_npu: bool) -> str:
    """Bootstrap-room column dtype: NPU kernels need int64 (upstream), elsewhere uint64."""
    return "int64" if is_npu else "uint64"
