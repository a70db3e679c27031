"""The fast path on ONE GPU: sender and receiver are two processes on the same device (CUDA IPC
works across processes on one GPU; a process cannot open its own allocation, hence two).

Process A (this pytest process) runs a `FastPathBackend` with GPU source pools; process B (spawned)
runs another one whose GPU pools it registers, which publishes their IPC exports in a shared tmpfs
directory. A finds B through those exports, as an agent finds a same-node peer. Every case uses
fresh random source bytes and fresh random indices (one seed, printed; PDFABRIC_TEST_SEED replays
it), poisons B's destination pool first and checks all of it afterwards: every written byte equal
to its source, every other byte still poison.

The agent code takes a peer on its own GPU (every rank of a one-GPU node on it: engine-owned
buffers mapped by CUDA IPC are the kernels' alone, Mooncake cannot register them); the first test
pins that down, the others run with a peer directory built with gpu=-1 as before (nothing in the
path looks at the GPU index besides the old same-GPU check).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import pytest
import torch

from tests.gpu.stub_engine import StubEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = int(os.environ.get("PDFABRIC_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
BLOCK_POOL = 16 << 20
MODEL = {"layers": 4, "kvHeads": 4, "headDim": 128, "pageSizeTokens": 16}  # bf16: 16 KiB pages
KV_PAGES = 256
SLEEP_CYCLES = 2_000_000_000  # about a second of GPU spin on the sender's stream (H200 clocks)
PORT_A, PORT_B = 23100, 23101


def _paths() -> None:
    for p in (os.path.join(ROOT, "core"), os.path.join(ROOT, "agent")):
        if p not in sys.path:
            sys.path.insert(0, p)


def _spec(decode_tp: int) -> Any:
    from pdfabric_core.spec import parse_spec

    return parse_spec({"prefill": {"tp": 1}, "decode": {"tp": decode_tp}, "model": MODEL})


def _layout(decode_tp: int, tp: int) -> Any:
    from pdfabric_agent.memory.pools import PoolLayout

    return PoolLayout.from_geometry(_spec(decode_tp).model, tp, kv_pages=KV_PAGES, state_slots=1, aux_slots=1)


def _poison(size: int, seed: int) -> torch.Tensor:
    """The same bytes in both processes (CPU generator)."""
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---- process B: the receiver -------------------------------------------------------------------


def _receiver(shm: str, cmds: Any, replies: Any) -> None:
    try:
        _serve(shm, cmds, replies)
    except BaseException:
        replies.put(("fail", traceback.format_exc()))


def _serve(shm: str, cmds: Any, replies: Any) -> None:
    _paths()
    from pdfabric_agent.memory.completion import CompletionMark, CompletionWatcher
    from pdfabric_agent.memory.pools import Pool
    from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
    from pdfabric_core.policy.types import Device

    torch.cuda.set_device(0)
    be = FastPathBackend(StubEngine(PORT_B), gpu=0, shm_dir=shm)
    sizes = {"blocks": BLOCK_POOL, "kv1": _layout(1, 1).kv_bytes, "kv2": _layout(2, 2).kv_bytes}
    pools = {k: Pool.allocate(f"one-gpu-b-{k}", n, Device.CUDA, shm_dir=shm, gpu=0) for k, n in sizes.items()}
    for p in pools.values():
        be.register(p)  # publishes B's exports in shm, as the agent does
    watcher = CompletionWatcher(shm)

    def poison(name: str, seed: int) -> None:
        pools[name]._keep.copy_(_poison(pools[name].size, seed).to("cuda:0"))
        torch.cuda.synchronize(0)

    def read(name: str) -> bytes:
        torch.cuda.synchronize(0)
        return pools[name]._keep.cpu().numpy().tobytes()

    def watch(name: str, mark_doc: dict, poison_seed: int) -> dict:
        """Learn the launch's completion from A's board only (A does not wait until we reply)."""
        pool = pools[name]._keep
        mark = CompletionMark.from_json(mark_doc)
        reader = watcher.reader(mark.board)
        reached_at_start = reader.reached(mark)
        before = pool.cpu()
        pending_after_read = not reader.reached(mark)  # so `before` was read before the mark
        before_is_poison = torch.equal(before, _poison(pool.numel(), poison_seed))

        async def main() -> tuple[float, bool, bytes]:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future = loop.create_future()

            def done() -> None:  # on the loop, once the watcher saw the word reach mark.seq
                fut.set_result((time.perf_counter(), reader.reached(mark), pool.cpu().numpy().tobytes()))

            watcher.watch([mark], done)
            return await asyncio.wait_for(fut, 60)

        t0 = time.perf_counter()
        t_done, reached, after = asyncio.run(main())
        return {
            "reached_at_start": reached_at_start,
            "before_is_poison": before_is_poison,
            "pending_after_read": pending_after_read,
            "reached_in_callback": reached,
            "after": after,
            "waited_s": t_done - t0,
        }

    handlers = {"poison": poison, "read": read, "watch": watch}
    replies.put(
        (
            "ok",
            {"endpoint": be.endpoint(), "pid": os.getpid(), "pools": {k: (p.addr, p.size) for k, p in pools.items()}},
        )
    )
    while True:
        cmd, *args = cmds.get()
        if cmd == "stop":
            break
        try:
            replies.put(("ok", handlers[cmd](*args)))
        except BaseException:
            replies.put(("fail", traceback.format_exc()))
    watcher.close()
    be.close()
    for p in pools.values():
        p.close()
    replies.put(("ok", "stopped"))


# ---- process A: the sender (this process) ------------------------------------------------------


class Pair:
    def __init__(self, shm: str) -> None:
        _paths()
        self.shm = shm
        self._seeds = 0
        ctx = mp.get_context("spawn")
        self.cmds, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver, args=(shm, self.cmds, self.replies), daemon=True)
        self.proc.start()
        try:
            self._start(shm)
        except BaseException:
            self.proc.kill()
            self.proc.join(timeout=10)
            raise

    def _start(self, shm: str) -> None:
        from pdfabric_agent.memory.plan import Block
        from pdfabric_agent.memory.pools import Pool
        from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
        from pdfabric_agent.transfer.fastpath.peers import PeerDirectory
        from pdfabric_core.policy.types import Device

        torch.cuda.set_device(0)
        self.engine = StubEngine(PORT_A)
        self.be = FastPathBackend(self.engine, gpu=0, shm_dir=shm)
        self.src = {
            "blocks": Pool.allocate("one-gpu-a-blocks", BLOCK_POOL, Device.CUDA, shm_dir=shm, gpu=0),
            "kv": Pool.allocate("one-gpu-a-kv", _layout(1, 1).kv_bytes, Device.CUDA, shm_dir=shm, gpu=0),
        }
        for p in self.src.values():
            self.be.register(p)
        info = self._reply()
        self.peer: str = info["endpoint"]
        self.dst: dict[str, tuple[int, int]] = info["pools"]
        assert info["pid"] != os.getpid()
        # What the agent code does with a peer on its own GPU: the engine, not the kernel.
        addr, _ = self.dst["blocks"]
        one = [Block(self.src["blocks"].addr, addr, 64)]
        self.refusal = {
            "lookup": self.be._directory.lookup(self.peer),
            "label": self.be.write_batch(self.peer, one),
            "engine": list(self.engine.batches),
            "kernel_batches": self.be.kernel_batches,
        }
        self.engine.batches.clear()
        # From here on: a directory without the same-GPU check (it only compares the peer's GPU
        # with its own; everything else is the backend's sender and board).
        self.be._directory = PeerDirectory(gpu=-1, shm_dir=shm, sender=self.be._sender, board=self.be._board)

    def _reply(self, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, payload = self.replies.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise AssertionError(f"receiver process died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise AssertionError("receiver process did not answer") from None
        if status != "ok":
            raise AssertionError(f"receiver process failed:\n{payload}")
        return payload

    def call(self, cmd: str, *args: Any) -> Any:
        self.cmds.put((cmd, *args))
        return self._reply()

    def seed(self, what: str) -> tuple[torch.Generator, int]:
        self._seeds += 1
        seed = SEED + 7919 * self._seeds
        print(f"{what}: seed {seed} (module seed {SEED})")
        return torch.Generator().manual_seed(seed), seed

    def fill_src(self, name: str, gen: torch.Generator) -> torch.Tensor:
        pool = self.src[name]
        host = torch.randint(0, 256, (pool.size,), dtype=torch.uint8, generator=gen)
        pool._keep.copy_(host.to("cuda:0"))
        torch.cuda.synchronize(0)  # the kernel runs on the sender's own stream
        return host

    def poison(self, name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Poison B's pool; returns (expected content so far, mask of bytes meant to be written)."""
        self.call("poison", name, seed)
        size = self.dst[name][1]
        return _poison(size, seed), torch.zeros(size, dtype=torch.bool)

    def read(self, name: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.call("read", name)), dtype=torch.uint8)

    def close(self) -> None:
        try:
            self.be.close()  # unmaps B's pools before B frees them
            for p in self.src.values():
                p.close()
        finally:
            if self.proc.is_alive():
                self.cmds.put(("stop",))
                with contextlib.suppress(AssertionError):
                    self._reply(timeout=30)
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def pair():
    shm = tempfile.mkdtemp(prefix="pdfabric-one-gpu-", dir="/dev/shm")
    p = Pair(shm)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(shm, ignore_errors=True)


def _check(got: torch.Tensor, want: torch.Tensor, written: torch.Tensor, what: str, seed: int) -> None:
    assert int(written.sum()) > 0, f"{what}: nothing was meant to be written"
    if torch.equal(got, want):
        return
    bad = got != want
    in_written, outside = int((bad & written).sum()), int((bad & ~written).sum())
    first = int(bad.nonzero().flatten()[0])
    raise AssertionError(
        f"{what} (seed {seed}): {in_written} written bytes wrong, {outside} poison bytes overwritten; "
        f"first wrong byte at offset {first}"
    )


def _blocks(gen: torch.Generator, n: int, slot: int, src_pool: Any, dst: tuple[int, int]) -> list:
    """n blocks with disjoint destinations (one per random slot of `slot` bytes), random lengths
    and offsets; every other block 16-byte aligned (vector path), the rest byte-granular."""
    from pdfabric_agent.memory.plan import Block

    dst_addr, dst_size = dst
    slots = torch.randperm(dst_size // slot, generator=gen)[:n]
    assert slots.numel() == n
    length = torch.randint(1, slot + 1, (n,), generator=gen)
    d_off = (torch.rand(n, generator=gen, dtype=torch.float64) * (slot - length + 1)).long()
    s_off = (torch.rand(n, generator=gen, dtype=torch.float64) * (src_pool.size - length + 1)).long()
    aligned = torch.arange(n) % 2 == 0
    length = torch.where(aligned, torch.clamp(length & ~15, min=16), length)
    d_off = torch.where(aligned, d_off & ~15, d_off)
    s_off = torch.where(aligned, s_off & ~15, s_off)
    d_abs = slots * slot + d_off
    out = []
    for s, d, ln in zip(s_off.tolist(), d_abs.tolist(), length.tolist(), strict=True):
        assert s >= 0 and d >= 0 and s + ln <= src_pool.size and d + ln <= dst_size
        out.append(Block(src_pool.addr + s, dst_addr + d, ln))
    return out


def _apply_blocks(
    want: torch.Tensor, written: torch.Tensor, src: torch.Tensor, blocks: list, src_addr: int, dst_addr: int
) -> None:
    for b in blocks:
        s, d = b.src - src_addr, b.dst - dst_addr
        want[d : d + b.length] = src[s : s + b.length]
        written[d : d + b.length] = True


def _kv_pages(pair: Pair, decode_tp: int, src_pages: list[int], dst_pages: list[int]) -> tuple[Any, Any]:
    """The route's KvPages exactly as the agent's sender plans them (plan_transfer, kv_blocks=False)."""
    from pdfabric_agent.memory.plan import Bases, TransferSide, decode_targets, plan_transfer, sender_duties

    spec = _spec(decode_tp)
    route = next(r for r in decode_targets(spec, 0) if r.decode_tp_rank == decode_tp - 1)
    duties = sender_duties(spec, route, 0, len(dst_pages))
    assert duties is not None
    plan = plan_transfer(
        duties,
        TransferSide(_layout(decode_tp, 1), Bases(pair.src["kv"].addr, 1, 1), src_pages, [], None),
        TransferSide(_layout(decode_tp, decode_tp), Bases(pair.dst[f"kv{decode_tp}"][0], 1, 1), dst_pages, [], None),
        kv_blocks=False,
    )
    assert plan.kv_pages is not None and plan.kv_pages.whole_page is (decode_tp == 1)
    return plan.kv_pages, route


def _apply_pages(
    want: torch.Tensor,
    written: torch.Tensor,
    src: torch.Tensor,
    decode_tp: int,
    route: Any,
    src_pages: list[int],
    dst_pages: list[int],
) -> None:
    """Independent of the planner: [layer][K/V][page][head][bytes] views of both pools."""
    sl, dl = _layout(decode_tp, 1), _layout(decode_tp, decode_tp)
    nb = 2 * sl.layers
    s4 = src.view(nb, KV_PAGES, sl.local_heads, sl.head_bytes)
    w4 = want.view(nb, KV_PAGES, dl.local_heads, dl.head_bytes)
    m4 = written.view(nb, KV_PAGES, dl.local_heads, dl.head_bytes)
    sp, dp = torch.tensor(src_pages), torch.tensor(dst_pages)
    sh, dh, nh = route.src_head_offset, route.dst_head_offset, route.num_heads
    w4[:, dp, dh : dh + nh] = s4[:, sp, sh : sh + nh]
    m4[:, dp, dh : dh + nh] = True


def _random_pages(gen: torch.Generator, n: int) -> tuple[list[int], list[int]]:
    return torch.randperm(KV_PAGES, generator=gen)[:n].tolist(), torch.randperm(KV_PAGES, generator=gen)[:n].tolist()


# ---- tests -------------------------------------------------------------------------------------


def test_agent_code_takes_a_peer_on_its_own_gpu(pair: Pair) -> None:
    """A same-GPU peer is mapped and its batch goes through the kernel, not the engine; and the
    start-up choice takes the kernels on a one-GPU node."""
    from pdfabric_agent.transfer.fastpath.backend import maybe_fast_path
    from pdfabric_agent.transfer.fastpath.select import TransferPath, choose_path
    from pdfabric_core.policy.types import MemPool, Transport

    r = pair.refusal
    assert r["lookup"] is not None
    assert r["label"] != "mooncake" and r["engine"] == []  # the kernels took it, not the engine
    choice = choose_path(
        MemPool.INTRA_NODE_NVLINK, Transport.NVLINK_INTRA, visible_gpus=1, src_device=0, dst_device=0,
        peer_access=False, kernel_available=(True, ""),
    )  # fmt: skip
    # One GPU takes the kernels now (every rank of the node on it: engine-owned buffers mapped by
    # CUDA IPC are the kernels' alone); the pair above was built before, with a directory pinned.
    assert choice.path is TransferPath.FASTPATH and "one GPU" in choice.reason
    if torch.cuda.device_count() == 1:
        inner = StubEngine(PORT_A + 10)
        assert maybe_fast_path(inner, gpu=0, env={}) is not inner


@pytest.mark.parametrize("api", ["submit_wait", "write_batch"])
@pytest.mark.parametrize(("n", "slot"), [(200, 64 << 10), (3000, 4 << 10)], ids=["small", "large"])
def test_block_batches_into_another_process(pair: Pair, api: str, n: int, slot: int) -> None:
    from pdfabric_agent.transfer.fastpath import backend as fp_backend

    gen, seed = pair.seed(f"blocks {api} n={n}")
    src = pair.fill_src("blocks", gen)
    blocks = _blocks(gen, n, slot, pair.src["blocks"], pair.dst["blocks"])
    assert (len(blocks) <= fp_backend.SMALL_BATCH) is (n == 200)  # python-planned / torch-planned
    want, written = pair.poison("blocks", seed ^ 0x5A5A)
    _apply_blocks(want, written, src, blocks, pair.src["blocks"].addr, pair.dst["blocks"][0])
    before = pair.be.kernel_batches
    if api == "write_batch":
        label = pair.be.write_batch(pair.peer, blocks)
    else:
        launched = pair.be.submit_blocks(pair.peer, blocks)
        assert launched is not None, "the kernel path refused the batch"
        label = pair.be.wait(launched)
    assert label == "nvlink-kernel"
    assert pair.be.kernel_batches == before + 1 and pair.engine.batches == []
    _check(pair.read("blocks"), want, written, f"{n} blocks via {api}", seed)
    assert pair.be._sender.ledger.in_flight() == 0


@pytest.mark.parametrize(
    ("decode_tp", "n"), [(1, 37), (1, 160), (2, 100)], ids=["whole-37", "whole-160-pipelined", "heads-100-pipelined"]
)
def test_route_pages_into_another_process(pair: Pair, decode_tp: int, n: int) -> None:
    from pdfabric_agent.transfer.fastpath.backend import PIPELINE_MIN_PAGES

    gen, seed = pair.seed(f"pages tp{decode_tp} n={n}")
    src = pair.fill_src("kv", gen)
    src_pages, dst_pages = _random_pages(gen, n)
    kvp, route = _kv_pages(pair, decode_tp, src_pages, dst_pages)
    name = f"kv{decode_tp}"
    want, written = pair.poison(name, seed ^ 0x5A5A)
    _apply_pages(want, written, src, decode_tp, route, src_pages, dst_pages)
    launched = pair.be.submit_pages(pair.peer, kvp)
    assert launched is not None, "the kernel path refused the pages"
    assert (launched.before is not None) is (n >= PIPELINE_MIN_PAGES)  # the two-launch split
    assert pair.be.wait(launched) == "nvlink-kernel" and pair.engine.batches == []
    _check(pair.read(name), want, written, f"{n} pages, decode tp {decode_tp}", seed)
    assert pair.be._sender.ledger.in_flight() == 0


def test_receiver_learns_completion_from_the_board(pair: Pair) -> None:
    """A holds its stream (a GPU spin) before a pipelined request, hands B the completion mark
    and does not wait; B watches the mark with CompletionWatcher: unreached and the pool all poison
    when it starts, every byte there when the watcher fires."""
    gen, seed = pair.seed("completion board")
    src = pair.fill_src("kv", gen)
    src_pages, dst_pages = _random_pages(gen, 160)
    kvp, route = _kv_pages(pair, 1, src_pages, dst_pages)
    poison_seed = seed ^ 0x5A5A
    want, written = pair.poison("kv1", poison_seed)
    _apply_pages(want, written, src, 1, route, src_pages, dst_pages)
    with torch.cuda.stream(pair.be._sender.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    launched = pair.be.submit_pages(pair.peer, kvp)
    assert launched is not None and launched.before is not None
    mark = pair.be.completion_mark(launched)
    res = pair.call("watch", "kv1", mark.to_json(), poison_seed)
    assert res["reached_at_start"] is False, "the mark was reached before the launch could run"
    assert res["pending_after_read"] is True, "the GPU spin ended before the receiver looked"
    assert res["before_is_poison"] is True, "bytes landed before the mark"
    assert res["reached_in_callback"] is True
    _check(torch.frombuffer(bytearray(res["after"]), dtype=torch.uint8), want, written, "at the mark", seed)
    assert pair.be.wait(launched) == "nvlink-kernel"
    print(f"receiver saw the mark {res['waited_s'] * 1e3:.1f} ms after it started watching")


def test_overlapping_block_batches_are_refused(pair: Pair) -> None:
    from pdfabric_agent.memory.plan import Block
    from pdfabric_agent.transfer.fastpath.ledger import OverlapError

    gen, seed = pair.seed("overlap blocks")
    src = pair.fill_src("blocks", gen)
    dst_addr, dst_size = pair.dst["blocks"]
    blocks = _blocks(gen, 100, 64 << 10, pair.src["blocks"], pair.dst["blocks"])
    x, z = blocks[:50], blocks[50:]
    last = x[0].dst + x[0].length - 1  # y shares exactly this one byte with x's first block
    y = [Block(pair.src["blocks"].addr + 123, last, min(8, dst_addr + dst_size - last))]
    want, written = pair.poison("blocks", seed ^ 0x5A5A)
    ledger = pair.be._sender.ledger
    assert ledger.in_flight() == 0
    hx = pair.be.submit_blocks(pair.peer, x)  # in flight (its bytes reserved) until waited
    assert hx is not None
    handles = [hx]
    try:
        held = ledger.in_flight()
        assert held == 1
        with pytest.raises(OverlapError, match="in flight"):
            pair.be.submit_blocks(pair.peer, y)
        assert ledger.in_flight() == held  # the refused batch reserved nothing
        hz = pair.be.submit_blocks(pair.peer, z)  # disjoint: accepted alongside
        assert hz is not None
        handles.append(hz)
        assert ledger.in_flight() == 2 * held
    finally:
        for h in handles:
            pair.be.wait(h)
    assert ledger.in_flight() == 0
    src_addr = pair.src["blocks"].addr
    _apply_blocks(want, written, src, x + z, src_addr, dst_addr)
    _check(pair.read("blocks"), want, written, "x and z landed, the refused y wrote nothing", seed)
    assert pair.be.write_batch(pair.peer, y) == "nvlink-kernel"  # nothing in flight now
    _apply_blocks(want, written, src, y, src_addr, dst_addr)
    _check(pair.read("blocks"), want, written, "y after x", seed)


def test_overlapping_page_launches_are_refused(pair: Pair) -> None:
    from pdfabric_agent.transfer.fastpath.ledger import OverlapError

    gen, seed = pair.seed("overlap pages")
    src = pair.fill_src("kv", gen)
    perm = torch.randperm(KV_PAGES, generator=gen).tolist()
    d1, d3 = perm[:20], perm[20:40]
    d2 = perm[40:59]
    d2.insert(int(torch.randint(0, 20, (1,), generator=gen)), d1[7])  # one page shared with request 1
    s1, s2, s3 = (torch.randperm(KV_PAGES, generator=gen)[:20].tolist() for _ in range(3))
    (k1, route), (k2, _), (k3, _) = (_kv_pages(pair, 1, s, d) for s, d in ((s1, d1), (s2, d2), (s3, d3)))
    want, written = pair.poison("kv1", seed ^ 0x5A5A)
    ledger = pair.be._sender.ledger
    assert ledger.in_flight() == 0
    h1 = pair.be.submit_pages(pair.peer, k1)  # in flight (its pages reserved) until waited
    assert h1 is not None
    handles = [h1]
    try:
        assert ledger.in_flight() == 1
        with pytest.raises(OverlapError, match=rf"pages \[{d1[7]}\] are in flight"):
            pair.be.submit_pages(pair.peer, k2)
        assert ledger.in_flight() == 1  # the refused request reserved nothing
        h3 = pair.be.submit_pages(pair.peer, k3)  # disjoint pages: accepted alongside
        assert h3 is not None
        handles.append(h3)
        assert ledger.in_flight() == 2
    finally:
        for h in handles:
            pair.be.wait(h)
    assert ledger.in_flight() == 0
    _apply_pages(want, written, src, 1, route, s1, d1)
    _apply_pages(want, written, src, 1, route, s3, d3)
    _check(pair.read("kv1"), want, written, "requests 1 and 3 landed, the refused 2 wrote nothing", seed)
    assert pair.be.try_write_pages(pair.peer, k2) == "nvlink-kernel"
    _apply_pages(want, written, src, 1, route, s2, d2)
    _check(pair.read("kv1"), want, written, "request 2 after request 1", seed)
