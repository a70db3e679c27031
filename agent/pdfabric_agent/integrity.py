"""End-to-end integrity of a transfer (``spec.transfer.verify``): the sender checksums the bytes it
moved to one decode rank, the decode agent checksums the bytes that landed, and the room is
Success only when the two agree.

Both sides walk the same byte stream from one ``TransferPlan``: every KV item in (buffer, page)
order (a whole page, or a head slice under a TP mismatch), then the state blocks, then the aux
blocks and side-channel rows. The sender reads it at the source addresses, the receiver at the
destination addresses of the same plan, so block boundaries (coalescing, chunking) do not matter.

The checksum is the stream's length and ``sum(w_i * x_i) mod 2**64`` over its little-endian 64-bit
words x_i (each region zero-padded to whole words), w_i = 2i + 1: order-sensitive, one pass, numpy for CPU pools
and with torch on the GPU for GPU pools (the bytes never leave the device). It detects corruption,
lost and misplaced writes; it is not a MAC: who may write is the peer door's mutual TLS.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pdfabric_agent.plan import TransferPlan
from pdfabric_agent.pools import Pool, RankPools
from pdfabric_core.policy.types import Device

Region = tuple[int, int]  # (absolute address, length)
CHUNK_BYTES = 16 << 20  # regions are gathered and summed about this many bytes at a time
_positions = np.arange(0, dtype=np.uint64)  # 0, 1, 2, ...: grown on demand, shared by every sum


def source_regions(plan: TransferPlan, aux_base: int) -> list[Region]:
    """The stream at the sender: ``aux_base`` is its aux pool's address (side-channel rows are
    pool offsets)."""
    return list(_regions(plan, src=True, aux_base=aux_base))


def dest_regions(plan: TransferPlan, aux_base: int) -> list[Region]:
    return list(_regions(plan, src=False, aux_base=aux_base))


def _regions(plan: TransferPlan, *, src: bool, aux_base: int) -> Iterator[Region]:
    kvp = plan.kv_pages
    if kvp is not None:
        bases, pages, stride = (
            (kvp.src_bases, kvp.src_pages, kvp.src_stride) if src else (kvp.dst_bases, kvp.dst_pages, kvp.dst_stride)
        )
        for base in bases:
            for page in pages:
                yield base + page * stride, kvp.item
    else:
        for b in plan.kv:
            yield (b.src if src else b.dst), b.length
    for b in (*plan.state, *plan.aux):
        yield (b.src if src else b.dst), b.length
    for src_off, dst_off, size in plan.aux_tcp:
        yield aux_base + (src_off if src else dst_off), size


def _pool_of(pools: Sequence[Pool], addr: int, length: int) -> Pool:
    for pool in pools:
        if pool.addr <= addr and addr + length <= pool.addr + pool.size:
            return pool
    raise ValueError(f"{length} bytes at {addr:#x} are outside the rank's pools")


def checksum(pools: RankPools, regions: Sequence[Region]) -> str:
    """``"<length hex>:<sum hex>"`` of the stream the regions make, read from the rank's pools. Each
    region is zero-padded to whole words, so a run of regions on one device (the KV on the GPU, the
    aux rows on the CPU under some pools) is summed where it lives, at its place in the stream."""
    all_pools = pools.all()
    total = sum(n for _, n in regions)
    acc = 0
    word0 = 0  # index of the run's first word in the whole stream
    for device, run in _runs(all_pools, regions):
        for chunk in _chunks(run):
            if device is Device.CUDA:
                part, words = _gpu_sum(chunk, word0)
            else:
                part, words = _cpu_sum(chunk, word0)
            acc = (acc + part) % (1 << 64)
            word0 += words
    return f"{total:x}:{acc:016x}"


def _runs(pools: Sequence[Pool], regions: Sequence[Region]) -> Iterator[tuple[Device, list[tuple[Pool, int, int]]]]:
    """Consecutive regions on one device, each as (pool, offset, length)."""
    run: list[tuple[Pool, int, int]] = []
    device: Device | None = None
    for addr, n in regions:
        pool = _pool_of(pools, addr, n)
        if pool.device is not device and run:
            assert device is not None
            yield device, run
            run = []
        device = pool.device
        run.append((pool, addr - pool.addr, n))
    if run and device is not None:
        yield device, run


def _chunks(run: list[tuple[Pool, int, int]]) -> Iterator[list[tuple[Pool, int, int]]]:
    start, size = 0, 0
    for i, (_, _, n) in enumerate(run):
        size += n
        if size >= CHUNK_BYTES:
            yield run[start : i + 1]
            start, size = i + 1, 0
    if start < len(run):
        yield run[start:]


def _padded(n: int) -> int:
    return -(-n // 8) * 8


def _cpu_sum(chunk: list[tuple[Pool, int, int]], first: int) -> tuple[int, int]:
    """(the chunk's part of the sum, its words) with numpy."""
    parts: list[Any] = []
    for pool, off, n in chunk:
        parts.append(pool.view()[off : off + n])
        if n % 8:
            parts.append(bytes(_padded(n) - n))
    global _positions
    words = np.frombuffer(b"".join(parts), dtype="<u8")
    n = len(words)
    if len(_positions) < n:
        _positions = np.arange(n, dtype=np.uint64)
    # sum((2(first + j) + 1) x_j) = (2 first + 1) sum(x) + 2 sum(j x_j); uint64 arithmetic wraps
    # (the sum is mod 2**64 by design), np.dot needs no temporary array.
    with np.errstate(over="ignore"):
        plain = int(words.sum(dtype=np.uint64))
        ranked = int(np.dot(_positions[:n], words))
    return ((2 * first + 1) * plain + 2 * ranked) % (1 << 64), n


def _gpu_sum(chunk: list[tuple[Pool, int, int]], first: int) -> tuple[int, int]:
    """The same on the device (int64 arithmetic wraps like uint64): the bytes never leave the GPU."""
    import torch

    parts = []
    for pool, off, n in chunk:
        tensor = pool.tensor()
        parts.append(tensor[off : off + n])
        if n % 8:
            parts.append(torch.zeros(_padded(n) - n, dtype=torch.uint8, device=tensor.device))
    words = torch.cat(parts).view(torch.int64)
    weights = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device) * 2 + 1
    return int((words * weights).sum().item()) % (1 << 64), words.numel()
