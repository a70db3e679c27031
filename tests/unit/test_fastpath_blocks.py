"""Block-mode planning (the agent's engine interface), exact-range overlap refusal, and the
backend choice on a machine without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from pdfabric_agent.transfer.fastpath.ledger import OverlapError, ReceiverLedger
from pdfabric_agent.transfer.fastpath.plan import plan_blocks, plan_blocks_list
from pdfabric_agent.transfer.fastpath.table import PlanError, reference_copies
from pdfabric_core.policy.types import Transport


def test_blocks_replay_exactly_whatever_their_lengths() -> None:
    rng = random.Random(7)
    src_mem = bytearray(rng.randbytes(1 << 20))
    dst_mem = bytearray(b"\x5a" * (1 << 20))
    expect = bytearray(dst_mem)
    blocks, cursor = [], 0
    for _ in range(60):
        n = rng.choice([24, 4096, 16384, 12288 + 16, 40000])
        s = rng.randrange(0, len(src_mem) - n)
        blocks.append((s, cursor, n))
        expect[cursor : cursor + n] = src_mem[s : s + n]
        cursor += n + rng.choice([0, 16, 4096])
    rng.shuffle(blocks)
    t = torch.tensor(blocks, dtype=torch.int64)
    plan = plan_blocks(t[:, 0], t[:, 1], t[:, 2], chunk_bytes=4096)
    assert plan.ngroups == 5  # one group per distinct length
    assert plan.total_bytes == sum(n for _, _, n in blocks)
    for s, d, n in reference_copies(plan):
        assert n <= 4096
        dst_mem[d : d + n] = src_mem[s : s + n]
    assert dst_mem == expect
    assert plan_blocks_list(blocks, chunk_bytes=4096).words() == plan.words()  # same table either way


def test_block_plan_rejects_bad_input() -> None:
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(PlanError, match="positive"):
        plan_blocks(z, z, z)
    with pytest.raises(PlanError, match="one entry per block"):
        plan_blocks(z, z, torch.ones(3, dtype=torch.int64))
    empty = torch.zeros(0, dtype=torch.int64)
    assert plan_blocks(empty, empty, empty).total_units == 0


def test_byte_ranges_overlap_is_refused_exactly() -> None:
    ledger = ReceiverLedger()
    ledger.reserve_ranges("a", "d0", [(0, 4096), (8192, 12288)])
    ledger.reserve_ranges("b", "d0", [(4096, 8192), (12288, 16384)])  # adjacent, not overlapping
    with pytest.raises(OverlapError, match="in flight"):
        ledger.reserve_ranges("c", "d0", [(12000, 12300)])
    ledger.reserve_ranges("c", "d1", [(0, 4096)])  # other receiver
    ledger.release("a")
    ledger.reserve_ranges("d", "d0", [(0, 4096), (8192, 12288)])
    assert ledger.in_flight() == 3


def test_backend_choice_keeps_the_engine_without_a_gpu() -> None:
    from pdfabric_agent.transfer.fastpath.backend import maybe_fast_path

    class Engine:
        name, path, transport, max_batch_entries = "mooncake", "mooncake", Transport.NVLINK_INTRA, 1024

    inner = Engine()
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        pytest.skip("this machine can run the fast path")
    assert maybe_fast_path(inner, gpu=0) is inner
    assert maybe_fast_path(inner, gpu=0, env={"PDFABRIC_FASTPATH": "0"}) is inner
