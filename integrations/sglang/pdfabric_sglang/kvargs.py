"""SGLang's KVArgs as the agent takes them, without importing SGLang: who the engine rank is in the
PDCluster (from the environment a launcher sets) and its buffers as a ``MemoryRegistration``.
``conn``'s manager uses it; so can an engine that talks to the agent directly (the reference
engine on a machine without SGLang's GPU kernels)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdfabric_agent.client.engine_env import FabricConfig
from pdfabric_agent.client.shares import UnshareableBuffer, process_mappings, share_of
from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.draft import DraftKv
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare
from pdfabric_core.engines.launch import EngineEnv
from pdfabric_core.policy.kv_shard import kv_shard_size
from pdfabric_core.policy.types import MEM_POOL_ENV, KvKind, MemPool, Role
from pdfabric_core.rankmap import Rank
from pdfabric_sglang.state_kinds import state_buffers, state_parts

KVArgs = Any  # SGLang's KVArgs, or any object with its attributes
FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"  # SGLang's load balance method of PD prefill by default

# SGLang's own switch for where MetadataBuffers live (disaggregation/utils.py): on the GPU only with
# INTRA_NODE_NVLINK; private CPU memory otherwise.
ENV_METADATA_POOL = MEM_POOL_ENV


def metadata_on_gpu(env: dict[str, str] | None = None) -> bool:
    """Whether SGLang allocates its MetadataBuffers on the GPU (its rule, read from its variable)."""
    return (os.environ if env is None else env).get(ENV_METADATA_POOL, "").upper() == MemPool.INTRA_NODE_NVLINK


def rank_id_for(role: Role, cfg: FabricConfig, args: KVArgs, attention: AttentionRanks | None = None) -> str:
    """This engine rank's id in the PDCluster: ``PDFABRIC_RANK`` outright; else SGLang's own
    coordinates of the scheduler rank (``attention``, from its parallel state): DP group, attention
    TP and CP ranks; else (an engine that is not SGLang's scheduler) ``KVArgs.engine_rank`` and
    ``PDFABRIC_CP_RANK``. Never ``engine_rank`` under SGLang: it is the rank in TP x CP on prefill
    and the attention TP rank on decode, so with DP attention or CP the two roles number apart."""
    if cfg.rank:
        return cfg.rank
    tp, cp, dp = int(args.engine_rank), cfg.cp_rank, 0
    if attention is not None:
        tp, cp, dp = attention.tp_rank, attention.cp_rank, attention.dp_group
    cp = cp if role is Role.PREFILL else 0
    return Rank(role, cfg.replica, tp, cp, int(getattr(args, "pp_rank", 0) or 0), dp_rank=dp).rank_id


class AttentionRanks(NamedTuple):
    """An SGLang scheduler rank's place in its server's attention groups, and its server's DP
    groups: how many (SGLang's ``num_dp_ranks``), this rank's (``dp_group_of``), and whether a
    request's DP group follows its bootstrap room (``room % dp_groups``) or is registered with the
    bootstrap server."""

    tp_rank: int
    cp_rank: int
    cp_size: int
    dp_group: int = 0
    dp_groups: int = 1
    follow_bootstrap_room: bool = True


def dp_group_of(parallel: Any) -> int:
    """The DP group of a scheduler rank, by SGLang's rule (its bootstrap server's ``dp_group``):
    the attention-DP rank, or under ``--dp-size`` (separate replicas behind one bootstrap server,
    never together with attention DP) the system DP rank."""
    return int(parallel.attn_dp_rank) if int(parallel.dp_size) == 1 else int(parallel.dp_rank or 0)


def attention_of(parallel: Any) -> AttentionRanks:
    """``AttentionRanks`` from SGLang's parallel state (``runtime_context.get_parallel()``)."""
    return AttentionRanks(
        int(parallel.attn_tp_rank),
        int(parallel.attn_cp_rank),
        int(parallel.attn_cp_size),
        dp_group_of(parallel),
        int(parallel.num_dp_ranks),
        getattr(parallel.load_balance_method, "value", parallel.load_balance_method) == FOLLOW_BOOTSTRAP_ROOM,
    )


def registration(
    rank_id: str, args: KVArgs, *, is_mla: bool, gpu: int | None, aux_inline: bool = False
) -> MemoryRegistration:
    """The ``KVArgs`` buffers as the agent takes them: an MHA pool lists every K layer, then every
    V; an MLA pool (``is_mla``: SGLang's MLATokenToKVPool) one latent buffer per layer, of
    ``page_size x (kv_lora_rank + qk_rope_head_dim)`` elements per page (fp8 as one byte each, no
    scales). Its state component typed (``state_kinds``: Mamba's slots, an SWA hybrid's pages). With ``aux_inline`` the aux buffers stay private (SGLang's CPU MetadataBuffers): only
    their row sizes and row count are registered, and each room's row travels with the send and the view."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    # SGLang appends the draft pool's buffers (EAGLE/MTP) after the target's: split them off.
    n_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if not 0 <= n_draft < len(ptrs):
        raise UnshareableBuffer(f"{n_draft} draft KV buffers of {len(ptrs)} KV buffers in all")
    cut = len(ptrs) - n_draft
    ptrs, lens, items, draft_ptrs = ptrs[:cut], lens[:cut], items[:cut], list(zip(ptrs[cut:], lens[cut:], strict=True))
    draft_items = list(args.kv_item_lens)[cut:]
    if is_mla and (getattr(args, "mla_compression_ratios", None) or getattr(args, "is_hybrid_mla_backend", False)):
        raise UnshareableBuffer(
            "a compressed or hybrid MLA pool (DeepSeek-V4's): pdfabric moves plain MLA latents only"
        )
    if not ptrs or (not is_mla and len(ptrs) % 2):
        raise UnshareableBuffer(f"{len(ptrs)} KV buffers: an MHA pool has a K and a V buffer per layer")
    if len(set(items)) != 1:
        raise UnshareableBuffer(f"KV buffers of different page sizes {sorted(set(items))}")
    if (not is_mla and n_draft % 2) or len(set(draft_items)) > 1:
        raise UnshareableBuffer(
            f"{n_draft} draft KV buffers of page sizes {sorted(set(draft_items))}: an MHA draft has a K and a V "
            "buffer per layer, all of one page size"
        )
    maps = process_mappings()
    shares = [share_of(p, n, gpu, maps) for p, n in zip(ptrs, lens, strict=True)]
    layers = 0 if is_mla else len(ptrs) // 2
    draft = draft_group([share_of(p, n, gpu, maps) for p, n in draft_ptrs], draft_items, is_mla=is_mla)
    parts = state_parts(args, is_mla=is_mla)
    state = []
    slot_bytes = 0
    if parts is not None:
        state = [share_of(p, n, gpu, maps) for p, n in zip(*state_buffers(args, parts), strict=True)]
        slot_bytes = parts.item_bytes[0] if len(set(parts.item_bytes)) == 1 else 0
    aux_rows = list(args.aux_item_lens)
    if aux_inline:
        aux = []
        aux_slots = min((n // size for n, size in zip(args.aux_data_lens, aux_rows, strict=True)), default=0)
    else:
        aux = [share_of(p, n, gpu, maps) for p, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True)]
        aux_slots = 0
    return MemoryRegistration(
        rank=rank_id,
        page_order=PageOrder.TOKEN_MAJOR,
        page_tokens=int(args.page_size),
        kv_page_bytes=items[0],
        k=shares[:layers],
        v=shares[layers:] if layers else [],
        kv_kind=KvKind.MLA if is_mla else KvKind.MHA,
        latent=[] if layers else shares,
        state_slot_bytes=slot_bytes,
        state=state,
        state_parts=parts,
        aux_row_bytes=aux_rows,
        aux=aux,
        aux_slots=aux_slots,
        draft=draft,
        kv_shard_size=published_kv_shard_size(is_mla),
    )


def published_kv_shard_size(is_mla: bool) -> int:
    """The ranks SGLang stripes this rank's KV pages over (``--enable-kv-cache-sharding``, read from
    its published parallel state; 1 where it published none or the option is off)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if not bool(parallel.enable_kv_cache_sharding):
            return 1
        tp, cp = int(parallel.attn_tp_size), int(parallel.attn_cp_size)
    except (ImportError, ValueError, RuntimeError, AttributeError, TypeError):
        return 1  # unreadable with the option on is refused at start (manager.kv_sharding_refusal)
    return kv_shard_size(enabled=True, mla=is_mla, attn_tp=tp, attn_cp=cp)


def draft_group(shares: list[BufferShare], items: Sequence[int], *, is_mla: bool) -> DraftKv | None:
    """The draft's buffers as the registration's second KV group: its K of every layer then its V
    (an MHA draft pool's ``get_contiguous_buf_infos``), or its latents (MLA); None without a draft."""
    if not shares:
        return None
    half = 0 if is_mla else len(shares) // 2
    return DraftKv(
        kv_kind=KvKind.MLA if is_mla else KvKind.MHA,
        page_bytes=int(items[0]),
        k=shares[:half],
        v=shares[half:] if half else [],
        latent=[] if half else shares,
    )


def read_aux_row(args: KVArgs, index: int) -> tuple[bytes, ...]:
    """Row ``index`` of each private aux buffer (a send hands it to the agent)."""
    return tuple(
        ctypes.string_at(int(ptr) + index * int(size), int(size))
        for ptr, size in zip(args.aux_data_ptrs, args.aux_item_lens, strict=True)
    )


def write_aux_row(args: KVArgs, index: int, rows: Sequence[bytes]) -> None:
    """A decode room's aux row (its view's) into row ``index`` of each private aux buffer."""
    sizes = [int(size) for size in args.aux_item_lens]
    if [len(row) for row in rows] != sizes:
        raise ValueError(f"aux rows of {[len(row) for row in rows]} bytes for buffers of {sizes}")
    for ptr, size, row in zip(args.aux_data_ptrs, sizes, rows, strict=True):
        ctypes.memmove(int(ptr) + index * size, row, size)


def gpu_of(args: KVArgs) -> int | None:
    """The GPU of this rank when CUDA is up here, else None (CPU buffers only)."""
    try:
        import torch

        return int(args.gpu_id) if torch.cuda.is_available() else None
    except ImportError:
        return None


def hand_over_gpu_kv(
    args: KVArgs, cfg: FabricConfig, rank_id: str, cluster_uid: str, env: dict[str, str] | None = None
) -> Any:
    """GPUDirect RDMA by dma-buf (docs/sglang.md, "Engine GPU memory on rdma"): the GPU allocations
    behind this rank's KV and state buffers exported as dma-bufs and handed to the node agent's
    dma-buf door for its NIC; the agent's ``HandoverAnswer``, or ``HandoverRefused`` with its reason
    (or ``not_exportable`` from this side). The door's socket is in ``PDFABRIC_SHM_DIR``, named by the
    cluster's uid (the agent's /v1/info gives it)."""
    from pdfabric_agent.client.handover import hand_over_gpu_buffers
    from pdfabric_agent.protocol.handover import socket_path

    gpu = gpu_of(args)
    if gpu is None:
        raise RuntimeError("pdfabric: no CUDA here; a dma-buf hand-over is for GPU KV")
    shm_dir = (os.environ if env is None else env).get(EngineEnv.SHM_DIR.value, "/dev/shm")
    kinds = args.state_data_ptrs if getattr(args, "state_types", None) else []  # one list per state kind
    ptrs = [int(p) for p in args.kv_data_ptrs] + [int(p) for kind in kinds for p in kind]
    return hand_over_gpu_buffers(
        socket_path(shm_dir, cluster_uid), token=cfg.token, cluster=cluster_uid, rank=rank_id, ptrs=ptrs, device=gpu
    )
