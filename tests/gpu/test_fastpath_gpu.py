"""Fast-path correctness on two NVLink-connected GPUs (run on the GPU machine; skipped elsewhere).

Two processes, one per GPU, both sending at once: random source bytes, destination pools
poisoned with random bytes first, fresh random indices each round; every addressed destination
page must equal its source and every other page must still hold its poison. A request that
overlaps one in flight on the receiver must be refused, and the pages must end up exactly as the
accepted requests wrote them, in order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [24, 4096, 12304, 65536, 262144]  # 24: odd size (byte path); 12304: chunked, not a multiple of 4 KiB
POOL_PAGES = 64
NBUF = 2  # K and V
ROUNDS = 3


def _worker(rank: int, qs, barrier, results) -> None:
    try:
        results.put((rank, "ok", _run(rank, qs, barrier)))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


def _run(rank: int, qs, barrier) -> dict:
    sys.path[:0] = [os.path.join(ROOT, "agent"), os.path.join(ROOT, "core")]
    from pdfabric_agent.memory.ipc import CompletionBoard, export_pool
    from pdfabric_agent.transfer.fastpath.channel import FastPathSender
    from pdfabric_agent.transfer.fastpath.ledger import OverlapError
    from pdfabric_agent.transfer.fastpath.table import BufferPair, CopyGroup

    dev, peer = rank, 1 - rank
    torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))

    def send(x):
        qs[rank].put(x)

    def recv():
        return qs[peer].get(timeout=120)

    src = {s: torch.randint(0, 256, (NBUF, POOL_PAGES, s), dtype=torch.uint8, generator=gen).to(dev) for s in SIZES}
    dst = {s: torch.empty(NBUF, POOL_PAGES, s, dtype=torch.uint8, device=dev) for s in SIZES}
    board = CompletionBoard()
    send(
        {
            "pools": {s: export_pool(t.data_ptr(), t.numel(), dev) for s, t in dst.items()},
            "board": board.name,
            "src": {s: t.cpu() for s, t in src.items()},
        }
    )
    other = recv()
    sender = FastPathSender(dev)
    peer_dst = {s: sender.map_pool(e) for s, e in other["pools"].items()}
    peer_board = CompletionBoard(other["board"], create=False)
    sender.connect("peer", peer_board, slot=0)
    report: dict = {"rounds": 0, "pages": 0}

    def groups(pages: dict) -> list:
        out = []
        for s, (si, di) in pages.items():
            bufs = [
                BufferPair(src[s][b].data_ptr(), peer_dst[s] + b * POOL_PAGES * s, s, POOL_PAGES * s, POOL_PAGES * s)
                for b in range(NBUF)
            ]
            out.append(CopyGroup(f"kv{s}", bufs, si, di))
        return out

    def poison() -> dict:
        p = {s: torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen) for s, t in dst.items()}
        for s, t in dst.items():
            t.copy_(p[s])
        torch.cuda.synchronize(dev)
        return p

    def check(expect: dict) -> None:
        for s, t in dst.items():
            got = t.cpu()
            if not torch.equal(got, expect[s]):
                bad = (got != expect[s]).reshape(NBUF, POOL_PAGES, -1).any(-1).nonzero().tolist()
                raise AssertionError(f"rank {rank} size {s}: wrong pages (buffer, page) {bad[:8]}")

    # ---- both directions at once, random indices every round ----------------------------------
    for rnd in range(ROUNDS):
        expect = poison()
        pages = {}
        for s in SIZES:
            if rnd == 0 and s > 4096:
                continue  # round 0 is aux-sized: plain lists, table passed in the kernel's parameters
            n = int(torch.randint(1, 4 if rnd == 0 else POOL_PAGES, (1,), generator=gen))
            si, di = torch.randperm(POOL_PAGES, generator=gen)[:n], torch.randperm(POOL_PAGES, generator=gen)[:n]
            pages[s] = (si.tolist(), di.tolist()) if rnd == 0 else (si, di)
        barrier.wait()
        tr = sender.submit(("round", report["rounds"]), "peer", groups(pages))
        tr.wait(10.0)
        if rnd == 0:
            report["small_round_bytes"] = tr.nbytes
        send(pages)
        theirs = recv()
        barrier.wait()  # both transfers done: the board said so on each side
        for s, (si, di) in theirs.items():
            expect[s][:, di] = other["src"][s][:, si]
        check(expect)
        report["rounds"] += 1
        report["pages"] += sum(len(si) for si, _ in pages.values()) * NBUF
        barrier.wait()

    # ---- overlap on the receiver is refused (rank 0 sends, rank 1 checks) -----------------------
    expect = poison()
    barrier.wait()
    if rank == 0:
        s = 65536
        a = {s: (torch.arange(0, 32), torch.arange(0, 32))}
        b = {s: (torch.arange(32, 42), torch.arange(31, 41))}  # dst page 31 clashes with a
        c = {s: (torch.arange(50, 60), torch.arange(41, 51))}
        ta = sender.submit("a", "peer", groups(a))
        try:
            sender.submit("b", "peer", groups(b))
            raise AssertionError("overlapping request was accepted")
        except OverlapError as exc:
            report["refused"] = str(exc)
        tc = sender.submit("c", "peer", groups(c))
        ta.wait(10.0)
        tc.wait(10.0)
        tb = sender.submit("b", "peer", groups(b))  # accepted once a has completed
        tb.wait(10.0)
        send([a, c, b])
    else:
        order = recv()
        for req in order:
            for s, (si, di) in req.items():
                expect[s][:, di] = other["src"][s][:, si]
    barrier.wait()
    if rank == 1:
        check(expect)
    sender.close()
    board.close()
    peer_board.close()
    return report


def test_pages_arrive_exactly_and_overlap_is_refused_both_directions() -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    qs = [ctx.Queue(), ctx.Queue()]
    barrier = ctx.Barrier(2, timeout=120)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, qs, barrier, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (status, payload)) for r, status, payload in (results.get(timeout=300) for _ in range(2)))
    for p in procs:
        p.join(30)
    for r in (0, 1):
        assert got[r][0] == "ok", got[r][1]
    assert got[0][1]["rounds"] == ROUNDS and got[0][1]["pages"] > 0
    assert "in flight" in got[0][1]["refused"]
    print("fast path GPU correctness:", got)


def test_one_visible_gpu_under_intra_node_nvlink_fails_at_start_up() -> None:
    code = (
        "import os, sys, torch\n"
        f"sys.path[:0] = [{os.path.join(ROOT, 'agent')!r}, {os.path.join(ROOT, 'core')!r}]\n"
        "from pdfabric_agent.transfer.fastpath.select import check_intra_node_nvlink_startup\n"
        "check_intra_node_nvlink_startup('INTRA_NODE_NVLINK', torch.cuda.device_count(),"
        " cuda_visible_devices=os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "sees 1 GPU(s)" in p.stderr and "IntraNodeNvlinkError" in p.stderr
    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
