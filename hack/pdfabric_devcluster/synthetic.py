"""Synthetic serving engine: writes known KV/state/aux contents into prefill pools and checks
them byte for byte in decode pools, independent of how the agent routed them.

Content is a function of *logical* coordinates only: (room, layer, K/V, request page position,
global KV head) for KV (an MLA latent is buffer 0, head 0: the same on every prefill TP rank); (room, state layer, request state position) for state; (room, aux item)
for aux. So a decode rank can verify its pages whatever TP/CP split produced them, and a head
landing in the wrong slot, page or layer is caught. Each chunk counts up from a seed, so a shifted
or partial copy inside a chunk is caught too.

``expected_bytes`` is the engine's own count of what must move, derived from the geometry alone
(not from the agent's planner), for checking the agent's byte counters.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pdfabric_agent.client.api import MappedPools
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_core.policy.rank_mapping import global_heads
from pdfabric_core.policy.state_slices import state_share
from pdfabric_core.spec import PDClusterSpec


def pattern(length: int, *key: object) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "little")
    words = (length + 7) // 8
    return array("Q", range(seed, seed + words)).tobytes()[:length]


def kv_chunk(room: int, layer: int, kv: int, pos: int, head: int, head_bytes: int) -> bytes:
    return pattern(head_bytes, "kv", room, layer, kv, pos, head)


def state_chunk(room: int, layer: int, pos: int, layer_bytes: int) -> bytes:
    return pattern(layer_bytes, "state", room, layer, pos)


def aux_chunk(room: int, item: int, size: int) -> bytes:
    return pattern(size, "aux", room, item)


@dataclass(frozen=True)
class ExpectedBytes:
    kv: int
    state: int
    aux: int
    state_skipped: int


def expected_bytes(spec: PDClusterSpec, *, pages: int, state_slots: int, aux: bool) -> ExpectedBytes:
    """Bytes one room must move to one decode replica: each decode rank receives every page's
    local heads (MLA: the whole latent) once, one copy of the state and of the aux row."""
    geo = spec.model
    dtp = spec.decode.tp
    kv = pages * (geo.layers + geo.draft_layers) * geo.kv_buffers * dtp * geo.kv_page_bytes(dtp)
    state = dtp * state_slots * sum(geo.state_item_bytes(dtp))  # the legacy state: replicated, whole
    p = spec.prefill
    dedup_applies = p.cp > 1 and p.all_cp_ranks_transfer and not p.dsa_cache_layer_split
    return ExpectedBytes(
        kv=kv,
        state=state,
        aux=dtp * sum(geo.aux_row_bytes) if aux else 0,
        state_skipped=(p.cp - 1) * state if dedup_applies else 0,
    )


def _global_layer(spec: PDClusterSpec, lay: PoolLayout, layer: int, first_layer: int) -> int:
    """A pool layer's number in the model: the stage's target layers from ``first_layer``, then
    the draft's (after the model's ``layers``, as SGLang's layer ids band them)."""
    return first_layer + layer if layer < lay.layers else spec.model.layers + layer - lay.layers


def _state_share(spec: PDClusterSpec, tensor: int, pos: int, room: int, tp: int, rank: int) -> bytes:
    """This rank's share of state tensor ``tensor``'s whole item at state position ``pos`` (its kind's rule)."""
    m = spec.model
    whole = state_chunk(room, tensor, pos, m.state_tensors[tensor])
    return state_share(m.state_kind, whole, sharded=m.state_sharded[tensor], blocks=m.state_blocks(tensor), tp=tp,
                       rank=rank, kv_heads=m.tp_kv_heads, page_tokens=m.page_size_tokens)  # fmt: skip


def fill_prefill(
    pools: MappedPools,
    spec: PDClusterSpec,
    *,
    tp_rank: int,
    room: int,
    positions: Sequence[int],
    pages: Sequence[int],
    state_slots: Sequence[int] = (),
    aux_index: int | None = None,
    first_layer: int = 0,
) -> int:
    """Write room's contents for the request pages at ``positions`` into local ``pages``; returns
    bytes written. ``first_layer`` is the global number of the pool's layer 0 (PP stages)."""
    lay = pools.layout
    heads = list(global_heads(tp_rank, spec.prefill.tp, spec.model.tp_kv_heads))
    written = 0
    for layer in range(lay.kv_layers):
        for kv in range(lay.kv_buffers):
            for pos, page in zip(positions, pages, strict=True):
                for local, head in enumerate(heads):
                    off = lay.kv_offset(layer, kv, page, local)
                    chunk = kv_chunk(room, _global_layer(spec, lay, layer, first_layer), kv, pos, head, lay.head_bytes)
                    pools.kv[off : off + lay.head_bytes] = chunk
                    written += lay.head_bytes
    for layer in range(lay.state_layers):
        for pos, slot in enumerate(state_slots):
            off = lay.state_offset(layer, slot)
            mine = _state_share(spec, layer, pos, room, spec.prefill.tp, tp_rank)
            pools.state[off : off + len(mine)] = mine
            written += len(mine)
    if aux_index is not None:
        for item, size in enumerate(lay.aux_items):
            off = lay.aux_offset(item, aux_index)
            pools.aux[off : off + size] = aux_chunk(room, item, size)
            written += size
    return written


def verify_decode(
    pools: MappedPools,
    spec: PDClusterSpec,
    *,
    tp_rank: int,
    room: int,
    pages: Sequence[int],
    state_slots: Sequence[int] = (),
    aux_index: int | None = None,
    first_layer: int = 0,
) -> list[str]:
    """Every mismatch, as "what where"; empty when all bytes are exact."""
    lay = pools.layout
    heads = list(global_heads(tp_rank, spec.decode.tp, spec.model.tp_kv_heads))
    errors: list[str] = []
    for layer in range(lay.kv_layers):
        for kv in range(lay.kv_buffers):
            for pos, page in enumerate(pages):
                for local, head in enumerate(heads):
                    off = lay.kv_offset(layer, kv, page, local)
                    want = kv_chunk(room, _global_layer(spec, lay, layer, first_layer), kv, pos, head, lay.head_bytes)
                    if pools.kv[off : off + lay.head_bytes] != want:
                        errors.append(
                            f"kv layer {_global_layer(spec, lay, layer, first_layer)} buffer {kv} request page {pos} (slot {page}) head {head}"
                        )
    for layer in range(lay.state_layers):
        for pos, slot in enumerate(state_slots):
            off = lay.state_offset(layer, slot)
            want = _state_share(spec, layer, pos, room, spec.decode.tp, tp_rank)
            if pools.state[off : off + len(want)] != want:
                errors.append(f"state layer {layer} position {pos} (slot {slot})")
    if aux_index is not None:
        for item, size in enumerate(lay.aux_items):
            off = lay.aux_offset(item, aux_index)
            if pools.aux[off : off + size] != aux_chunk(room, item, size):
                errors.append(f"aux item {item} (row {aux_index})")
    return errors
