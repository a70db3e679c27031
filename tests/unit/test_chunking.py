"""Batch chunking under the engine's limit (4096 tcp entries poison a Mooncake session)."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.chunking import DEFAULT_MAX_BATCH_ENTRIES, chunk_batch


@pytest.mark.parametrize(
    ("n", "limit", "sizes"),
    [
        (0, 1024, []),
        (1, 1024, [1]),
        (1024, 1024, [1024]),
        (1025, 1024, [1024, 1]),
        (4096, 1024, [1024, 1024, 1024, 1024]),
        (5, 2, [2, 2, 1]),
    ],
    ids=["empty", "one", "exactly-limit", "limit-plus-one", "the-4096-batch", "small-limit"],
)
def test_chunk_sizes(n: int, limit: int, sizes: list[int]) -> None:
    chunks = list(chunk_batch(list(range(n)), limit))
    assert [len(c) for c in chunks] == sizes
    assert [x for c in chunks for x in c] == list(range(n))  # order kept, nothing lost


def test_default_is_the_size_seen_to_pass() -> None:
    assert DEFAULT_MAX_BATCH_ENTRIES == 1024


@pytest.mark.parametrize("limit", [0, -1], ids=["zero", "negative"])
def test_limit_below_one_is_an_error(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        list(chunk_batch([1], limit))
