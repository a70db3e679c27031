"""The fast path behind the agent's backend interface, on two GPUs in two processes: blocks to a
same-node peer go through the kernel into the peer's pool (found through its published exports),
blocks to an unknown peer go to the engine, and an overlapping concurrent batch is refused."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import pytest
import torch

from tests.gpu.stub_engine import StubEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POOL = 8 << 20
SLOT = 64 << 10


def _worker(rank: int, shm: str, qs, barrier, results) -> None:
    try:
        results.put((rank, "ok", _run(rank, shm, qs, barrier)))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


def _run(rank: int, shm: str, qs, barrier) -> dict:
    sys.path[:0] = [os.path.join(ROOT, "agent"), os.path.join(ROOT, "core")]
    from pdfabric_agent.memory.plan import Block
    from pdfabric_agent.memory.pools import Pool
    from pdfabric_agent.transfer.fastpath import backend as fp_backend
    from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
    from pdfabric_agent.transfer.fastpath.ledger import OverlapError
    from pdfabric_core.policy.types import Device

    torch.cuda.set_device(rank)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    engine = StubEngine(17000 + rank)
    be = FastPathBackend(engine, gpu=rank, shm_dir=shm)
    pool = Pool.allocate(f"fp-test-{rank}", POOL, Device.CUDA, shm_dir=shm, gpu=rank)
    content = torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=gen)
    pool._keep.copy_(content)
    be.register(pool)  # synchronises, then publishes the export
    qs[rank].put(pool.addr)
    peer_addr = qs[1 - rank].get(timeout=60)
    barrier.wait()
    report: dict = {}
    if rank == 0:
        sizes = [24, 4096, 16384, 12304, 40000]
        slots = torch.randperm(POOL // SLOT, generator=gen)[:48].tolist()
        blocks = []
        for i, slot in enumerate(slots):
            n = sizes[i % len(sizes)]
            s = (
                int(torch.randint(0, POOL - n, (1,), generator=gen)) & ~15
                if i % 2
                else int(torch.randint(0, POOL - n, (1,), generator=gen))
            )
            blocks.append(Block(pool.addr + s, peer_addr + slot * SLOT, n))
        be.write_batch("127.0.0.1:17001", blocks[:24])  # planned in plain Python
        fp_backend.SMALL_BATCH = 0
        be.write_batch("127.0.0.1:17001", blocks[24:])  # planned with tensors
        report["kernel_batches"] = be.kernel_batches
        be.write_batch("127.0.0.1:17999", blocks[:3])  # no such peer on this node: the engine
        report["engine_calls"] = list(engine.batches)
        be._sender.ledger.reserve_ranges("held", "127.0.0.1:17001", [(blocks[0].dst, blocks[0].dst + 1)])
        try:
            be.write_batch("127.0.0.1:17001", blocks[:1])
            report["overlap"] = "accepted"
        except OverlapError as exc:
            report["overlap"] = str(exc)
        qs[0].put([(b.src - pool.addr, b.dst - peer_addr, b.length) for b in blocks])
    else:
        moves = qs[0].get(timeout=60)
        barrier.wait()
        src = qs[0].get(timeout=60)
        expect = content.clone()
        for s, d, n in moves:
            expect[d : d + n] = src[s : s + n]
        torch.cuda.synchronize(rank)
        got = pool._keep.cpu()
        if not torch.equal(got, expect):
            bad = (got != expect).nonzero().flatten()
            raise AssertionError(f"{bad.numel()} wrong bytes, first at {int(bad[0])}")
        report["verified_blocks"] = len(moves)
    if rank == 0:
        barrier.wait()
        qs[0].put(content)
    barrier.wait()  # rank 0 stays alive until rank 1 has read the tensor it shares
    be.close()
    return report


def test_backend_moves_same_node_blocks_with_the_kernel_and_falls_back_otherwise() -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    qs = [ctx.Queue(), ctx.Queue()]
    barrier = ctx.Barrier(2, timeout=120)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        procs = [ctx.Process(target=_worker, args=(r, shm, qs, barrier, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = {r: (st, payload) for r, st, payload in (results.get(timeout=300) for _ in range(2))}
        for p in procs:
            p.join(30)
    for r in (0, 1):
        assert got[r][0] == "ok", got[r][1]
    r0, r1 = got[0][1], got[1][1]
    assert r0["kernel_batches"] == 2
    assert r0["engine_calls"] == [("127.0.0.1:17999", 3)]
    assert "in flight" in r0["overlap"]
    assert r1["verified_blocks"] == 48


def test_same_process_peer_and_a_republished_peer() -> None:
    """Two ranks of one agent process (GPU 0 -> GPU 1, no IPC: peer access), and a peer that
    publishes new pools under the same endpoint (an agent restart) is remapped, not written
    through the stale mapping."""
    sys.path[:0] = [os.path.join(ROOT, "agent"), os.path.join(ROOT, "core")]
    from pdfabric_agent.memory.plan import Block
    from pdfabric_agent.memory.pools import Pool
    from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
    from pdfabric_core.policy.types import Device

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        e0, e1 = StubEngine(18000), StubEngine(18001)
        b0 = FastPathBackend(e0, gpu=0, shm_dir=shm)
        b1 = FastPathBackend(e1, gpu=1, shm_dir=shm)
        src = Pool.allocate("same-src", POOL, Device.CUDA, shm_dir=shm, gpu=0)
        src._keep.random_(0, 256)
        b0.register(src)
        for generation in range(2):
            dst = Pool.allocate(f"same-dst-{generation}", POOL, Device.CUDA, shm_dir=shm, gpu=1)
            b1.register(dst)  # (re)publishes the endpoint's pools
            offs = torch.randperm(POOL // SLOT)[:16].tolist()
            blocks = [Block(src.addr + i * SLOT, dst.addr + o * SLOT, SLOT) for i, o in enumerate(offs)]
            b0.write_batch(e1.endpoint(), blocks)
            got = dst._keep.view(-1, SLOT)[offs].cpu()
            want = src._keep.view(-1, SLOT)[: len(offs)].cpu()
            assert torch.equal(got, want), f"generation {generation}: bytes differ"
            b1._exports.clear()  # the next generation publishes only its new pool
        assert b0.kernel_batches == 2 and e0.batches == []
        b0.close()
        b1.close()
