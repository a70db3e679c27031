"""Planning of fast-path launches from page lists (pure: no GPU, only CPU torch tensors).

A request is a few *groups*: a set of buffer pairs that share one page-index list and one item
size (all K and V layers of the KV pool; each state buffer kind; each aux buffer). The kernel
walks *units*: one chunk (at most `chunk_bytes`) of one page of one buffer, so work is spread
evenly over warps whatever the page size, and a whole request (every layer, every pool) is one
launch as long as its table fits the limit.

Table layout (int64, what the kernel reads):
  groups  G x 8 : unit_start, nbuf, npages, nchunks, item_bytes, buf_off, page_off, 0
  buffers B x 2 : src_base, dst_base                     (buf_off indexes here)
  pages   P x 2 : src_page, dst_page                     (page_off indexes here)
Offsets are in int64 elements from the table start; groups sit first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GROUP_FIELDS = 8
DEFAULT_CHUNK_BYTES = 4096  # 32 lanes x 16 B x 8 loads in flight per lane
VEC_BYTES = 16
MAX_TABLE_BYTES = 64 << 20  # beyond this a request is split into more launches
# Tables up to this many int64 words travel inside the kernel's parameters (no copy, no extra
# launch): this is what keeps an aux-sized request near launch latency.
SMALL_TABLE_WORDS = 256


class PlanError(ValueError):
    """A request the fast path cannot express; the caller falls back to the engine path."""


@dataclass(frozen=True)
class BufferPair:
    """One source buffer (local pool) and its destination (the peer's pool, mapped here)."""

    src_ptr: int
    dst_ptr: int
    item_bytes: int  # bytes of one page (one index) in this buffer
    src_bytes: int = 0  # buffer sizes, when known: pages past the end are refused, not written
    dst_bytes: int = 0


@dataclass
class CopyGroup:
    """Buffers that move the same page indices. `pool` names the receiver pool for overlap checks."""

    pool: str
    buffers: Sequence[BufferPair]
    src_pages: torch.Tensor | Sequence[int]
    dst_pages: torch.Tensor | Sequence[int]


@dataclass
class LaunchPlan:
    table: torch.Tensor | list[int]  # int64 words; a plain list when small (built without torch)
    ngroups: int
    total_units: int
    total_bytes: int
    chunk_bytes: int
    dst_pages_by_pool: dict[str, set[int] | torch.Tensor] = field(default_factory=dict)

    @property
    def small(self) -> bool:
        return isinstance(self.table, list) and len(self.table) <= SMALL_TABLE_WORDS

    def words(self) -> list[int]:
        return self.table if isinstance(self.table, list) else self.table.tolist()


def _as_index(x: torch.Tensor | Sequence[int]) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.int64)
    if t.dim() != 1:
        raise PlanError(f"page indices must be one-dimensional, got shape {tuple(t.shape)}")
    return t.to(dtype=torch.int64, device="cpu")


def _is_small(groups: Sequence[CopyGroup]) -> bool:
    n = 0
    for g in groups:
        if isinstance(g.src_pages, torch.Tensor) or isinstance(g.dst_pages, torch.Tensor):
            return False
        n += len(g.src_pages) + len(g.buffers)
    return n <= SMALL_TABLE_WORDS // 4


def split_by_item_bytes(group: CopyGroup) -> list[CopyGroup]:
    """One kernel group per item size: the kernel derives offsets from one item size per group."""
    sizes: dict[int, list[BufferPair]] = {}
    for b in group.buffers:
        sizes.setdefault(b.item_bytes, []).append(b)
    return [CopyGroup(group.pool, bufs, group.src_pages, group.dst_pages) for bufs in sizes.values()]


def plan_launch(groups: Sequence[CopyGroup], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LaunchPlan:
    if chunk_bytes <= 0 or chunk_bytes % VEC_BYTES:
        raise PlanError(f"chunk_bytes must be a positive multiple of {VEC_BYTES}, got {chunk_bytes}")
    flat = [g for group in groups for g in split_by_item_bytes(group)]
    small = _is_small(flat)  # aux-sized: pure Python, microseconds
    header: list[list[int]] = []
    bufs: list[int] = []
    pages_t: list[torch.Tensor] = []
    pages_l: list[int] = []
    npage_rows = 0
    unit = 0
    total_bytes = 0
    dst_by_pool: dict[str, list] = {}
    for g in flat:
        if small:
            src_l, dst_l = [int(x) for x in g.src_pages], [int(x) for x in g.dst_pages]
            n = len(src_l)
            if n != len(dst_l):
                raise PlanError(f"pool {g.pool}: {n} source pages but {len(dst_l)} destination pages")
            if n == 0 or not g.buffers:
                continue
            lo, hi_src, hi_dst = min(min(src_l), min(dst_l)), max(src_l), max(dst_l)
        else:
            src, dst = _as_index(g.src_pages), _as_index(g.dst_pages)
            n = src.numel()
            if n != dst.numel():
                raise PlanError(f"pool {g.pool}: {n} source pages but {dst.numel()} destination pages")
            if n == 0 or not g.buffers:
                continue
            lo = min(int(src.min()), int(dst.min()))
            hi_src, hi_dst = int(src.max()), int(dst.max())
        if lo < 0:
            raise PlanError(f"pool {g.pool}: negative page index")
        item = g.buffers[0].item_bytes
        if item <= 0:
            raise PlanError(f"pool {g.pool}: item size must be positive, got {item}")
        if any(b.item_bytes != item for b in g.buffers):
            raise PlanError(f"pool {g.pool}: buffers of one kernel group must share an item size")
        for b in g.buffers:
            if (b.src_bytes and (hi_src + 1) * item > b.src_bytes) or (
                b.dst_bytes and (hi_dst + 1) * item > b.dst_bytes
            ):
                raise PlanError(f"pool {g.pool}: page index past the end of a buffer")
        nchunks = -(-item // chunk_bytes)
        header.append([unit, len(g.buffers), n, nchunks, item, len(bufs), npage_rows, 0])
        for b in g.buffers:
            bufs += [b.src_ptr, b.dst_ptr]
        if small:
            for a, b2 in zip(src_l, dst_l, strict=True):
                pages_l += [a, b2]
            dst_by_pool.setdefault(g.pool, []).extend(dst_l)
        else:
            pages_t.append(torch.stack([src, dst], dim=1).reshape(-1))
            dst_by_pool.setdefault(g.pool, []).append(dst)
        npage_rows += 2 * n
        unit += len(g.buffers) * n * nchunks
        total_bytes += len(g.buffers) * n * item
    ngroups = len(header)
    base_buf = ngroups * GROUP_FIELDS
    base_page = base_buf + len(bufs)
    for h in header:
        h[5] += base_buf
        h[6] += base_page
    head = [w for h in header for w in h]
    table: torch.Tensor | list[int]
    if small:
        table = head + bufs + pages_l
        by_pool: dict[str, set[int] | torch.Tensor] = {k: set(v) for k, v in dst_by_pool.items()}
    else:
        table = torch.cat([torch.tensor(head + bufs, dtype=torch.int64), *pages_t])
        by_pool = {k: torch.unique(torch.cat(v)) for k, v in dst_by_pool.items()}
        if table.numel() * 8 > MAX_TABLE_BYTES:
            raise PlanError(f"launch table of {table.numel() * 8} bytes exceeds {MAX_TABLE_BYTES}; split the request")
    return LaunchPlan(
        table=table,
        ngroups=ngroups,
        total_units=unit,
        total_bytes=total_bytes,
        chunk_bytes=chunk_bytes,
        dst_pages_by_pool=by_pool,
    )


def reference_copies(plan: LaunchPlan) -> list[tuple[int, int, int]]:
    """(src_addr, dst_addr, nbytes) per unit, decoded exactly as the kernel does; for tests."""
    t = plan.words()
    out: list[tuple[int, int, int]] = []
    for g in range(plan.ngroups):
        unit_start, nbuf, npages, nchunks, item, buf_off, page_off, _ = t[g * GROUP_FIELDS : (g + 1) * GROUP_FIELDS]
        for local in range(nbuf * npages * nchunks):
            chunk, rest = local % nchunks, local // nchunks
            page, buf = rest % npages, rest // npages
            src_base, dst_base = t[buf_off + 2 * buf], t[buf_off + 2 * buf + 1]
            src_page, dst_page = t[page_off + 2 * page], t[page_off + 2 * page + 1]
            off = chunk * plan.chunk_bytes
            n = min(plan.chunk_bytes, item - off)
            out.append((src_base + src_page * item + off, dst_base + dst_page * item + off, n))
        assert unit_start + nbuf * npages * nchunks <= plan.total_units
    return out


def grid_for(total_units: int, *, sms: int, blocks_per_sm: int, threads: int) -> int:
    """Persistent grid: enough warps to cover the units, never more than the machine holds."""
    warps_per_block = threads // 32
    need = -(-total_units // warps_per_block)
    return max(1, min(need, sms * blocks_per_sm))
