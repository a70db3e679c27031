"""Turn one room into engine blocks: pure, no I/O, every rule from ``pdfabric_core``.

What a prefill rank owes a decode rank for a room (its route's heads, its CP page shard, its
state layers, whether it sends the aux row, the PP layer shift) is ``pdfabric_core.duties``
(``sender_duties``), shared with the operator's traffic prediction. This module turns those
duties into addresses: whole-page routes are coalesced into runs (coalesce), head-slice routes
move one contiguous head slice per page (heads are the outer dimension of a page, see pools.py)
or, in token-major pages (an engine's own, SGLang's), one per token of each page; state moves per
owned state layer and slot run, aux per item through the engine or over the TCP side channel as
the duties' aux path says.

Addresses come from a ``MemoryMap``: the first byte of every buffer of a rank (each layer's K and
V, each state layer, each aux item). The agent's pools are one region per kind (``Bases`` is their
short form); an engine's buffers are wherever the engine allocated them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_core.duties import (
    Duties,
    decode_targets,
    expected_sources,
    pair_duties,
    receives_request_rows,
    routes_for_decode,
    sender_duties,
)
from pdfabric_core.policy.aux_path import AuxPath
from pdfabric_core.policy.coalesce import coalesce_pages
from pdfabric_core.policy.kv_shard import owned_pages

# The duties (what each prefill rank owes each decode rank) live in core, where the operator's
# traffic prediction sums the very same ones; they stay importable from here.
__all__ = [
    "Bases",
    "Block",
    "Duties",
    "KvPages",
    "MemoryMap",
    "TransferPlan",
    "buffer_bases",
    "decode_targets",
    "expected_sources",
    "pair_duties",
    "plan_transfer",
    "receives_request_rows",
    "routes_for_decode",
    "sender_duties",
]


@dataclass(frozen=True)
class Block:
    src: int  # absolute address in the sender's registered memory
    dst: int  # absolute address in the receiver's registered memory
    length: int


@dataclass(frozen=True)
class Bases:
    """The agent's own pools of one rank: one region per kind (pools.py's layout inside each)."""

    kv: int
    state: int
    aux: int


@dataclass(frozen=True)
class MemoryMap:
    """Where every buffer of one rank starts: ``kv`` page 0 of each (layer, K/V) buffer in (layer,
    K/V) order (MLA: one latent per layer), ``state`` slot 0 of each state layer, ``aux`` row 0 of each aux item. Strides are
    the layout's (page bytes, state layer bytes, aux item bytes)."""

    kv: tuple[int, ...]
    state: tuple[int, ...]
    aux: tuple[int, ...]

    @classmethod
    def of_pools(cls, layout: PoolLayout, bases: Bases) -> MemoryMap:
        return cls(
            kv=tuple(
                bases.kv + layout.kv_offset(layer, kv, 0)
                for layer in range(layout.kv_layers)
                for kv in range(layout.kv_buffers)
            ),
            state=tuple(bases.state + layout.state_offset(layer, 0) for layer in range(layout.state_layers)),
            aux=tuple(bases.aux + layout.aux_offset(item, 0) for item in range(len(layout.aux_items))),
        )

    def check(self, layout: PoolLayout) -> None:
        """ValueError unless there is one address per buffer of ``layout`` (no state buffers when
        its state layers hold no bytes)."""
        want = (layout.kv_buffers * layout.kv_layers, layout.state_layers, len(layout.aux_items))
        have = (len(self.kv), len(self.state), len(self.aux))
        if not self.state and not layout.state_bytes:
            want = (want[0], 0, want[2])
        if have != want:
            raise ValueError(
                f"memory map has {have[0]} KV, {have[1]} state and {have[2]} aux buffers; "
                f"the layout has {want[0]} ({layout.kv_buffers} per layer of {layout.kv_layers}), {want[1]} and {want[2]}"
            )


def memory_map(layout: PoolLayout, where: Bases | MemoryMap) -> MemoryMap:
    return where if isinstance(where, MemoryMap) else MemoryMap.of_pools(layout, where)


@dataclass(frozen=True)
class KvPages:
    """One route's KV as page lists, planned once per request: for every (layer, K/V) buffer b and
    every i, ``item`` bytes move from ``src_bases[b] + src_pages[i] * src_stride`` to
    ``dst_bases[b] + dst_pages[i] * dst_stride``. Whole-page routes have item == both strides
    (a buffer's pages are contiguous, see pools.py); head-slice routes move a slice of each page.
    A kernel backend takes this as it is (one launch); an engine gets ``blocks``."""

    src_bases: tuple[int, ...]
    dst_bases: tuple[int, ...]
    item: int
    src_stride: int
    dst_stride: int
    src_pages: Sequence[int]
    dst_pages: Sequence[int]
    whole_page: bool
    src_limit: int = 0  # pages per source buffer (the layout's kv_pages); 0: unknown
    dst_limit: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.src_pages)

    @property
    def units(self) -> int:
        """(buffer, page) pairs: the blocks a per-page engine batch would carry."""
        return len(self.src_bases) * len(self.src_pages)

    @property
    def nbytes(self) -> int:
        return self.units * self.item

    def blocks(self, coalesce: bool = True) -> list[Block]:
        """Engine blocks, in (layer, K/V, run) order; the runs are computed once for all buffers."""
        if not self.src_pages:
            return []
        if self.whole_page:
            runs = _runs(self.src_pages, self.dst_pages, coalesce)
            page = self.item
            return [
                Block(sb + s * page, db + d * page, n * page)
                for sb, db in zip(self.src_bases, self.dst_bases, strict=True)
                for s, d, n in runs
            ]
        ss, ds, n = self.src_stride, self.dst_stride, self.item
        pairs = list(zip(self.src_pages, self.dst_pages, strict=True))
        return [
            Block(sb + s * ss, db + d * ds, n)
            for sb, db in zip(self.src_bases, self.dst_bases, strict=True)
            for s, d in pairs
        ]


@dataclass
class TransferPlan:
    kv: list[Block] = field(default_factory=list)  # empty when planned with kv_blocks=False
    kv_pages: KvPages | None = None
    state: list[Block] = field(default_factory=list)
    aux: list[Block] = field(default_factory=list)  # engine path only
    aux_tcp: list[tuple[int, int, int]] = field(default_factory=list)  # (src address, dst address, len)
    state_skipped_bytes: int = 0
    # Under MLA KV cache sharding: the positions (of the duties' pages) whose pages this plan moves,
    # the ones this prefill rank owns; None: every position of the duties.
    kv_positions: tuple[int, ...] | None = None


def _runs(src: Sequence[int], dst: Sequence[int], coalesce: bool) -> list[tuple[int, int, int]]:
    if coalesce:
        return [(r.src_page, r.dst_page, r.pages) for r in coalesce_pages(src, dst)]
    return [(s, d, 1) for s, d in zip(src, dst, strict=True)]


@functools.lru_cache(maxsize=256)
def buffer_bases(layout: PoolLayout, kv: tuple[int, ...], layers: range, shift: int, head: int) -> tuple[int, ...]:
    """Address of page 0 (at head `head`) of every (layer, K/V) buffer of `layers`, shifted by
    `shift` layers, in (layer, K/V) order; the same for every room between two ranks, so it is
    computed once per pair of memory maps."""
    head_bytes = layout.token_head_bytes if layout.page_order is PageOrder.TOKEN_MAJOR else layout.head_bytes
    n = layout.kv_buffers
    return tuple(kv[n * (layer + shift) + k] + head * head_bytes for layer in layers for k in range(n))


def token_rows(pages: Sequence[int], tokens: int) -> list[int]:
    """A token-major page list as token rows: page p is rows p*tokens .. p*tokens + tokens - 1."""
    return [p * tokens + t for p in pages for t in range(tokens)]


@dataclass(frozen=True)
class TransferSide:
    """One side of a transfer: a rank's layout, where its buffers are, and the room's pages, state
    slots and aux row on it."""

    layout: PoolLayout
    memory: Bases | MemoryMap
    pages: Sequence[int]
    state: Sequence[int]
    aux: int | None


def _plan_state(
    plan: TransferPlan,
    duties: Duties,
    src_layout: PoolLayout,
    dst_layout: PoolLayout,
    src_map: MemoryMap,
    dst_map: MemoryMap,
    src_state: Sequence[int],
    dst_state: Sequence[int],
    coalesce: bool,
) -> None:
    """State blocks: each slice of the duties (policy/state_slices.py) at every state index pair;
    a slice that is the whole item on both sides moves as coalesced runs of items."""
    runs: list[tuple[int, int, int]] | None = None
    for sl in duties.state_slices if src_state else ():
        t = sl.tensor
        si, di = src_layout.state_item(t), dst_layout.state_item(t)
        src0, dst0 = src_map.state[t], dst_map.state[t]
        if sl.whole(si, di):
            runs = _runs(src_state, dst_state, coalesce) if runs is None else runs
            plan.state.extend(Block(src0 + s * si, dst0 + d * di, n * si) for s, d, n in runs)
            continue
        last = sl.rows - 1
        if sl.src_offset + last * sl.src_row + sl.length > si or sl.dst_offset + last * sl.dst_row + sl.length > di:
            raise ValueError(
                f"state tensor {t}: a slice of {sl.length} bytes does not fit items of {si} and {di} bytes"
            )
        plan.state.extend(
            Block(
                src0 + s * si + sl.src_offset + r * sl.src_row,
                dst0 + d * di + sl.dst_offset + r * sl.dst_row,
                sl.length,
            )
            for s, d in zip(src_state, dst_state, strict=True)
            for r in range(sl.rows)
        )
    plan.state_skipped_bytes = len(src_state) * duties.skipped_state_bytes


def plan_transfer(
    duties: Duties,
    src: TransferSide,
    dst: TransferSide,
    *,
    coalesce: bool = True,
    kv_blocks: bool = True,
) -> TransferPlan:
    """Blocks for one (prefill rank, decode rank, room). ``dst_pages`` is the request's full list;
    ``src_pages`` holds the sender's pages for its CP shard, in request order. The KV part is
    always in ``plan.kv_pages``; with ``kv_blocks=False`` its engine blocks are left to the
    caller (``plan.kv_pages.blocks``), who may not need them at all (a kernel backend).

    ``src`` is the sending rank's side (its pages for its CP shard), ``dst`` the receiving rank's.
    Both sides must order their pages alike (a whole page copied between orders would scramble
    it); a head slice of token-major pages is planned as token rows (``token_rows``): one row of
    heads per token, so every consumer of ``KvPages`` (engine blocks, kernels, checksums) takes it
    unchanged."""
    src_layout, dst_layout = src.layout, dst.layout
    src_pages, dst_pages = src.pages, dst.pages
    src_state, dst_state = src.state, dst.state
    src_aux, dst_aux = src.aux, dst.aux
    if src_layout.kv_buffers != dst_layout.kv_buffers:
        raise ValueError(
            f"{src_layout.kv_buffers} KV buffers per layer here, {dst_layout.kv_buffers} at the peer (MHA against MLA, "
            "or K and V apart against fused: SGLang's pages against vLLM's)"
        )
    if src_layout.page_order is not dst_layout.page_order:
        raise ValueError(
            f"page layouts differ: this side's pages are {src_layout.page_order}, the peer's {dst_layout.page_order}"
        )
    if src_layout.aux_items != dst_layout.aux_items or src_layout.state_signature != dst_layout.state_signature:
        (src_kind, src_whole), (dst_kind, dst_whole) = src_layout.state_signature, dst_layout.state_signature
        raise ValueError(
            f"aux rows {list(src_layout.aux_items)} and {src_kind} state of tensors {list(src_whole)} bytes whole "
            f"here, aux rows {list(dst_layout.aux_items)} and {dst_kind} state of {list(dst_whole)} at the peer"
        )
    src_map, dst_map = memory_map(src_layout, src.memory), memory_map(dst_layout, dst.memory)
    src_map.check(src_layout)
    dst_map.check(dst_layout)
    if len(src_pages) != len(duties.pages):
        raise ValueError(
            f"this CP rank sends request pages {duties.pages.start}..{duties.pages.stop - 1} "
            f"({len(duties.pages)} pages) but the request gave {len(src_pages)} source pages"
        )
    # Every CP rank's shard is a range of request positions: a slice (the whole list without CP).
    shard_dst = (
        dst_pages[duties.pages.start : duties.pages.stop]
        if duties.pages.step == 1
        else [dst_pages[i] for i in duties.pages]
    )
    route = duties.route
    plan = TransferPlan()
    if duties.sharded:
        # src.pages are the request's logical pages: this rank moves those it owns, from its local
        # page, to decode's page at the same position (SGLang's filter_kv_indices_for_shard_rank).
        owned = owned_pages(src_pages, duties.kv_shard_rank, duties.kv_shard_size)
        if owned.local and max(owned.local) >= src_layout.kv_pages:
            raise ValueError(
                f"logical page {max(owned.local) * duties.kv_shard_size + duties.kv_shard_rank} is local page "
                f"{max(owned.local)} of shard rank {duties.kv_shard_rank}, past its pool of {src_layout.kv_pages} pages"
            )
        src_pages = owned.local
        shard_dst = [shard_dst[i] for i in owned.positions]
        plan.kv_positions = owned.positions
    shift = duties.dst_layer_offset
    if not 0 <= shift <= shift + src_layout.layers <= dst_layout.layers:
        raise ValueError(
            f"layers {shift}..{shift + src_layout.layers - 1} do not fit the decode pool's {dst_layout.layers} layers"
        )
    layers = range(src_layout.layers)
    # The draft group (EAGLE/MTP) rides the target's route and pages: its layers follow the
    # target's on both sides (SGLang appends them after the target's kv_data_ptrs).
    draft = duties.draft_layers
    if draft and (src_layout.draft_layers != draft or dst_layout.draft_layers != draft):
        raise ValueError(
            f"the route moves {draft} draft KV layers; this side holds {src_layout.draft_layers}, "
            f"the peer {dst_layout.draft_layers} (model.draftLayers, on the last PP stage)"
        )
    draft_src = range(src_layout.layers, src_layout.layers + draft)
    draft_shift = dst_layout.layers - src_layout.layers
    src_stride, dst_stride = src_layout.page_bytes, dst_layout.page_bytes
    src_limit, dst_limit = src_layout.kv_pages, dst_layout.kv_pages
    if route.whole_page:
        if src_layout.page_bytes != dst_layout.page_bytes:
            raise ValueError(f"page size differs: {src_layout.page_bytes} vs {dst_layout.page_bytes} bytes")
        src_head = dst_head = 0
        item = src_layout.page_bytes
    else:
        src_head, dst_head = route.src_head_offset, route.dst_head_offset
        item = route.num_heads * src_layout.head_bytes
        if src_layout.page_order is PageOrder.TOKEN_MAJOR:
            tokens = src_layout.page_tokens
            if dst_layout.page_tokens != tokens:
                raise ValueError(f"pages hold {tokens} tokens here and {dst_layout.page_tokens} at the peer")
            item = route.num_heads * src_layout.token_head_bytes
            src_stride, dst_stride = src_layout.page_bytes // tokens, dst_layout.page_bytes // tokens
            src_limit, dst_limit = src_limit * tokens, dst_limit * tokens
            src_pages, shard_dst = token_rows(src_pages, tokens), token_rows(shard_dst, tokens)
    plan.kv_pages = KvPages(
        src_bases=buffer_bases(src_layout, src_map.kv, layers, 0, src_head)
        + buffer_bases(src_layout, src_map.kv, draft_src, 0, src_head),
        dst_bases=buffer_bases(dst_layout, dst_map.kv, layers, shift, dst_head)
        + buffer_bases(dst_layout, dst_map.kv, draft_src, draft_shift, dst_head),
        item=item,
        src_stride=src_stride,
        dst_stride=dst_stride,
        src_pages=src_pages,
        dst_pages=shard_dst,
        whole_page=route.whole_page,
        src_limit=src_limit,
        dst_limit=dst_limit,
    )
    if kv_blocks:
        plan.kv = plan.kv_pages.blocks(coalesce)
    if len(src_state) != len(dst_state):
        raise ValueError(f"{len(src_state)} source state slots but {len(dst_state)} destination slots")
    _plan_state(plan, duties, src_layout, dst_layout, src_map, dst_map, src_state, dst_state, coalesce)
    if duties.send_aux and src_aux is not None and dst_aux is not None:
        for item, size in enumerate(src_layout.aux_items):
            sa, da = src_map.aux[item] + src_aux * size, dst_map.aux[item] + dst_aux * size
            if duties.aux_path is AuxPath.TCP:
                plan.aux_tcp.append((sa, da, size))
            else:
                plan.aux.append(Block(sa, da, size))
    return plan
