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
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdfabric_agent.memory.plan import TransferPlan
from pdfabric_agent.memory.pools import Pool, region_of
from pdfabric_core.policy.types import Device

Region = tuple[int, int]  # (absolute address, length)


@dataclass(frozen=True)
class Rows:
    """``item`` bytes at ``base + page * stride`` for each page, in order: one KV buffer's pages
    (whole pages, or a head slice of each), gathered in one operation instead of one per page."""

    base: int
    stride: int
    item: int
    pages: Sequence[int]


Piece = Region | Rows
CHUNK_BYTES = 16 << 20  # regions are gathered and summed about this many bytes at a time
_positions = np.arange(0, dtype=np.uint64)  # 0, 1, 2, ...: grown on demand, shared by every sum


def source_regions(plan: TransferPlan) -> list[Piece]:
    """The stream at the sender."""
    return list(_pieces(plan, src=True))


def dest_regions(plan: TransferPlan) -> list[Piece]:
    return list(_pieces(plan, src=False))


def flat(pieces: Sequence[Piece]) -> list[Region]:
    """The same stream as plain regions."""
    out: list[Region] = []
    for piece in pieces:
        if isinstance(piece, Rows):
            out.extend((piece.base + page * piece.stride, piece.item) for page in piece.pages)
        else:
            out.append(piece)
    return out


def _pieces(plan: TransferPlan, *, src: bool) -> Iterator[Piece]:
    kvp = plan.kv_pages
    if kvp is not None:
        bases, pages, stride = (
            (kvp.src_bases, kvp.src_pages, kvp.src_stride) if src else (kvp.dst_bases, kvp.dst_pages, kvp.dst_stride)
        )
        for base in bases:
            if len(pages):
                yield Rows(base, stride, kvp.item, pages)
    else:
        for b in plan.kv:
            yield (b.src if src else b.dst), b.length
    for b in (*plan.state, *plan.aux):
        yield (b.src if src else b.dst), b.length
    for src_addr, dst_addr, size in plan.aux_tcp:
        yield (src_addr if src else dst_addr), size


def checksum(all_pools: Sequence[Pool], pieces: Sequence[Piece]) -> str:
    """``"<length hex>:<sum hex>"`` of the stream the pieces make, read from the rank's memory (its
    pools, or an engine's buffers). Each region (each row of a ``Rows``) is zero-padded to whole
    words, so every piece is summed where it lives (the KV on the GPU, the aux rows on the CPU
    under some pools), at its place in the stream."""
    total = 0
    acc = 0
    word0 = 0  # index of the next piece's first word in the whole stream
    flat_run: list[Region] = []

    def add(part: int, words: int) -> None:
        nonlocal acc, word0
        acc = (acc + part) % (1 << 64)
        word0 += words

    def drain() -> None:
        for device, run in _runs(all_pools, flat_run):
            for chunk in _chunks(run):
                add(*(_gpu_sum(chunk, word0) if device is Device.CUDA else _cpu_sum(chunk, word0)))
        flat_run.clear()

    for piece in pieces:
        if isinstance(piece, Rows):
            drain()
            total += piece.item * len(piece.pages)
            add(*_rows_sum(all_pools, piece, word0))
        else:
            total += piece[1]
            flat_run.append(piece)
    drain()
    return f"{total:x}:{acc:016x}"


def _rows_sum(pools: Sequence[Pool], rows: Rows, first: int) -> tuple[int, int]:
    """A ``Rows`` piece gathered by page index (one strided view, one fancy-index per chunk)."""
    if not rows.pages:
        return 0, 0
    span = max(rows.pages) * rows.stride + rows.item
    pool = region_of(pools, rows.base, span)
    off = rows.base - pool.addr
    padded = _padded(rows.item)
    per_chunk = max(1, CHUNK_BYTES // max(padded, 1))
    acc, words = 0, 0
    for lo in range(0, len(rows.pages), per_chunk):
        pages = rows.pages[lo : lo + per_chunk]
        if pool.device is Device.CUDA:
            part, n = _gpu_rows(pool, off, rows, pages, first + words)
        else:
            part, n = _cpu_rows(pool, off, rows, pages, first + words)
        acc, words = (acc + part) % (1 << 64), words + n
    return acc, words


def _cpu_rows(pool: Pool, off: int, rows: Rows, pages: Sequence[int], first: int) -> tuple[int, int]:
    buf = np.frombuffer(pool.view(), dtype=np.uint8)
    table = np.lib.stride_tricks.as_strided(buf[off:], shape=(max(pages) + 1, rows.item), strides=(rows.stride, 1))
    picked = table[np.asarray(pages, dtype=np.int64)]
    if rows.item % 8:
        picked = np.pad(picked, ((0, 0), (0, _padded(rows.item) - rows.item)))
    return _cpu_words(np.ascontiguousarray(picked).view("<u8").ravel(), first)


def _gpu_rows(pool: Pool, off: int, rows: Rows, pages: Sequence[int], first: int) -> tuple[int, int]:
    import torch

    tensor = pool.tensor()
    table = tensor[off:].as_strided((max(pages) + 1, rows.item), (rows.stride, 1))
    index = torch.as_tensor(list(pages), dtype=torch.int64, device=tensor.device)
    picked = table.index_select(0, index)
    if rows.item % 8:
        picked = torch.nn.functional.pad(picked, (0, _padded(rows.item) - rows.item))
    return _gpu_words(picked.contiguous().view(torch.int64).reshape(-1), first)


def _runs(pools: Sequence[Pool], regions: Sequence[Region]) -> Iterator[tuple[Device, list[tuple[Pool, int, int]]]]:
    """Consecutive regions on one device, each as (pool, offset, length)."""
    run: list[tuple[Pool, int, int]] = []
    device: Device | None = None
    for addr, n in regions:
        pool = region_of(pools, addr, n)
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
    return _cpu_words(np.frombuffer(b"".join(parts), dtype="<u8"), first)


def _cpu_words(words: np.ndarray[Any, np.dtype[np.uint64]], first: int) -> tuple[int, int]:
    global _positions
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
    return _gpu_words(torch.cat(parts).view(torch.int64), first)


def _gpu_words(words: Any, first: int) -> tuple[int, int]:
    import torch

    n = words.numel()
    if n == 0:
        return 0, 0
    weights = torch.arange(first, first + n, dtype=torch.int64, device=words.device) * 2 + 1
    return int((words * weights).sum().item()) % (1 << 64), n
