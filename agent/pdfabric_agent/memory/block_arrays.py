"""A room's blocks as three arrays (source, destination, length) instead of one object a block.

A route of 4 KiB pages is tens of thousands of blocks a room; built, chunked, grouped and turned
into NIXL piece indices one Python object at a time, they cost the prefill agent about a fifth of
its time (issue 43's paired benchmark: 0.67-0.77 of raw NIXL at 4 KiB). The arrays make the same
blocks, in the same order, with numpy: ``kv_arrays`` is ``KvPages.blocks`` (coalescing included),
which the unit tests hold them to. A backend that declares ``block_arrays`` takes them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pdfabric_agent.memory.plan import Block, KvPages

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True)
class BlockArrays:
    """Block i moves ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (absolute addresses)."""

    src: Int64s
    dst: Int64s
    length: Int64s

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def of(cls, blocks: Sequence[Block]) -> BlockArrays:
        table = np.array([(b.src, b.dst, b.length) for b in blocks], dtype=np.int64).reshape(-1, 3)
        return cls(table[:, 0], table[:, 1], table[:, 2])

    @classmethod
    def joined(cls, parts: Sequence[BlockArrays]) -> BlockArrays:
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("src", "dst", "length")))

    def part(self, start: int, stop: int) -> BlockArrays:
        return BlockArrays(self.src[start:stop], self.dst[start:stop], self.length[start:stop])

    def pick(self, rows: npt.NDArray[np.intp]) -> BlockArrays:
        return BlockArrays(self.src[rows], self.dst[rows], self.length[rows])

    def blocks(self) -> list[Block]:
        return [
            Block(s, d, n) for s, d, n in zip(self.src.tolist(), self.dst.tolist(), self.length.tolist(), strict=True)
        ]


def page_runs(src: Sequence[int], dst: Sequence[int], coalesce: bool) -> tuple[Int64s, Int64s, Int64s]:
    """(first source page, first destination page, pages) of each run: pages where both indices
    advance by one are one run when coalescing (``coalesce_pages``), else every page its own."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if len(s) != len(d):
        raise ValueError(f"{len(s)} source pages but {len(d)} destination pages")
    if not coalesce or len(s) < 2:
        return s, d, np.ones(len(s), dtype=np.int64)
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    pages = np.diff(np.concatenate((starts, [len(s)])))
    return s[starts], d[starts], pages


def kv_arrays(kvp: KvPages, coalesce: bool = True) -> BlockArrays:
    """``kvp.blocks(coalesce)`` as arrays: in (layer, K/V, run) order."""
    empty = np.zeros(0, dtype=np.int64)
    if not kvp.num_pages:
        return BlockArrays(empty, empty, empty)
    src_bases = np.asarray(kvp.src_bases, dtype=np.int64)[:, None]
    dst_bases = np.asarray(kvp.dst_bases, dtype=np.int64)[:, None]
    if kvp.whole_page:
        s, d, n = page_runs(kvp.src_pages, kvp.dst_pages, coalesce)
        page = kvp.item
        src, dst, length = src_bases + s * page, dst_bases + d * page, n * page
    else:
        s = np.asarray(kvp.src_pages, dtype=np.int64)
        d = np.asarray(kvp.dst_pages, dtype=np.int64)
        if len(s) != len(d):
            raise ValueError(f"{len(s)} source pages but {len(d)} destination pages")
        src, dst = src_bases + s * kvp.src_stride, dst_bases + d * kvp.dst_stride
        length = np.full(len(s), kvp.item, dtype=np.int64)
    rows = len(kvp.src_bases)
    flat: Any = np.broadcast_to(length, (rows, len(length)))
    return BlockArrays(src.ravel(), dst.ravel(), np.ascontiguousarray(flat).ravel())
