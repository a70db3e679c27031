"""SGLang's logical-page KV cache sharding rule (core/pdfabric_core/policy/kv_shard.py), checked
against SGLang's own sender filter and pool placement, and over the bytes a sharded prefill holds."""

from __future__ import annotations

import numpy as np
import pytest

from pdfabric_core.policy.kv_shard import (
    cyclic_pages_per_source,
    kv_shard_size,
    local_page,
    owned_pages,
    pages_per_source,
    shard_owner,
    sharded_sources,
)


@pytest.mark.parametrize(
    ("enabled", "mla", "tp", "cp", "size"),
    [
        (False, True, 4, 1, 1),
        (True, True, 4, 1, 4),  # MLA: the attention TP group
        (True, False, 4, 1, 1),  # GQA without CP: no replicated axis
        (True, True, 1, 1, 1),
        (True, True, 2, 4, 4),  # CP first, any kind
        (True, False, 2, 4, 4),
    ],
)
def test_the_shard_group_is_sglangs(enabled: bool, mla: bool, tp: int, cp: int, size: int) -> None:
    assert kv_shard_size(enabled=enabled, mla=mla, attn_tp=tp, attn_cp=cp) == size


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("start", [0, 5])
def test_owned_pages_equal_sglangs_sender_filter(size: int, start: int) -> None:
    """Each rank's local pages and send positions equal SGLang's ``filter_kv_indices_for_shard_rank``
    for a chunk at request position ``start``."""
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_shard_rank

    rng = np.random.default_rng(size * 10 + start)
    pages = rng.choice(200, size=23, replace=False).astype(np.int64)
    for rank in range(size):
        want_local, want_pos = filter_kv_indices_for_shard_rank(
            kv_indices=pages, index_slice=slice(start, start + len(pages)), shard_rank=rank, shard_size=size
        )
        got = owned_pages(pages.tolist(), rank, size, first_position=start)
        assert list(got.local) == want_local.tolist()
        assert list(got.positions) == want_pos.tolist()


def test_local_pages_are_where_sglangs_pool_puts_them() -> None:
    """``PageInterleavePlacement``: token slot ``loc`` of logical page ``loc // ps`` is on rank
    ``owner_of(loc)`` at local row ``local_index(loc)``, i.e. local page ``l // N``."""
    import torch
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    ps, n = 4, 3
    placement = PageInterleavePlacement(
        PageShardSpec(shard_rank=0, shard_size=n, page_size=ps, max_prefix_tokens=0, chunk_tokens=ps)
    )
    loc = torch.arange(0, 40 * ps)
    pages = (loc // ps).tolist()
    assert placement.owner_of(loc).tolist() == [shard_owner(p, n) for p in pages]
    assert (placement.local_index(loc) // ps).tolist() == [local_page(p, n) for p in pages]


def test_positions_partition_the_request() -> None:
    pages = [7, 2, 9, 4, 0, 13, 6, 11]
    size = 2
    shards = [owned_pages(pages, r, size) for r in range(size)]
    positions = sorted(p for s in shards for p in s.positions)
    assert positions == list(range(len(pages)))
    assert pages_per_source(pages, size) == [len(s.positions) for s in shards] == [4, 4]
    assert sum(pages_per_source(pages, 3)) == len(pages)


def _move(
    prefill_pools: list[np.ndarray], pages: list[int], dst_pages: list[int], size: int, rank_of: int = 0
) -> np.ndarray:
    """A decode pool filled by every shard rank from its own pool by the rule: page by page."""
    decode = np.zeros((max(dst_pages) + 1, prefill_pools[0].shape[1]), dtype=prefill_pools[0].dtype)
    for rank in range(size):
        owned = owned_pages(pages, (rank + rank_of) % size, size)
        for local, pos in zip(owned.local, owned.positions, strict=True):
            decode[dst_pages[pos]] = prefill_pools[rank][local]
    return decode


def test_a_sharded_prefill_fills_decode_byte_exact_and_a_wrong_owner_does_not() -> None:
    """Latent pages striped over TP2 as SGLang stores them, moved by the rule into decode's own
    page ids: every page lands whole at its position; a rank reading by another's ownership fails."""
    size, width, logical_pages = 2, 24, 16
    rng = np.random.default_rng(3)
    latent = rng.standard_normal((logical_pages, width)).astype(np.float32)  # what an unsharded pool holds
    pools = [np.zeros((logical_pages // size, width), np.float32) for _ in range(size)]
    for page in range(logical_pages):
        pools[shard_owner(page, size)][local_page(page, size)] = latent[page]
    request = [5, 2, 11, 8, 3, 14]
    dst = [9, 1, 4, 0, 7, 2]
    decode = _move(pools, request, dst, size)
    for pos, page in enumerate(request):
        assert np.array_equal(decode[dst[pos]], latent[page])
    wrong = _move(pools, request, dst, size, rank_of=1)
    assert not all(np.array_equal(wrong[dst[pos]], latent[page]) for pos, page in enumerate(request))


def test_every_decode_rank_takes_every_prefill_rank_and_sglangs_limits_hold() -> None:
    assert sharded_sources(1, prefill_tp=4, decode_tp=4, prefill_cp=1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="equal prefill/decode attention TP"):
        sharded_sources(0, prefill_tp=2, decode_tp=1, prefill_cp=1)
    with pytest.raises(ValueError, match="over the CP group"):
        sharded_sources(0, prefill_tp=2, decode_tp=2, prefill_cp=2)
    with pytest.raises(ValueError, match="outside"):
        owned_pages([1, 2], 2, 2)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_cyclic_chain_splits_as_sglangs_allocator_draws_it(size: int) -> None:
    """The per-source page counts of a cyclic chain equal SGLang's own closed form for the pages
    its allocator draws from each class, and the owners of such a chain's page ids agree."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    for first in range(size):
        for pages in range(0, 3 * size + 2):
            counts = cyclic_pages_per_source(pages, size, first)
            assert counts == PageInterleavePoolAllocator._class_counts(first, pages, size)
            chain = [(first + i) % size + size * (7 + i) for i in range(pages)]  # owners cycle from `first`
            assert pages_per_source(chain, size) == counts
            assert sum(counts) == pages and max(counts) - min(counts) <= 1
