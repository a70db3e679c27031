"""Vocabulary of the PD rules: memory pools, transports, devices, roles, backends, KV kinds, fallback.

Every name here is a StrEnum spelled as the CRD spells it (crds/pdcluster.yaml), so a member
compares equal to the string a user wrote; a unit test keeps the CRD's enums equal to these.
What each pool and transport needs and implies is one table, ``policy/transports.py``.
"""

from __future__ import annotations

import enum

# SGLang's variable for the pool (its Mooncake backend's custom memory pool; with INTRA_NODE_NVLINK
# it also puts its MetadataBuffers on the GPU).
MEM_POOL_ENV = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"


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


# spec.transfer.transport's extra value: the transport the pool implies (parsed to None).
AUTO_TRANSPORT = "auto"


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Backend(enum.StrEnum):
    """The transfer engine the agents run (spec.backend)."""

    MOONCAKE = "mooncake"
    MORI = "mori"


class KvKind(enum.StrEnum):
    """spec.model.kvKind: what one layer's KV cache is (policy/rank_mapping.py routes each)."""

    MHA = "MHA"  # a K and a V buffer per layer, heads sharded over attention TP (MHA, GQA, MQA)
    MLA = "MLA"  # one latent buffer per layer (DeepSeek's MLA), whole on every attention-TP rank


class StateKind(enum.StrEnum):
    """spec.model.stateKind: how a request's state is indexed (policy/state_slices.py plans each)."""

    SLOT = "slot"  # one slot per request, several tensors per layer (Mamba/GDN conv and temporal state)
    PAGE = "page"  # page-indexed like KV, heads sharded like KV (an SWA hybrid's window pages)
    ROW = "row"  # one row per request, whole on every attention-TP rank (SGLang's request_row)


class FallbackPolicy(enum.StrEnum):
    """spec.placement.fallback: what to do when the requested transport cannot run."""

    FAIL = "Fail"  # report why (Placed=False, or the agent's readiness reason)
    TCP = "TCP"  # run tcp instead, flagged Degraded
