"""The launch table the gather/scatter kernel reads, and the plan that carries it (pure: no GPU).

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

This module holds the format's constants, the request and plan types (`BufferPair`, `CopyGroup`,
`LaunchPlan`) and `reference_copies`, the table decoded exactly as the kernel does. The planners
that write tables are `layout` (fixed buffers of a connection, page lists per request) and `plan`
(absolute blocks; a route's KV page lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

GROUP_FIELDS = 8
DEFAULT_CHUNK_BYTES = 4096  # 32 lanes x 16 B x 8 loads in flight per lane
VEC_BYTES = 16
MAX_TABLE_BYTES = 64 << 20  # beyond this a request is split into more launches
# Tables up to this many int64 words travel inside the kernel's parameters (no copy, no extra
# launch): this is what keeps an aux-sized request near launch latency.
SMALL_TABLE_WORDS = 256

# Page indices as callers hand them over: a plain list (aux-sized requests, built without torch)
# or a one-dimensional int64 tensor.
PageIndices: TypeAlias = torch.Tensor | Sequence[int]


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
    src_pages: PageIndices
    dst_pages: PageIndices


@dataclass
class LaunchPlan:
    table: torch.Tensor | list[int]  # int64 words; a plain list when small (built without torch)
    ngroups: int
    total_units: int
    total_bytes: int
    chunk_bytes: int
    # The destination pages per receiver pool, for the receiver ledger: a set, or a tensor of them.
    dst_pages_by_pool: Mapping[str, set[int] | torch.Tensor] = field(default_factory=dict)

    @property
    def small(self) -> bool:
        return isinstance(self.table, list) and len(self.table) <= SMALL_TABLE_WORDS

    def words(self) -> list[int]:
        return self.table if isinstance(self.table, list) else self.table.tolist()


def as_index(x: PageIndices) -> torch.Tensor:
    """Page indices as a one-dimensional int64 CPU tensor; PlanError for any other shape."""
    t = x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.int64)
    if t.dim() != 1:
        raise PlanError(f"page indices must be one-dimensional, got shape {tuple(t.shape)}")
    return t.to(dtype=torch.int64, device="cpu")


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
