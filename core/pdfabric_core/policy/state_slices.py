"""What one prefill rank moves of each state tensor to one decode rank, per state index: one rule
per state kind (``StateKind``), pure.

- slot (Mamba/GDN: one slot per request, several tensors per layer of different sizes): a tensor
  attention TP shards (SGLang's ``state_dim_per_tensor`` above 0; its slice axis outermost, so a
  rank's shard is one contiguous byte range of the item) moves as the overlap of the prefill
  rank's share with the decode rank's, at its offset in each (SGLang's Mooncake backend,
  ``compute_mamba_state_slice_blocks``: aggregation writes each prefill shard at its place in the
  decode item, scatter reads each decode shard out of the prefill item); a replicated tensor moves
  whole from the decode rank's primary source only.
- page (an SWA hybrid's window pages, SGLang's ``swa`` state): like KV pages, token-major, heads
  sharded over attention TP: the route's head slice of every token row, or the whole page when the
  route moves whole pages (SGLang's ``_send_swa_state_slice``).
- row (one row per request, whole on every rank: SGLang's ``request_row``): whole, from the primary
  source only.

CP: prefill CP all-gathers before it writes any state pool, so every CP rank holds the whole
state of every kind and CP rank 0 sends it (``cp_dedup``), as SGLang's
``_get_dsa_cache_transfer_skip_flags``; under the DSA cache layer split each CP rank sends the
tensors it owns (``state_layer_shard``). The caller passes that shard as ``tensors_owned``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdfabric_core.policy.rank_mapping import KvRoute
from pdfabric_core.policy.types import StateKind

__all__ = ["StateSlice", "page_state_slices", "shard_range", "slot_state_slices", "state_share", "state_slices"]


@dataclass(frozen=True)
class StateSlice:
    """Bytes of state tensor ``tensor`` one pair moves per state index: ``rows`` pieces of
    ``length`` bytes, piece r from ``src_offset + r * src_row`` of the source item to
    ``dst_offset + r * dst_row`` of the destination item."""

    tensor: int
    src_offset: int
    dst_offset: int
    length: int
    rows: int = 1
    src_row: int = 0
    dst_row: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.length

    def whole(self, src_item: int, dst_item: int) -> bool:
        """True when the slice is the whole item on both sides (whole items coalesce into runs)."""
        return self.rows == 1 and self.src_offset == self.dst_offset == 0 and self.length == src_item == dst_item


def shard_range(whole: int, tp: int, rank: int) -> range:
    """Bytes of a TP-sharded item rank ``rank`` of ``tp`` holds (equal shares; the spec checks ``tp``
    divides ``whole``)."""
    share = whole // tp
    return range(rank * share, (rank + 1) * share)


def slot_state_slices(
    tensors: Sequence[int],
    sharded: Sequence[bool],
    tensors_owned: range,
    prefill_tp: int,
    decode_tp: int,
    prefill_tp_rank: int,
    decode_tp_rank: int,
    *,
    primary: bool,
    blocks: Sequence[Sequence[int]] = (),
) -> tuple[StateSlice, ...]:
    """Slot (and row) state: each owned tensor's shard overlap, or the whole replicated item from the
    primary source. A tensor whose sub-blocks TP shards apart (``blocks[i]``: their whole bytes; GDN's
    conv state, q | k | v) holds its share of each block in turn: each block's overlap moves to its
    place (SGLang's ``compute_mamba_state_slice_blocks`` with ``conv_shard_groups``)."""
    out = []
    for i in tensors_owned:
        whole = tensors[i]
        if not sharded[i]:
            if primary:
                out.append(StateSlice(i, 0, 0, whole))
            continue
        src_base = dst_base = 0
        for block in blocks[i] if i < len(blocks) and blocks[i] else (whole,):
            src, dst = shard_range(block, prefill_tp, prefill_tp_rank), shard_range(block, decode_tp, decode_tp_rank)
            lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
            if lo < hi:
                out.append(StateSlice(i, src_base + lo - src.start, dst_base + lo - dst.start, hi - lo))
            src_base, dst_base = src_base + len(src), dst_base + len(dst)
    return tuple(out)


def page_state_slices(
    tensors: Sequence[int], tensors_owned: range, route: KvRoute, kv_heads: int, page_tokens: int
) -> tuple[StateSlice, ...]:
    """Page state over one KV route: ``tensors`` are whole pages (all ``kv_heads``) of
    ``page_tokens`` token rows; the route's head slice of every row, or the whole page."""
    out = []
    for i in tensors_owned:
        head = tensors[i] // (kv_heads * page_tokens)  # one head of one token
        src_row, dst_row = route.src_local_heads * head, route.dst_local_heads * head
        if route.whole_page:
            out.append(StateSlice(i, 0, 0, page_tokens * src_row))
        else:
            out.append(
                StateSlice(
                    i,
                    route.src_head_offset * head,
                    route.dst_head_offset * head,
                    route.num_heads * head,
                    rows=page_tokens,
                    src_row=src_row,
                    dst_row=dst_row,
                )
            )
    return tuple(out)


def state_slices(
    kind: StateKind,
    tensors: Sequence[int],
    sharded: Sequence[bool],
    tensors_owned: range,
    route: KvRoute,
    *,
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    page_tokens: int,
    primary: bool,
    blocks: Sequence[Sequence[int]] = (),
) -> tuple[StateSlice, ...]:
    """The slices of one (prefill rank, decode rank) route, by the state kind's own rule."""
    if kind is StateKind.PAGE:
        return page_state_slices(tensors, tensors_owned, route, kv_heads, page_tokens)
    if kind is StateKind.ROW:
        sharded = [False] * len(tensors)
    return slot_state_slices(
        tensors,
        sharded,
        tensors_owned,
        prefill_tp,
        decode_tp,
        route.prefill_tp_rank,
        route.decode_tp_rank,
        primary=primary,
        blocks=blocks,
    )


def state_share(
    kind: StateKind,
    whole: bytes,
    *,
    sharded: bool,
    blocks: Sequence[int],
    tp: int,
    rank: int,
    kv_heads: int,
    page_tokens: int,
) -> bytes:
    """What TP rank ``rank`` of ``tp`` holds of a whole state item, by the rules above: the item
    (replicated, rows), its share of each sub-block in turn (slot), or its KV heads of every token
    row (page). Test content and synthetic traffic are written and checked with it."""
    if not sharded or kind is StateKind.ROW:
        return whole
    if kind is StateKind.PAGE:
        row = len(whole) // page_tokens
        head = row // kv_heads
        first = rank * kv_heads // tp if tp <= kv_heads else rank // (tp // kv_heads)
        count = max(kv_heads // tp, 1)
        return b"".join(whole[t * row + first * head : t * row + (first + count) * head] for t in range(page_tokens))
    out, at = [], 0
    for block in blocks or (len(whole),):
        share = block // tp
        out.append(whole[at + rank * share : at + (rank + 1) * share])
        at += block
    return b"".join(out)
