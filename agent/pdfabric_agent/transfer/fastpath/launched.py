"""A fast-path kernel batch on its way (``Launched``, the kernel path's handle) and the byte spans
a page list can touch, which the backend checks against the registered pools before a launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdfabric_agent.memory.plan import KvPages
from pdfabric_agent.transfer.fastpath.channel import Transfer
from pdfabric_agent.transfer.fastpath.table import PageIndices


@dataclass
class Launched:
    """A kernel batch on its way; ``FastPathBackend.wait`` confirms it."""

    transfer: Transfer
    t0: float
    t1: float
    what: str
    nbytes: int
    t_planned: float = 0.0  # when the table was ready (the rest of t0..t1 is reserve + upload + launch)
    before: Launched | None = None  # an earlier launch of the same request on the same stream


def page_spans(kvp: KvPages) -> tuple[int, int] | None:
    """Bytes one buffer of a KvPages can touch from its base on each side: all its pages when the
    page counts are known (the launch tables then refuse any page past them), else page 0 up to
    the highest page of its lists; None when a page index is negative."""
    if kvp.src_limit > 0 and kvp.dst_limit > 0:
        return (kvp.src_limit - 1) * kvp.src_stride + kvp.item, (kvp.dst_limit - 1) * kvp.dst_stride + kvp.item
    s_lo, s_hi = _bounds(kvp.src_pages)
    d_lo, d_hi = _bounds(kvp.dst_pages)
    if min(s_lo, d_lo) < 0:
        return None
    return s_hi * kvp.src_stride + kvp.item, d_hi * kvp.dst_stride + kvp.item


def _bounds(pages: PageIndices) -> tuple[int, int]:
    if isinstance(pages, torch.Tensor):
        lo, hi = torch.aminmax(pages)
        return int(lo), int(hi)
    return min(pages), max(pages)  # a list: two C loops, no conversion


def as_launched(handle: object) -> Launched:
    """The kernel path's opaque handle as what ``submit_*`` returned."""
    if not isinstance(handle, Launched):
        raise TypeError(f"not a fast-path launch handle: {type(handle).__name__}")
    return handle
