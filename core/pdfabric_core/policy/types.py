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
    EFA = "efa"  # AWS Elastic Fabric Adapter, through libfabric (backend nixl only)


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
    NIXL = "nixl"  # NIXL over its UCX backend (tcp, rdma): the transfer library of Dynamo, llm-d and vLLM


class KvKind(enum.StrEnum):
    """spec.model.kvKind: what one layer's KV cache is (policy/rank_mapping.py routes each)."""

    MHA = "MHA"  # a K and a V buffer per layer, heads sharded over attention TP (MHA, GQA, MQA)
    MLA = "MLA"  # one latent buffer per layer (DeepSeek's MLA), whole on every attention-TP rank


class KvPacking(enum.StrEnum):
    """spec.model.kvPacking: how one token of an MLA latent is stored (its bytes follow from the kind)."""

    NONE = "none"  # kvLoraRank + qkRopeHeadDim elements of model.dtype
    # SGLang's DSA pool with an fp8 KV cache (DeepSeek-V3.2; MLABufferInfo.packed_fp8): kvLoraRank fp8
    # bytes, a float32 scale per 128 of them, then qkRopeHeadDim bfloat16 (656 bytes for 512 + 64).
    PACKED_FP8 = "packedFp8"


# SGLang's DSATokenToKVPool.quant_block_size: latent elements per float32 scale of the packed fp8 latent.
PACKED_FP8_BLOCK = 128


def packed_fp8_token_bytes(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one token of the packed fp8 latent (SGLang's ``calculate_mla_kv_cache_dim`` for an
    fp8 DSA pool): the fp8 latent, its float32 block scales, the bfloat16 rope part."""
    return kv_lora_rank + kv_lora_rank // PACKED_FP8_BLOCK * 4 + qk_rope_head_dim * 2


class StateKind(enum.StrEnum):
    """spec.model.stateKind: how a request's state is indexed (policy/state_slices.py plans each)."""

    SLOT = "slot"  # one slot per request, several tensors per layer (Mamba/GDN conv and temporal state)
    PAGE = "page"  # page-indexed like KV, heads sharded like KV (an SWA hybrid's window pages)
    ROW = "row"  # one row per request, whole on every attention-TP rank (SGLang's request_row)


class FallbackPolicy(enum.StrEnum):
    """spec.placement.fallback: what to do when the requested transport cannot run."""

    FAIL = "Fail"  # report why (Placed=False, or the agent's readiness reason)
    TCP = "TCP"  # run tcp instead, flagged Degraded
