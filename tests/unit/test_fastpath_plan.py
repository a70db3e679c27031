"""Planning of fast-path launches, checked by replaying the table exactly as the kernel decodes it
over byte arrays that stand in for the two GPUs' pools."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdfabric_agent.transfer.fastpath.layout import plan_launch
from pdfabric_agent.transfer.fastpath.table import SMALL_TABLE_WORDS, BufferPair, CopyGroup, PlanError, reference_copies

SRC_BASE = 1 << 40
DST_BASE = 1 << 41


class Memory:
    """Two flat address ranges (source GPU, destination GPU) addressed like device pointers."""

    def __init__(self, nbytes: int, rng: random.Random) -> None:
        self.src = bytearray(rng.randbytes(nbytes))
        self.dst = bytearray(b"\xa5" * nbytes)  # poison: untouched bytes must keep it

    def replay(self, copies: list[tuple[int, int, int]]) -> None:
        for s, d, n in copies:
            assert s >= SRC_BASE and s + n <= SRC_BASE + len(self.src)
            assert d >= DST_BASE and d + n <= DST_BASE + len(self.dst)
            self.dst[d - DST_BASE : d - DST_BASE + n] = self.src[s - SRC_BASE : s - SRC_BASE + n]


def _layout(rng: random.Random, nbuf: int, item: int, pages: int, offset: int) -> list[BufferPair]:
    out = []
    for b in range(nbuf):
        base = offset + b * item * pages
        out.append(BufferPair(SRC_BASE + base, DST_BASE + base, item, item * pages, item * pages))
    return out


@pytest.mark.parametrize("item", [16, 4096, 12288, 16384 + 48, 65536])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_every_addressed_page_arrives_and_nothing_else_is_written(item: int, as_tensor: bool) -> None:
    rng = random.Random(item * 7 + as_tensor)
    pool_pages, nbuf = 24, 3
    kv = _layout(rng, nbuf, item, pool_pages, 0)
    aux_off = nbuf * item * pool_pages
    aux = [
        BufferPair(SRC_BASE + aux_off, DST_BASE + aux_off, 24, 24 * 8, 24 * 8),
        BufferPair(SRC_BASE + aux_off + 256, DST_BASE + aux_off + 256, 8, 64, 64),
    ]
    mem = Memory(aux_off + 512, rng)
    n = rng.randint(1, pool_pages)
    src = rng.sample(range(pool_pages), n)
    dst = rng.sample(range(pool_pages), n)
    idx = (lambda v: torch.tensor(v)) if as_tensor else list
    plan = plan_launch(
        [CopyGroup("kv", kv, idx(src), idx(dst)), CopyGroup("aux", aux, [3], [5])],
        chunk_bytes=4096,
    )
    copies = reference_copies(plan)
    assert plan.total_units == len(copies)
    assert plan.total_bytes == sum(c[2] for c in copies) == nbuf * n * item + 24 + 8
    mem.replay(copies)
    expect = bytearray(b"\xa5" * len(mem.dst))
    for b in kv:
        for s, d in zip(src, dst, strict=True):
            so, do = b.src_ptr - SRC_BASE + s * item, b.dst_ptr - DST_BASE + d * item
            expect[do : do + item] = mem.src[so : so + item]
    for b in aux:
        it = b.item_bytes
        so, do = b.src_ptr - SRC_BASE + 3 * it, b.dst_ptr - DST_BASE + 5 * it
        expect[do : do + it] = mem.src[so : so + it]
    assert mem.dst == expect
    assert set(plan.dst_pages_by_pool) == {"kv", "aux"}


def test_chunks_never_exceed_chunk_size_and_cover_each_page_once() -> None:
    item = 3 * 4096 + 32
    plan = plan_launch([CopyGroup("kv", _layout(random.Random(1), 2, item, 4, 0), [0, 2], [1, 3])], chunk_bytes=4096)
    copies = reference_copies(plan)
    assert max(n for _, _, n in copies) == 4096
    assert plan.total_units == 2 * 2 * 4  # buffers x pages x chunks per page
    covered = sorted((d, n) for _, d, n in copies)
    for (d0, n0), (d1, _) in itertools.pairwise(covered):
        assert d0 + n0 <= d1  # no destination byte written twice


def test_small_request_is_built_without_torch_and_matches_tensor_plan() -> None:
    aux = [BufferPair(SRC_BASE + 4096 * i, DST_BASE + 4096 * i, 4096) for i in range(8)]
    small = plan_launch([CopyGroup("aux", aux, [7], [2])])
    big = plan_launch([CopyGroup("aux", aux, torch.tensor([7]), torch.tensor([2]))])
    assert small.small and isinstance(small.table, list) and len(small.table) <= SMALL_TABLE_WORDS
    assert not big.small
    assert small.words() == big.words()
    assert small.ngroups == 1 and small.total_units == 8


def test_mixed_item_sizes_split_into_groups() -> None:
    bufs = [BufferPair(SRC_BASE, DST_BASE, 16), BufferPair(SRC_BASE + 64, DST_BASE + 64, 8)]
    plan = plan_launch([CopyGroup("aux", bufs, [1], [1])])
    assert plan.ngroups == 2


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [([1, 2], [1], "source pages"), ([-1], [0], "negative"), ([0], [4], "past the end")],
)
def test_bad_requests_are_refused_before_launch(src: list[int], dst: list[int], message: str) -> None:
    bufs = [BufferPair(SRC_BASE, DST_BASE, 4096, 4 * 4096, 4 * 4096)]
    with pytest.raises(PlanError, match=message):
        plan_launch([CopyGroup("kv", bufs, src, dst)])


def test_empty_groups_plan_to_nothing() -> None:
    plan = plan_launch([CopyGroup("state", [BufferPair(SRC_BASE, DST_BASE, 64)], [], [])])
    assert plan.total_units == 0 and plan.ngroups == 0


def test_whole_request_is_one_launch_table() -> None:
    # 70B-class KV for one TP=2 rank: 80 layers x (K, V), 2048 pages of 16 tokens x 4 heads x 128 x bf16.
    item = 16 * 4 * 128 * 2
    bufs = [BufferPair(SRC_BASE + i * (1 << 30), DST_BASE + i * (1 << 30), item) for i in range(160)]
    pages = torch.randperm(4096)[:2048]
    plan = plan_launch([CopyGroup("kv", bufs, pages, torch.randperm(4096)[:2048])])
    assert plan.total_bytes == 160 * 2048 * item == 5_368_709_120
    assert plan.ngroups == 1 and plan.table.numel() == 8 + 2 * 160 + 2 * 2048


def test_one_page_per_pool_shortcut_builds_the_general_table() -> None:
    from pdfabric_agent.transfer.fastpath.layout import Layout

    aux = [
        BufferPair(SRC_BASE + 64 * i, DST_BASE + 64 * i, size, 8 * size, 8 * size)
        for i, size in enumerate((16, 8, 16, 4096))
    ]
    state = [BufferPair(SRC_BASE + (1 << 20), DST_BASE + (1 << 20), 8192, 4 * 8192, 4 * 8192)]
    layout = Layout([("aux", aux), ("state", state)], chunk_bytes=4096)
    fast = layout.plan([([3], [5]), ([1], [2])])
    general = layout.plan([(torch.tensor([3]), torch.tensor([5])), (torch.tensor([1]), torch.tensor([2]))])
    assert fast.small and fast.words() == general.words()
    assert (fast.total_units, fast.total_bytes, fast.ngroups) == (general.total_units, general.total_bytes, 4)
    with pytest.raises(PlanError, match="past the end"):
        layout.plan([([8], [0]), ([0], [0])])
