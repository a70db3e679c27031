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

import numpy as np
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


def split_by_item_bytes(group: CopyGroup) -> list[CopyGroup]:
    """One kernel group per item size: the kernel derives offsets from one item size per group."""
    sizes: dict[int, list[BufferPair]] = {}
    for b in group.buffers:
        sizes.setdefault(b.item_bytes, []).append(b)
    return [CopyGroup(group.pool, bufs, group.src_pages, group.dst_pages) for bufs in sizes.values()]


@dataclass(frozen=True)
class _KernelGroup:
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
        self.groups: list[_KernelGroup] = []
        words: list[int] = []
        for i, (name, buffers) in enumerate(pools):
            for g in split_by_item_bytes(CopyGroup(name, buffers, [], [])):
                item = g.buffers[0].item_bytes
                if item <= 0:
                    raise PlanError(f"pool {name}: item size must be positive, got {item}")
                srcs = [b.src_bytes // item for b in g.buffers]
                dsts = [b.dst_bytes // item for b in g.buffers]
                self.groups.append(
                    _KernelGroup(
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
        self.buf_array: np.ndarray | None = None  # buf_words as an array, made on first use
        self.npools_buffers = sum(len(b) for _, b in pools)
        self._small_ok = self.npools_buffers <= SMALL_TABLE_WORDS // 4
        # Aux-sized requests move one page per pool: their header never changes, so keep it.
        base_buf = len(self.groups) * GROUP_FIELDS
        base_page = base_buf + len(words)
        head: list[int] = []
        unit = total = 0
        for g in self.groups:
            head += (unit, g.nbuf, 1, g.nchunks, g.item, base_buf + g.buf_rel, base_page + 2 * g.source, 0)
            unit += g.nbuf * g.nchunks
            total += g.nbuf * g.item
        self._one_prefix = head + words
        self._one_units, self._one_bytes = unit, total

    def _plan_one_page(self, pages: Sequence[tuple[list[int], list[int]]]) -> LaunchPlan:
        words = list(self._one_prefix)
        by_pool: dict[str, set[int] | torch.Tensor] = {}
        for name, (src, dst) in zip(self.pools, pages, strict=True):
            s, d = src[0], dst[0]
            if s < 0 or d < 0:
                raise PlanError(f"pool {name}: negative page index")
            words += (s, d)
            got = by_pool.get(name)
            by_pool[name] = {d} if got is None else got | {d}  # type: ignore[operator]
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
        by_pool: dict[str, set[int] | torch.Tensor] = {}
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
                by_pool[name] = set(dst) if got is None else got | set(dst)  # type: ignore[operator]
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

    def plan(self, pages: Sequence[tuple[torch.Tensor | Sequence[int], torch.Tensor | Sequence[int]]]) -> LaunchPlan:
        if len(pages) != len(self.pools):
            raise PlanError(f"layout has {len(self.pools)} pools but {len(pages)} page lists were given")
        if self._small_ok:
            n = self.npools_buffers
            for s_in, d_in in pages:
                if type(s_in) is not list or type(d_in) is not list:
                    break
                n += len(s_in)
            else:
                if n <= SMALL_TABLE_WORDS // 4:
                    return self._plan_small(pages)
        small = False
        counts: list[int] = []
        bounds: list[tuple[int, int]] = []
        page_words: list[int] = []
        page_tensors: list[torch.Tensor] = []
        page_rel: list[int] = []
        dst_by_pool: dict[str, list] = {}
        rel = 0
        for name, (src_in, dst_in) in zip(self.pools, pages, strict=True):
            if small:
                src_l, dst_l = [int(x) for x in src_in], [int(x) for x in dst_in]
                n = len(src_l)
                if n != len(dst_l):
                    raise PlanError(f"pool {name}: {n} source pages but {len(dst_l)} destination pages")
                if n:
                    lo, hi = min(min(src_l), min(dst_l)), (max(src_l), max(dst_l))
                    for a, b2 in zip(src_l, dst_l, strict=True):
                        page_words += [a, b2]
                    dst_by_pool.setdefault(name, []).extend(dst_l)
            else:
                src, dst = _as_index(src_in), _as_index(dst_in)
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
        table: torch.Tensor | list[int]
        if small:
            table = head + self.buf_words + page_words
            by_pool: dict[str, set[int] | torch.Tensor] = {k: set(v) for k, v in dst_by_pool.items()}
        else:
            table = torch.cat([torch.tensor(head + self.buf_words, dtype=torch.int64), *page_tensors])
            by_pool = {k: torch.unique(torch.cat(v)) for k, v in dst_by_pool.items()}
            if table.numel() * 8 > MAX_TABLE_BYTES:
                raise PlanError(
                    f"launch table of {table.numel() * 8} bytes exceeds {MAX_TABLE_BYTES}; split the request"
                )
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
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
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
    sp, dp = _as_index(src_pages), _as_index(dst_pages)
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
    src_pages: torch.Tensor | Sequence[int],
    dst_pages: torch.Tensor | Sequence[int],
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


def _as_np(x: torch.Tensor | Sequence[int]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to(dtype=torch.int64, device="cpu").numpy()
    if isinstance(x, np.ndarray):
        return x.astype(np.int64, copy=False)
    return np.fromiter(x, dtype=np.int64, count=len(x))


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
