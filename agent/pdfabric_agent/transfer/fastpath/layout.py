"""Launch tables from page lists over fixed buffers: `Layout`, planned once per connection.

Between one sender and one receiver the buffers that move together (every K and V layer of the
KV pool, each state buffer kind, each aux buffer) do not change from request to request; only
the page lists do. A `Layout` holds that fixed part (kernel groups and the buffer region of the
table, see `table`), and its `plan` writes a request's table from the page lists alone.
`page_layout` is the one-group layout of a route's whole-page KV; `plan_launch` plans a one-off
request from its `CopyGroup`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import numpy.typing as npt
import torch

from pdfabric_agent.transfer.fastpath.table import (
    DEFAULT_CHUNK_BYTES,
    GROUP_FIELDS,
    MAX_TABLE_BYTES,
    SMALL_TABLE_WORDS,
    VEC_BYTES,
    BufferPair,
    CopyGroup,
    LaunchPlan,
    PageIndices,
    PlanError,
    as_index,
)


def split_by_item_bytes(group: CopyGroup) -> list[CopyGroup]:
    """One kernel group per item size: the kernel derives offsets from one item size per group."""
    sizes: dict[int, list[BufferPair]] = {}
    for b in group.buffers:
        sizes.setdefault(b.item_bytes, []).append(b)
    return [CopyGroup(group.pool, bufs, group.src_pages, group.dst_pages) for bufs in sizes.values()]


@dataclass(frozen=True)
class KernelGroup:
    """One group of the table: buffers of one layout pool with one item size."""

    source: int  # index of the layout pool whose page lists this group uses
    pool: str
    item: int
    nchunks: int
    nbuf: int
    buf_rel: int  # first word of its buffers inside the buffer region
    src_limit: int | None  # pages per source buffer when every size is known
    dst_limit: int | None


class Layout:
    """The fixed part of requests between one sender and one receiver: which buffers move together.

    Pools are registered once per connection, so the per-request work is only the page lists:
    for an aux-sized request that is a few list operations (microseconds), for a whole request a
    couple of tensor ops. Buffers of one pool with different item sizes become separate kernel
    groups that share the pool's page region in the table.
    """

    def __init__(self, pools: Sequence[tuple[str, Sequence[BufferPair]]], chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if chunk_bytes <= 0 or chunk_bytes % VEC_BYTES:
            raise PlanError(f"chunk_bytes must be a positive multiple of {VEC_BYTES}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.pools = [name for name, _ in pools]
        self.groups: list[KernelGroup] = []
        words: list[int] = []
        for i, (name, buffers) in enumerate(pools):
            for g in split_by_item_bytes(CopyGroup(name, buffers, [], [])):
                item = g.buffers[0].item_bytes
                if item <= 0:
                    raise PlanError(f"pool {name}: item size must be positive, got {item}")
                srcs = [b.src_bytes // item for b in g.buffers]
                dsts = [b.dst_bytes // item for b in g.buffers]
                self.groups.append(
                    KernelGroup(
                        source=i,
                        pool=name,
                        item=item,
                        nchunks=-(-item // chunk_bytes),
                        nbuf=len(g.buffers),
                        buf_rel=len(words),
                        src_limit=min(srcs) if all(b.src_bytes for b in g.buffers) else None,
                        dst_limit=min(dsts) if all(b.dst_bytes for b in g.buffers) else None,
                    )
                )
                for b in g.buffers:
                    words += [b.src_ptr, b.dst_ptr]
        self.buf_words = words
        self.buf_array: npt.NDArray[np.int64] | None = None  # buf_words as an array, made on first use
        self.npools_buffers = sum(len(b) for _, b in pools)
        self._small_ok = self.npools_buffers <= SMALL_TABLE_WORDS // 4
        # Aux-sized requests move one page per pool: their header never changes, so keep it.
        base_buf = len(self.groups) * GROUP_FIELDS
        base_page = base_buf + len(words)
        head: list[int] = []
        unit = total = 0
        for kg in self.groups:
            head += (unit, kg.nbuf, 1, kg.nchunks, kg.item, base_buf + kg.buf_rel, base_page + 2 * kg.source, 0)
            unit += kg.nbuf * kg.nchunks
            total += kg.nbuf * kg.item
        self._one_prefix = head + words
        self._one_units, self._one_bytes = unit, total

    def _plan_one_page(self, pages: Sequence[tuple[list[int], list[int]]]) -> LaunchPlan:
        words = list(self._one_prefix)
        by_pool: dict[str, set[int]] = {}
        for name, (src, dst) in zip(self.pools, pages, strict=True):
            s, d = src[0], dst[0]
            if s < 0 or d < 0:
                raise PlanError(f"pool {name}: negative page index")
            words += (s, d)
            got = by_pool.get(name)
            by_pool[name] = {d} if got is None else got | {d}
        for g in self.groups:
            if (g.src_limit is not None and pages[g.source][0][0] >= g.src_limit) or (
                g.dst_limit is not None and pages[g.source][1][0] >= g.dst_limit
            ):
                raise PlanError(f"pool {g.pool}: page index past the end of a buffer")
        return LaunchPlan(words, len(self.groups), self._one_units, self._one_bytes, self.chunk_bytes, by_pool)

    def _plan_small(self, pages: Sequence[tuple[list[int], list[int]]]) -> LaunchPlan:
        """Aux-sized requests on the hot path: plain lists only, no tensors, no intermediate objects."""
        if all(len(s) == 1 and len(d) == 1 for s, d in pages):
            return self._plan_one_page(pages)
        counts: list[int] = []
        his: list[tuple[int, int]] = []
        rel: list[int] = []
        words: list[int] = []
        by_pool: dict[str, set[int]] = {}
        for name, (src, dst) in zip(self.pools, pages, strict=True):
            n = len(src)
            if n != len(dst):
                raise PlanError(f"pool {name}: {n} source pages but {len(dst)} destination pages")
            rel.append(len(words))
            counts.append(n)
            if n:
                if min(src) < 0 or min(dst) < 0:
                    raise PlanError(f"pool {name}: negative page index")
                his.append((max(src), max(dst)))
                for a, b in zip(src, dst, strict=True):
                    words.append(a)
                    words.append(b)
                got = by_pool.get(name)
                by_pool[name] = set(dst) if got is None else got | set(dst)
            else:
                his.append((0, 0))
        live = [g for g in self.groups if counts[g.source]]
        base_buf = len(live) * GROUP_FIELDS
        base_page = base_buf + len(self.buf_words)
        head: list[int] = []
        unit = total = 0
        for g in live:
            n = counts[g.source]
            hs, hd = his[g.source]
            if (g.src_limit is not None and hs >= g.src_limit) or (g.dst_limit is not None and hd >= g.dst_limit):
                raise PlanError(f"pool {g.pool}: page index past the end of a buffer")
            head += (unit, g.nbuf, n, g.nchunks, g.item, base_buf + g.buf_rel, base_page + rel[g.source], 0)
            unit += g.nbuf * n * g.nchunks
            total += g.nbuf * n * g.item
        return LaunchPlan(head + self.buf_words + words, len(live), unit, total, self.chunk_bytes, by_pool)

    def plan(self, pages: Sequence[tuple[PageIndices, PageIndices]]) -> LaunchPlan:
        """A request's table from one (source, destination) page list pair per layout pool."""
        if len(pages) != len(self.pools):
            raise PlanError(f"layout has {len(self.pools)} pools but {len(pages)} page lists were given")
        if self._small_ok and _fits_small_table(pages, self.npools_buffers):
            return self._plan_small(pages)
        counts: list[int] = []
        bounds: list[tuple[int, int]] = []
        page_tensors: list[torch.Tensor] = []
        page_rel: list[int] = []
        dst_by_pool: dict[str, list[torch.Tensor]] = {}
        rel = 0
        for name, (src_in, dst_in) in zip(self.pools, pages, strict=True):
            src, dst = as_index(src_in), as_index(dst_in)
            n = src.numel()
            if n != dst.numel():
                raise PlanError(f"pool {name}: {n} source pages but {dst.numel()} destination pages")
            if n:
                lo = min(int(src.min()), int(dst.min()))
                hi = (int(src.max()), int(dst.max()))
                page_tensors.append(torch.stack([src, dst], dim=1).reshape(-1))
                dst_by_pool.setdefault(name, []).append(dst)
            if n and lo < 0:
                raise PlanError(f"pool {name}: negative page index")
            counts.append(n)
            bounds.append(hi if n else (0, 0))
            page_rel.append(rel)
            rel += 2 * n
        live = [g for g in self.groups if counts[g.source]]
        for g in live:
            hs, hd = bounds[g.source]
            if (g.src_limit is not None and hs >= g.src_limit) or (g.dst_limit is not None and hd >= g.dst_limit):
                raise PlanError(f"pool {g.pool}: page index past the end of a buffer")
        base_buf = len(live) * GROUP_FIELDS
        base_page = base_buf + len(self.buf_words)
        head: list[int] = []
        unit = 0
        total_bytes = 0
        for g in live:
            n = counts[g.source]
            head += [unit, g.nbuf, n, g.nchunks, g.item, base_buf + g.buf_rel, base_page + page_rel[g.source], 0]
            unit += g.nbuf * n * g.nchunks
            total_bytes += g.nbuf * n * g.item
        table = torch.cat([torch.tensor(head + self.buf_words, dtype=torch.int64), *page_tensors])
        by_pool = {k: torch.unique(torch.cat(v)) for k, v in dst_by_pool.items()}
        if table.numel() * 8 > MAX_TABLE_BYTES:
            raise PlanError(f"launch table of {table.numel() * 8} bytes exceeds {MAX_TABLE_BYTES}; split the request")
        return LaunchPlan(
            table=table,
            ngroups=len(live),
            total_units=unit,
            total_bytes=total_bytes,
            chunk_bytes=self.chunk_bytes,
            dst_pages_by_pool=by_pool,
        )


def plan_launch(groups: Sequence[CopyGroup], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LaunchPlan:
    """One-off planning; callers with fixed pools keep a `Layout` and call its `plan`."""
    layout = Layout([(g.pool, g.buffers) for g in groups], chunk_bytes)
    return layout.plan([(g.src_pages, g.dst_pages) for g in groups])


def page_layout(
    pool: str,
    pairs: Sequence[tuple[int, int]],
    item: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    src_pages: int = 0,
    dst_pages: int = 0,
) -> Layout:
    """The fixed part of ``plan_pages`` for whole pages (one group: the pairs share the page list).
    ``src_pages`` / ``dst_pages``: pages per buffer on each side when known; a page index at or past
    them is then refused by every plan of this layout (0: unchecked)."""
    return Layout([(pool, [BufferPair(s, d, item, src_pages * item, dst_pages * item) for s, d in pairs])], chunk_bytes)


def _fits_small_table(
    pages: Sequence[tuple[PageIndices, PageIndices]], nbuffers: int
) -> TypeGuard[Sequence[tuple[list[int], list[int]]]]:
    """Whether ``Layout._plan_small`` takes the request: every page list a plain list (the hot
    path's aux-sized requests, built without torch) and, with the layout's ``nbuffers``, few
    enough pages for a table that travels inside the kernel's parameters."""
    n = nbuffers
    for s_in, d_in in pages:
        if type(s_in) is not list or type(d_in) is not list:
            return False
        n += len(s_in)
    return n <= SMALL_TABLE_WORDS // 4
