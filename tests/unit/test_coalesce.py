"""Page coalescing: runs consecutive on both sides become one block."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.coalesce import PageRun, coalesce_pages


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([], [], []),
        ([5], [9], [PageRun(5, 9, 1)]),
        ([0, 1, 2, 3], [10, 11, 12, 13], [PageRun(0, 10, 4)]),
        ([0, 1, 2, 3], [10, 11, 20, 21], [PageRun(0, 10, 2), PageRun(2, 20, 2)]),
        ([0, 1, 5, 6], [10, 11, 12, 13], [PageRun(0, 10, 2), PageRun(5, 12, 2)]),
        ([3, 2, 1], [3, 2, 1], [PageRun(3, 3, 1), PageRun(2, 2, 1), PageRun(1, 1, 1)]),
        ([0, 1, 2, 3, 4, 5], [7, 8, 9, 0, 1, 2], [PageRun(0, 7, 3), PageRun(3, 0, 3)]),
    ],
    ids=["empty", "single", "one-run", "dst-breaks", "src-breaks", "descending-never-merges", "two-runs"],
)
def test_coalesce_pages(src: list[int], dst: list[int], expected: list[PageRun]) -> None:
    assert coalesce_pages(src, dst) == expected


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 source pages but 2"):
        coalesce_pages([1, 2, 3], [1, 2])
