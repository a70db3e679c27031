"""Batch chunking under the engine's limit.

Seen on Mooncake tcp: one batch of 4096 entries fails (rc -1) and poisons the session, so every
later transfer to that peer fails; 1024 passes. Upstream added
SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES after "batch timeout -> session failed" reports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

DEFAULT_MAX_BATCH_ENTRIES = 1024

T = TypeVar("T")


def chunk_batch(entries: Sequence[T], max_entries: int = DEFAULT_MAX_BATCH_ENTRIES) -> Iterator[Sequence[T]]:
    if max_entries < 1:
        raise ValueError(f"max batch entries must be at least 1, got {max_entries}")
    for start in range(0, len(entries), max_entries):
        yield entries[start : start + max_entries]
