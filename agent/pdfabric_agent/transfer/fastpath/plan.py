"""Launch tables for the agent's transfers (pure: no GPU, only CPU torch tensors and numpy).

Two shapes of request reach the fast path: absolute (src, dst, length) blocks, as the engine
interface carries them (`plan_blocks`, with `plan_blocks_list` for a handful of them in plain
Python), and a route's KV as page lists over its layer and K/V buffers (`plan_pages`: whole pages
through a cached `layout.Layout`, head slices of pages as blocks). The table format and the plan
types are in `table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pdfabric_agent.transfer.fastpath.layout import Layout, page_layout
from pdfabric_agent.transfer.fastpath.table import (
    DEFAULT_CHUNK_BYTES,
    GROUP_FIELDS,
    VEC_BYTES,
    LaunchPlan,
    PageIndices,
    PlanError,
    as_index,
)


def plan_blocks(
    src: torch.Tensor, dst: torch.Tensor, length: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> LaunchPlan:
    """Absolute (src, dst, length) blocks, as the agent's engine interface hands them over, in the
    same table format: blocks of one length form one group whose "buffers" are the blocks and whose
    only page is 0, so a few lengths (page, head slice, state, aux items) mean a few groups."""
    if chunk_bytes <= 0 or chunk_bytes % VEC_BYTES:
        raise PlanError(f"chunk_bytes must be a positive multiple of {VEC_BYTES}, got {chunk_bytes}")
    if not (src.numel() == dst.numel() == length.numel()):
        raise PlanError("src, dst and length must have one entry per block")
    if length.numel() and int(length.min()) <= 0:
        raise PlanError("block lengths must be positive")
    order = torch.argsort(length, stable=True)
    src, dst, length = src[order], dst[order], length[order]
    sizes, counts = torch.unique_consecutive(length, return_counts=True)
    g = sizes.numel()
    nchunks = (sizes + chunk_bytes - 1) // chunk_bytes
    units = counts * nchunks
    unit_start = torch.cumsum(units, 0) - units
    buf_start = torch.cumsum(counts, 0) - counts
    base_buf = g * GROUP_FIELDS
    base_page = base_buf + 2 * src.numel()
    head = torch.stack(
        [
            unit_start,
            counts,
            torch.ones_like(counts),
            nchunks,
            sizes,
            base_buf + 2 * buf_start,
            torch.full_like(counts, base_page),
            torch.zeros_like(counts),
        ],
        dim=1,
    ).reshape(-1)
    table = torch.cat([head, torch.stack([src, dst], dim=1).reshape(-1), torch.zeros(2, dtype=torch.int64)])
    return LaunchPlan(
        table=table,
        ngroups=g,
        total_units=int(units.sum()) if g else 0,
        total_bytes=int(length.sum()) if g else 0,
        chunk_bytes=chunk_bytes,
    )


def plan_blocks_list(blocks: Sequence[tuple[int, int, int]], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LaunchPlan:
    """`plan_blocks` for a handful of blocks (aux rows, a coalesced request) in plain Python:
    the same table, word for word, without the fixed cost of a dozen small tensor ops."""
    by_len: dict[int, list[tuple[int, int]]] = {}
    for s, d, n in blocks:
        if n <= 0:
            raise PlanError("block lengths must be positive")
        by_len.setdefault(n, []).append((s, d))
    sizes = sorted(by_len)
    base_buf = len(sizes) * GROUP_FIELDS
    base_page = base_buf + 2 * len(blocks)
    head: list[int] = []
    bufs: list[int] = []
    unit = total = 0
    for n in sizes:
        pairs = by_len[n]
        nchunks = -(-n // chunk_bytes)
        head += (unit, len(pairs), 1, nchunks, n, base_buf + len(bufs), base_page, 0)
        for s, d in pairs:
            bufs += (s, d)
        unit += len(pairs) * nchunks
        total += len(pairs) * n
    return LaunchPlan(head + bufs + [0, 0], len(sizes), unit, total, chunk_bytes)


def plan_pages(
    pool: str,
    pairs: Sequence[tuple[int, int]],
    item: int,
    src_stride: int,
    dst_stride: int,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    layout: Layout | None = None,
    dst_set: set[int] | None = None,
    limits: tuple[int, int] = (0, 0),
) -> LaunchPlan:
    """One launch for buffers that move the same page lists: pair b's page i moves ``item`` bytes
    from ``src + src_pages[i] * src_stride`` to ``dst + dst_pages[i] * dst_stride`` (the agent's
    KV of one route: one pair per layer and K/V). When pages are whole (item == both strides) the
    table holds the pairs and the page list once (a few KiB for a whole request); a head slice of
    each page (stride > item) becomes one block per (pair, page). ``dst_pages_by_pool[pool]``
    names the destination pages for the receiver ledger either way. ``layout``: a cached
    ``Layout`` of exactly these pairs (whole pages only), to skip rebuilding it per request;
    ``dst_set``: ``set(dst_pages)`` when the caller has it. ``limits``: pages per buffer on the
    source and destination side (0: unchecked); a page index at or past them is refused."""
    if item <= 0 or src_stride < item or dst_stride < item:
        raise PlanError(f"item of {item} bytes does not fit strides {src_stride} / {dst_stride}")
    if len(src_pages) != len(dst_pages):
        raise PlanError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    if item == src_stride == dst_stride:
        if layout is None:
            layout = page_layout(pool, pairs, item, chunk_bytes, src_pages=limits[0], dst_pages=limits[1])
        if len(layout.groups) == 1 and len(src_pages):
            return _plan_one_group(layout, src_pages, dst_pages, dst_set)
        return layout.plan([(src_pages, dst_pages)])
    sp, dp = as_index(src_pages), as_index(dst_pages)
    if sp.numel() and min(int(sp.min()), int(dp.min())) < 0:
        raise PlanError(f"pool {pool}: negative page index")
    if sp.numel() and any(lim and int(t.max()) >= lim for t, lim in zip((sp, dp), limits, strict=True)):
        raise PlanError(f"pool {pool}: page index past the end of a buffer")
    bases = torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
    src = (bases[:, :1] + (sp * src_stride)[None, :]).reshape(-1)
    dst = (bases[:, 1:] + (dp * dst_stride)[None, :]).reshape(-1)
    plan = plan_blocks(src, dst, torch.full_like(src, item), chunk_bytes)
    if sp.numel():
        plan.dst_pages_by_pool = {pool: torch.unique(dp)}
    return plan


def _plan_one_group(
    layout: Layout,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    dst_set: set[int] | None,
) -> LaunchPlan:
    """``Layout.plan`` for one group (the agent's whole-page KV), the same table word for word,
    written with a handful of numpy operations (it sits on the launch path of every request:
    numpy's per-call cost is a fraction of torch's); the table is a zero-copy tensor of it."""
    g = layout.groups[0]
    sp, dp = _as_np(src_pages), _as_np(dst_pages)
    n = len(sp)
    if n != len(dp):
        raise PlanError(f"pool {g.pool}: {n} source pages but {len(dp)} destination pages")
    fixed = GROUP_FIELDS + len(layout.buf_words)
    table = np.empty(fixed + 2 * n, dtype=np.int64)
    if layout.buf_array is None:
        layout.buf_array = np.array(layout.buf_words, dtype=np.int64)
    table[:GROUP_FIELDS] = (0, g.nbuf, n, g.nchunks, g.item, GROUP_FIELDS + g.buf_rel, fixed, 0)
    table[GROUP_FIELDS:fixed] = layout.buf_array
    table[fixed::2] = sp
    table[fixed + 1 :: 2] = dp
    if n:
        s_lo, s_hi, d_lo, d_hi = int(sp.min()), int(sp.max()), int(dp.min()), int(dp.max())
        if min(s_lo, d_lo) < 0:
            raise PlanError(f"pool {g.pool}: negative page index")
        if (g.src_limit is not None and s_hi >= g.src_limit) or (g.dst_limit is not None and d_hi >= g.dst_limit):
            raise PlanError(f"pool {g.pool}: page index past the end of a buffer")
    if dst_set is None:
        dst_set = set(dst_pages) if isinstance(dst_pages, list) else set(dp.tolist())
    return LaunchPlan(
        table=torch.from_numpy(table),
        ngroups=1,
        total_units=g.nbuf * n * g.nchunks,
        total_bytes=g.nbuf * n * g.item,
        chunk_bytes=layout.chunk_bytes,
        dst_pages_by_pool={g.pool: dst_set},
    )


def _as_np(x: PageIndices | npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.int64]:
    if isinstance(x, torch.Tensor):
        return x.to(dtype=torch.int64, device="cpu").numpy()
    if isinstance(x, np.ndarray):
        return x.astype(np.int64, copy=False)
    return np.fromiter(x, dtype=np.int64, count=len(x))
