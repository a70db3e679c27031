"""Sender-side staging of GPU sources on tcp (transfer/staging.py): which blocks are staged, into
which slice and where, and the blocks the engine then sends (same destinations and lengths)."""

from __future__ import annotations

import itertools

import pytest

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.transfer.staging import Region, plan_stages, stage_blocks

GPU_A, GPU_B, HOST = 0x10_0000, 0x20_0000, 0x90_0000
REGIONS = [Region(GPU_A, 0x1_0000), Region(GPU_B, 0x1_0000)]


def test_host_sources_pass_and_gpu_sources_are_grouped_by_region_and_length() -> None:
    blocks = [
        Block(GPU_A + 0x400, 0x5000, 0x100),
        Block(HOST, 0x6000, 0x40),  # aux row in shared memory: sent as it is
        Block(GPU_B + 0x200, 0x7000, 0x100),
        Block(GPU_A + 0x100, 0x8000, 0x100),
        Block(GPU_A + 0x10, 0x9000, 0x20),  # a head slice: another length
    ]
    host, stages = plan_stages(blocks, REGIONS, slot_bytes=1 << 20)
    assert host == [Block(HOST, 0x6000, 0x40)]
    (stage,) = stages
    assert [(g.region, g.length, g.offsets, g.at) for g in stage.groups] == [
        (0, 0x100, (0x400, 0x100), 0),
        (1, 0x100, (0x200,), 0x200),
        (0, 0x20, (0x10,), 0x300),
    ]
    assert stage.nbytes == 0x320
    sent = stage_blocks(stage, 0xA000)
    assert sorted((b.dst, b.length) for b in sent) == sorted((b.dst, b.length) for b in blocks if b.src != HOST)
    assert {b.src for b in sent} == {0xA000, 0xA100, 0xA200, 0xA300}


@pytest.mark.parametrize(
    ("lengths", "slot", "per_stage"),
    [
        ([0x100] * 8, 0x400, [4, 4]),  # slices fill a slot, then the next
        ([0x300, 0x300], 0x400, [1, 1]),  # a block never straddles two slices
        ([0x900], 0x400, [1, 1, 1]),  # a block longer than a slot is split: 0x400, 0x400, 0x100
    ],
    ids=["fill-slots", "whole-blocks", "split-long-block"],
)
def test_slices_hold_at_most_a_slot(lengths: list[int], slot: int, per_stage: list[int]) -> None:
    blocks, at = [], 0
    for n in lengths:
        blocks.append(Block(GPU_A + at, 0x50_0000 + at, n))
        at += n
    _, stages = plan_stages(blocks, [Region(GPU_A, 0x1_0000)], slot_bytes=slot)
    assert [sum(len(g.offsets) for g in s.groups) for s in stages] == per_stage
    assert all(s.nbytes <= slot for s in stages)
    moved = sorted((b.dst, b.length) for s in stages for b in stage_blocks(s, 0))
    # Every destination byte is written once, by pieces that tile the original blocks.
    covered = [(d, d + n) for d, n in moved]
    assert covered[0][0] == 0x50_0000 and covered[-1][1] == 0x50_0000 + at
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_a_block_running_past_its_region_is_not_staged() -> None:
    edge = Block(GPU_A + 0xFF00, 0x1000, 0x200)  # 0x100 bytes past the region's end
    host, stages = plan_stages([edge], REGIONS)
    assert host == [edge] and stages == []
