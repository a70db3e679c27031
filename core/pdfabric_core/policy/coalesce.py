"""Page coalescing (sglang group_concurrent_contiguous).

Runs where source *and* destination page indices both advance by one become one block:
(src + i0 * item_len, dst + j0 * item_len, item_len * n).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageRun:
    src_page: int
    dst_page: int
    pages: int


def coalesce_pages(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs:
            last = runs[-1]
            if src == last.src_page + last.pages and dst == last.dst_page + last.pages:
                runs[-1] = PageRun(last.src_page, last.dst_page, last.pages + 1)
                continue
        runs.append(PageRun(src, dst, 1))
    return runs
