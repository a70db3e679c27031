"""Vocabulary of the PD rules: memory pools, transports, devices."""

from __future__ import annotations

import enum


class MemPool(enum.StrEnum):
    """SGLANG_MOONCAKE_CUSTOM_MEM_POOL values, spelled as users already write them."""

    NONE = "NONE"
    NVLINK = "NVLINK"  # multi-node NVLink (MNNVL): fabric memory from cuMemCreate
    INTRA_NODE_NVLINK = "INTRA_NODE_NVLINK"  # CUDA IPC between GPUs of one node
    BAREX = "BAREX"


class Transport(enum.StrEnum):
    TCP = "tcp"
    RDMA = "rdma"
    NVLINK_INTRA = "nvlink-intra"
    NVLINK = "nvlink"  # multi-node NVLink inside one NVLink domain (gpu.clique)


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


# The transport each custom pool implies when the spec leaves transport unset.
TRANSPORT_FOR_POOL: dict[MemPool, Transport] = {
    MemPool.NONE: Transport.TCP,
    MemPool.NVLINK: Transport.NVLINK,
    MemPool.INTRA_NODE_NVLINK: Transport.NVLINK_INTRA,
    MemPool.BAREX: Transport.RDMA,
}


def implied_transport(pool: MemPool, explicit: Transport | None) -> Transport:
    """The transport a deployment runs: the explicit choice, else the one the pool implies."""
    return explicit if explicit is not None else TRANSPORT_FOR_POOL[pool]
