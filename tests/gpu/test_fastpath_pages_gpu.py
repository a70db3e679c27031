"""The agent's KV route as page lists through the fast path on two GPUs (GPU 0 -> GPU 1, one
process, peer access): every layer and K/V in one launch, whole pages and head slices; random
data, a poisoned destination, fresh random pages; the result equals the engine blocks applied."""

from __future__ import annotations

import os
import random
import sys
import tempfile

import pytest
import torch

from tests.gpu.stub_engine import StubEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_route_pages_in_one_launch(decode_tp: int) -> None:
    sys.path[:0] = [os.path.join(ROOT, "agent"), os.path.join(ROOT, "core")]
    from pdfabric_agent.memory.plan import Bases, TransferSide, decode_targets, plan_transfer, sender_duties
    from pdfabric_agent.memory.pools import Pool, PoolLayout
    from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
    from pdfabric_core.policy.types import Device
    from pdfabric_core.spec import parse_spec

    spec = parse_spec(
        {
            "prefill": {"tp": 1},
            "decode": {"tp": decode_tp},
            "model": {"layers": 3, "kvHeads": 4, "headDim": 128, "pageSizeTokens": 16},
        }
    )
    pages = 96
    src_l = PoolLayout.from_geometry(spec.model, 1, kv_pages=pages, state_slots=1, aux_slots=1)
    dst_l = PoolLayout.from_geometry(spec.model, decode_tp, kv_pages=pages, state_slots=1, aux_slots=1)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        e0, e1 = StubEngine(19000 + decode_tp), StubEngine(19100 + decode_tp)
        b0 = FastPathBackend(e0, gpu=0, shm_dir=shm)
        b1 = FastPathBackend(e1, gpu=1, shm_dir=shm)
        src = Pool.allocate("pages-src", src_l.kv_bytes, Device.CUDA, shm_dir=shm, gpu=0)
        dst = Pool.allocate("pages-dst", dst_l.kv_bytes, Device.CUDA, shm_dir=shm, gpu=1)
        src._keep.random_(0, 256)
        dst._keep.random_(0, 256)  # poison
        b0.register(src)
        b1.register(dst)
        for _ in range(2):  # fresh random pages each round
            route = next(r for r in decode_targets(spec, 0) if r.decode_tp_rank == decode_tp - 1)
            n = rng.randrange(1, 64)
            src_pages, dst_pages = rng.sample(range(pages), n), rng.sample(range(pages), n)
            duties = sender_duties(spec, route, 0, n)
            assert duties is not None
            plan = plan_transfer(
                duties,
                TransferSide(src_l, Bases(src.addr, 1, 1), src_pages, [], None),
                TransferSide(dst_l, Bases(dst.addr, 1, 1), dst_pages, [], None),
                kv_blocks=False,
            )
            kvp = plan.kv_pages
            assert kvp is not None and kvp.whole_page is (decode_tp == 1)
            s_host = src._keep.cpu()
            expect = dst._keep.cpu().clone()
            for b in kvp.blocks(coalesce=False):
                expect[b.dst - dst.addr : b.dst - dst.addr + b.length] = s_host[
                    b.src - src.addr : b.src - src.addr + b.length
                ]
            assert b0.try_write_pages(e1.endpoint(), kvp) == "nvlink-kernel"
            torch.cuda.synchronize(1)
            got = dst._keep.cpu()
            if not torch.equal(got, expect):
                bad = (got != expect).nonzero().flatten()
                raise AssertionError(f"{bad.numel()} wrong bytes, first at {int(bad[0])}")
        assert b0.kernel_batches == 2 and e0.batches == []
        b0.close()
        b1.close()
