"""Which path a transfer takes, and the start-up check INTRA_NODE_NVLINK needs (pure).

The fast path is only for intra-node NVLink between two distinct GPUs with peer access, with the
kernel toolchain (driver + NVRTC) present; anything else keeps the engine path, with the reason
recorded so metrics and logs say why. Upstream #26707 removed the TCP fallback under
INTRA_NODE_NVLINK, so a process that sees a single GPU cannot map its peers at all: that is a
start-up error with the fix in the message, not a silent degradation.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdfabric_core.policy.types import MemPool, Transport


class TransferPath(enum.StrEnum):
    FASTPATH = "nvlink-kernel"  # value of the metrics label `path`
    ENGINE = "engine"


class IntraNodeNvlinkError(RuntimeError):
    """INTRA_NODE_NVLINK cannot work in this process; raised at start-up."""


@dataclass(frozen=True)
class PathChoice:
    path: TransferPath
    reason: str


def check_intra_node_nvlink_startup(
    pool: MemPool | str,
    visible_gpus: int,
    *,
    cuda_visible_devices: str | None,
    rank_gpus: Sequence[int] | None = None,
) -> None:
    """The process must see the GPUs it maps: every GPU of the node's ranks. When the rank map puts
    all of this node's ranks (prefill and decode) on one GPU, that one GPU is all it maps (CUDA IPC
    between processes of one device); otherwise one visible GPU cannot be enough."""
    if MemPool(pool) is not MemPool.INTRA_NODE_NVLINK:
        return
    on_one_gpu = rank_gpus is not None and len(set(rank_gpus)) == 1 and 0 <= min(rank_gpus) < visible_gpus
    if visible_gpus < 2 and not on_one_gpu:
        raise IntraNodeNvlinkError(
            f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK needs this process to see the peer GPUs, "
            f"but it sees {visible_gpus} GPU(s) (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}); "
            "expose every GPU of the node to the process and select the rank's GPU by index, "
            "or choose another memory pool"
        )


def fastpath_enabled(env: Mapping[str, str] | None = None) -> bool:
    source = os.environ if env is None else env
    return source.get("PDFABRIC_FASTPATH", "1").lower() not in ("0", "false", "off", "no")


def choose_path(
    pool: MemPool | str,
    transport: Transport,
    *,
    visible_gpus: int,
    src_device: int,
    dst_device: int,
    peer_access: bool,
    kernel_available: tuple[bool, str],
    enabled: bool = True,
) -> PathChoice:
    if not enabled:
        return PathChoice(TransferPath.ENGINE, "fast path disabled (PDFABRIC_FASTPATH=0)")
    if MemPool(pool) is not MemPool.INTRA_NODE_NVLINK or transport is not Transport.NVLINK_INTRA:
        return PathChoice(TransferPath.ENGINE, f"fast path is for intra-node NVLink only (pool {MemPool(pool).value})")
    if visible_gpus < 1:
        return PathChoice(TransferPath.ENGINE, "no GPU visible")
    if max(src_device, dst_device) >= visible_gpus:
        return PathChoice(TransferPath.ENGINE, f"GPU {max(src_device, dst_device)} is not visible here")
    if src_device != dst_device and not peer_access:
        return PathChoice(TransferPath.ENGINE, f"no peer access from GPU {src_device} to GPU {dst_device}")
    ok, why = kernel_available
    if not ok:
        return PathChoice(TransferPath.ENGINE, f"kernel toolchain unavailable: {why}")
    if src_device == dst_device:
        # One GPU (every rank of the node on it): the kernels copy between the processes' CUDA
        # IPC mappings on the device; the engine cannot register memory another process owns.
        return PathChoice(TransferPath.FASTPATH, "one GPU: the kernels copy within it")
    return PathChoice(TransferPath.FASTPATH, "intra-node NVLink with peer access")
