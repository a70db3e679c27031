"""A room's blocks as arrays (``memory/block_arrays.py``) are the Block path's blocks, in the same
order, and the writer's array batches are its Block batches: the same chunks, the same counts per
kind. Held for page lists of any shape, coalesced or not, whole pages and head slices."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfabric_agent.memory.block_arrays import BlockArrays, kv_arrays, page_runs
from pdfabric_agent.memory.plan import Block, KvPages, TransferPlan
from pdfabric_agent.rooms.writer import array_batches, block_batches
from pdfabric_core.policy.coalesce import coalesce_pages

BASES = (0x1000_0000, 0x1100_0000, 0x1200_0000, 0x1300_0000)

# Page lists with runs in them (what coalescing merges) as well as scattered pages.
runs = st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.integers(1, 4)), max_size=40)


def pages_of(drawn: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    src = [s + i for s, _, n in drawn for i in range(n)]
    dst = [d + i for _, d, n in drawn for i in range(n)]
    return src, dst


def kv_pages(src: list[int], dst: list[int], whole_page: bool, buffers: int) -> KvPages:
    page = 4096
    return KvPages(
        src_bases=BASES[:buffers],
        dst_bases=tuple(b + 0x100_0000 for b in BASES[:buffers]),
        item=page if whole_page else 512,
        src_stride=page,
        dst_stride=2 * page,
        src_pages=src,
        dst_pages=dst,
        whole_page=whole_page,
    )


@settings(max_examples=200, deadline=None)
@given(runs, st.booleans(), st.booleans(), st.integers(1, 4))
def test_kv_arrays_are_the_blocks_of_the_page_lists(
    drawn: list[tuple[int, int, int]], whole_page: bool, coalesce: bool, buffers: int
) -> None:
    src, dst = pages_of(drawn)
    kvp = kv_pages(src, dst, whole_page, buffers)
    arrays = kv_arrays(kvp, coalesce)
    assert arrays.blocks() == kvp.blocks(coalesce)
    assert arrays.nbytes == (kvp.nbytes if src else 0)


@given(runs)
def test_page_runs_are_coalesce_pages(drawn: list[tuple[int, int, int]]) -> None:
    src, dst = pages_of(drawn)
    s, d, n = page_runs(src, dst, coalesce=True)
    assert list(zip(s.tolist(), d.tolist(), n.tolist(), strict=True)) == [
        (r.src_page, r.dst_page, r.pages) for r in coalesce_pages(src, dst)
    ]


def test_page_lists_of_unequal_length_are_refused() -> None:
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        page_runs([1, 2, 3], [1, 2], coalesce=True)
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        kv_arrays(kv_pages([1, 2, 3], [1, 2], whole_page=False, buffers=1))


def test_block_arrays_round_trip_part_pick_and_join() -> None:
    blocks = [Block(10 * i, 1000 + 10 * i, i + 1) for i in range(7)]
    arrays = BlockArrays.of(blocks)
    assert arrays.blocks() == blocks and len(arrays) == 7 and arrays.nbytes == 28
    assert arrays.part(2, 5).blocks() == blocks[2:5]
    assert arrays.pick(np.asarray([6, 0])).blocks() == [blocks[6], blocks[0]]
    assert BlockArrays.joined([arrays.part(0, 3), arrays.part(3, 7)]).blocks() == blocks
    assert BlockArrays.of([]).blocks() == []


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(0, 5), st.integers(0, 3), st.integers(1, 17))
def test_array_batches_are_the_block_batches(kv: int, state: int, aux: int, limit: int) -> None:
    plan = TransferPlan(
        state=[Block(0x2000 + 64 * i, 0x9000 + 64 * i, 64) for i in range(state)],
        aux=[Block(0x3000 + 8 * i, 0xA000 + 8 * i, 8 + i) for i in range(aux)],
    )
    kv_blocks = [Block(0x1000 + 4096 * i, 0x8000 + 4096 * i, 4096 * (1 + i % 3)) for i in range(kv)]
    want = block_batches(kv_blocks, plan, limit)
    for got in (array_batches(kv_blocks, plan, limit), array_batches(BlockArrays.of(kv_blocks), plan, limit)):
        assert [b.kinds for b in got] == [b.kinds for b in want]
        assert all(isinstance(b.blocks, BlockArrays) for b in got)
        assert [b.blocks.blocks() for b in got if isinstance(b.blocks, BlockArrays)] == [list(b.blocks) for b in want]
    assert sum(len(b) for b in want) == kv + state + aux
    assert all(len(b) <= limit for b in want)
