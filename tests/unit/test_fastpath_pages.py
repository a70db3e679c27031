"""The agent's KV handed to the fast path as page lists (no GPU): the launch table replays to
exactly the bytes the engine blocks would move, the backend takes a route in one launch or
declines having moved nothing, and the path label says what moved a batch."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable
from typing import Any

import pytest
import torch

from pdfabric_agent.memory.plan import Bases, KvPages, TransferSide, decode_targets, plan_transfer, sender_duties
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.transfer.fastpath.backend import FastPathBackend
from pdfabric_agent.transfer.fastpath.kernel import KernelConfig
from pdfabric_agent.transfer.fastpath.layout import page_layout
from pdfabric_agent.transfer.fastpath.ledger import OverlapError, ReceiverLedger
from pdfabric_agent.transfer.fastpath.peers import PeerMap
from pdfabric_agent.transfer.fastpath.plan import plan_pages
from pdfabric_agent.transfer.fastpath.table import LaunchPlan, PlanError, reference_copies
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import parse_spec

SRC_BASE, DST_BASE, MAPPED = 0x1000_0000, 0x4000_0000, 0x9000_0000


class Memory:
    """Sparse byte arrays at fake addresses."""

    def __init__(self) -> None:
        self.regions: dict[int, bytearray] = {}

    def add(self, base: int, data: bytearray) -> None:
        self.regions[base] = data

    def _at(self, addr: int, n: int) -> tuple[bytearray, int]:
        for base, data in self.regions.items():
            if base <= addr and addr + n <= base + len(data):
                return data, addr - base
        raise AssertionError(f"{addr:#x}+{n} is outside every region")

    def copy(self, src: int, dst: int, n: int) -> None:
        s, so = self._at(src, n)
        d, do = self._at(dst, n)
        d[do : do + n] = s[so : so + n]


def replay(mem: Memory, plan: LaunchPlan) -> None:
    for s, d, n in reference_copies(plan):
        mem.copy(s, d, n)


def geometry(decode_tp: int = 1, pages: int = 24, layers: int = 3) -> tuple[Any, PoolLayout, PoolLayout]:
    spec = parse_spec(
        {
            "prefill": {"tp": 1},
            "decode": {"tp": decode_tp},
            "model": {"layers": layers, "kvHeads": 4, "headDim": 8, "pageSizeTokens": 2, "dtype": "float32"},
        }
    )
    src = PoolLayout.from_geometry(spec.model, 1, kv_pages=pages, state_slots=1, aux_slots=1)
    dst = PoolLayout.from_geometry(spec.model, decode_tp, kv_pages=pages, state_slots=1, aux_slots=1)
    return spec, src, dst


def kv_pages(
    decode_tp: int, src_pages: list[int], dst_pages: list[int], d: int = 0, pool_pages: int = 24
) -> tuple[KvPages, Any, Any]:
    spec, src_l, dst_l = geometry(decode_tp, pages=pool_pages)
    route = next(r for r in decode_targets(spec, 0) if r.decode_tp_rank == d)
    duties = sender_duties(spec, route, 0, len(dst_pages))
    assert duties is not None
    plan = plan_transfer(
        duties,
        TransferSide(src_l, Bases(SRC_BASE, 1, 1), src_pages, [], None),
        TransferSide(dst_l, Bases(DST_BASE, 1, 1), dst_pages, [], None),
    )
    assert plan.kv_pages is not None
    return plan.kv_pages, plan, (src_l, dst_l)


def memories(src_l: PoolLayout, dst_l: PoolLayout, seed: int) -> tuple[Memory, Memory]:
    """(memory for the table replay, memory for the engine-block replay), equal at the start:
    random source, poisoned destination."""
    rng = random.Random(seed)
    src = rng.randbytes(src_l.kv_bytes)
    out = []
    for _ in range(2):
        m = Memory()
        m.add(SRC_BASE, bytearray(src))
        m.add(DST_BASE, bytearray(b"\xa5" * dst_l.kv_bytes))
        out.append(m)
    return out[0], out[1]


@pytest.mark.parametrize("decode_tp", [1, 2, 4])
@pytest.mark.parametrize("scattered", [False, True])
def test_page_table_moves_exactly_what_the_engine_blocks_move(decode_tp: int, scattered: bool) -> None:
    rng = random.Random(decode_tp * 10 + scattered)
    n = 16
    if scattered:
        src_pages, dst_pages = rng.sample(range(24), n), rng.sample(range(24), n)
    else:
        src_pages, dst_pages = list(range(3, 3 + n)), list(range(5, 5 + n))
    kvp, plan, (src_l, dst_l) = kv_pages(decode_tp, src_pages, dst_pages)
    assert plan.kv == kvp.blocks(True)
    assert kvp.nbytes == sum(b.length for b in plan.kv)
    assert kvp.whole_page is (decode_tp == 1)
    by_table, by_blocks = memories(src_l, dst_l, decode_tp)
    table = plan_pages(
        "kv",
        list(zip(kvp.src_bases, kvp.dst_bases, strict=True)),
        kvp.item,
        kvp.src_stride,
        kvp.dst_stride,
        kvp.src_pages,
        kvp.dst_pages,
        chunk_bytes=64,
    )
    assert table.total_bytes == kvp.nbytes
    assert set(torch.as_tensor(sorted(table.dst_pages_by_pool["kv"])).tolist()) == set(dst_pages)
    replay(by_table, table)
    for b in plan.kv:
        by_blocks.copy(b.src, b.dst, b.length)
    assert by_table.regions[DST_BASE] == by_blocks.regions[DST_BASE]
    assert by_table.regions[DST_BASE] != bytearray(b"\xa5" * dst_l.kv_bytes)


def test_whole_request_table_is_pairs_plus_one_page_list() -> None:
    kvp, _, _ = kv_pages(1, list(range(16)), list(range(16)))
    pairs = list(zip(kvp.src_bases, kvp.dst_bases, strict=True))
    table = plan_pages("kv", pairs, kvp.item, kvp.src_stride, kvp.dst_stride, kvp.src_pages, kvp.dst_pages)
    assert table.ngroups == 1
    assert len(table.words()) == 8 + 2 * len(pairs) + 2 * 16  # header, buffer pairs, page pairs


def test_list_fast_table_equals_the_generic_one() -> None:
    rng = random.Random(5)
    kvp, _, _ = kv_pages(1, rng.sample(range(24), 20), rng.sample(range(24), 20))
    pairs = list(zip(kvp.src_bases, kvp.dst_bases, strict=True))
    fast = plan_pages("kv", pairs, kvp.item, kvp.src_stride, kvp.dst_stride, list(kvp.src_pages), list(kvp.dst_pages))
    # The generic planner (Layout.plan, tensor path) against plan_pages' one-group fast path.
    generic = page_layout("kv", pairs, kvp.item).plan([(torch.tensor(kvp.src_pages), torch.tensor(kvp.dst_pages))])
    from_tensors = plan_pages(
        "kv", pairs, kvp.item, kvp.src_stride, kvp.dst_stride, torch.tensor(kvp.src_pages), torch.tensor(kvp.dst_pages)
    )
    assert from_tensors.words() == generic.words()
    assert fast.words() == generic.words()
    assert (fast.ngroups, fast.total_units, fast.total_bytes) == (
        generic.ngroups,
        generic.total_units,
        generic.total_bytes,
    )
    assert fast.dst_pages_by_pool["kv"] == set(generic.dst_pages_by_pool["kv"].tolist())  # type: ignore[union-attr]
    with pytest.raises(PlanError, match="negative"):
        plan_pages("kv", pairs, kvp.item, kvp.src_stride, kvp.dst_stride, [0, -1], [1, 2])


def test_runs_are_computed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdfabric_agent.memory.plan as plan_mod

    calls = []
    real = plan_mod.coalesce_pages
    monkeypatch.setattr(plan_mod, "coalesce_pages", lambda s, d: calls.append(1) or real(s, d))
    kvp, plan, _ = kv_pages(1, list(range(8)), list(range(8, 16)))
    assert len(kvp.src_bases) == 6  # 3 layers x K, V
    assert len(plan.kv) == 6 and len(calls) == 1


# ---------------------------------------------------------------- the backend, with a stand-in sender


class _Done:
    def __init__(self, ledger: ReceiverLedger, room: Hashable, done: bool) -> None:
        self.ledger, self.room, self._done = ledger, room, done

    def done(self) -> bool:
        if self._done:
            self.ledger.release(self.room)
        return self._done

    def wait(self, timeout_s: float = 0.0) -> int:
        raise TimeoutError(f"room {self.room!r}: no completion")


class FakeSender:
    """Replays each plan over `Memory` the way the kernel decodes its table."""

    def __init__(self, mem: Memory) -> None:
        self.cfg = KernelConfig()
        self.ledger = ReceiverLedger()
        self.mem = mem
        self.plans: list[LaunchPlan] = []
        self.complete = True

    def submit_plan(self, room: Hashable, receiver: Hashable, plan: LaunchPlan) -> _Done:
        self.ledger.reserve(room, receiver, plan.dst_pages_by_pool)
        self.plans.append(plan)
        replay(self.mem, plan)
        return _Done(self.ledger, room, self.complete)

    def close(self) -> None:
        pass


class FakeEngine:
    name = "mooncake"
    path = "mooncake"
    transport = Transport.NVLINK_INTRA
    max_batch_entries = 1024

    def __init__(self, mem: Memory) -> None:
        self.mem = mem
        self.batches: list[int] = []

    def endpoint(self) -> str:
        return "127.0.0.1:1"

    def write_batch(self, peer: str, blocks: Any) -> None:
        self.batches.append(len(blocks))
        for b in blocks:  # the engine writes through the peer's own addresses
            self.mem.copy(b.src, b.dst - DST_BASE + MAPPED, b.length)
        return None

    def close(self) -> None:
        pass


def backend_for(src_l: PoolLayout, dst_l: PoolLayout, tmp_path: Any, seed: int = 1) -> tuple[FastPathBackend, Memory]:
    mem, _ = memories(src_l, dst_l, seed)
    mem.regions[MAPPED] = mem.regions.pop(DST_BASE)  # the peer's pool as this process sees it
    fp = FastPathBackend(FakeEngine(mem), gpu=0, shm_dir=str(tmp_path), sender=FakeSender(mem))  # type: ignore[arg-type]
    fp._local = [(SRC_BASE, src_l.kv_bytes)]
    peer_map = PeerMap(((DST_BASE, dst_l.kv_bytes, MAPPED),))
    fp._peer = lambda peer: peer_map if peer == "decode" else None  # type: ignore[method-assign]
    return fp, mem


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_backend_takes_a_route_in_one_launch(decode_tp: int, tmp_path: Any) -> None:
    rng = random.Random(3)
    src_pages, dst_pages = rng.sample(range(24), 16), rng.sample(range(24), 16)
    kvp, plan, (src_l, dst_l) = kv_pages(decode_tp, src_pages, dst_pages)
    fp, mem = backend_for(src_l, dst_l, tmp_path)
    try:
        assert fp.try_write_pages("decode", kvp) == "nvlink-kernel"
        assert len(fp._sender.plans) == 1 and fp.kernel_batches == 1  # type: ignore[attr-defined]
        expect, _ = memories(src_l, dst_l, 1)
        for b in plan.kv:
            expect.copy(b.src, b.dst, b.length)
        assert mem.regions[MAPPED] == expect.regions[DST_BASE]
        assert fp._sender.ledger.in_flight() == 0  # released on completion
        # Another node (no export file): nothing moved, the agent falls back to engine blocks.
        assert fp.try_write_pages("elsewhere", kvp) is None
        assert fp.try_write_blocks("elsewhere", plan.kv) is None
        assert fp.write_batch("elsewhere", plan.kv[:4]) == "mooncake"  # the label of what moved it
        assert fp.engine_batches == 1 and fp.inner.batches == [4]  # type: ignore[attr-defined]
    finally:
        fp._board.close()


def test_backend_declines_pages_outside_the_pools(tmp_path: Any) -> None:
    kvp, _, (src_l, dst_l) = kv_pages(1, [0, 1], [2, 3])
    fp, _ = backend_for(src_l, dst_l, tmp_path)
    try:
        fp._local = [(SRC_BASE, src_l.kv_bytes // 2)]  # the last layers' source is not a GPU pool here
        assert fp.try_write_pages("decode", kvp) is None
        assert fp._sender.plans == []  # type: ignore[attr-defined]
    finally:
        fp._board.close()


def test_blocks_of_any_count_go_in_one_launch(tmp_path: Any) -> None:
    src_pages = list(range(24))
    kvp, _, (src_l, dst_l) = kv_pages(1, src_pages, src_pages[::-1])
    blocks = kvp.blocks(coalesce=False)
    fp, _ = backend_for(src_l, dst_l, tmp_path)
    try:
        many = blocks * 1  # 144 blocks here; the limit is the table size, not the engine's 1024
        assert fp.try_write_blocks("decode", many) == "nvlink-kernel"
        assert len(fp._sender.plans) == 1  # type: ignore[attr-defined]
    finally:
        fp._board.close()


def test_overlapping_request_in_flight_is_refused(tmp_path: Any) -> None:
    kvp, _, (src_l, dst_l) = kv_pages(1, [0, 1, 2], [4, 5, 6])
    fp, _ = backend_for(src_l, dst_l, tmp_path)
    fp.timeout_s = 0.01
    sender: FakeSender = fp._sender  # type: ignore[assignment]
    try:
        sender.complete = False
        with pytest.raises(TimeoutError):
            fp.try_write_pages("decode", kvp)
        other, _, _ = kv_pages(1, [7, 8], [6, 9])  # page 6 is still in flight
        with pytest.raises(OverlapError):
            fp.try_write_pages("decode", other)
        disjoint, _, _ = kv_pages(1, [7, 8], [10, 11])
        sender.complete = True
        assert fp.try_write_pages("decode", disjoint) == "nvlink-kernel"
    finally:
        fp._board.close()


def test_large_request_launches_its_first_eighth_alone_then_the_rest(tmp_path: Any) -> None:
    rng = random.Random(11)
    src_pages, dst_pages = rng.sample(range(160), 100), rng.sample(range(160), 100)
    kvp, plan, (src_l, dst_l) = kv_pages(1, src_pages, dst_pages, pool_pages=160)
    fp, mem = backend_for(src_l, dst_l, tmp_path)
    sender: FakeSender = fp._sender  # type: ignore[assignment]
    try:
        launched = fp.submit_pages("decode", kvp)
        assert launched is not None and launched.before is not None
        # 100 // 8 = 12 pages first (every layer and K/V), then the other 88: 6 buffers each.
        assert [p.total_units // p.ngroups for p in sender.plans] == [6 * 12, 6 * 88]
        assert launched.nbytes + launched.before.nbytes == kvp.nbytes
        assert fp.wait(launched) == "nvlink-kernel"
        assert fp.kernel_batches == 1  # one request, though two launches
        expect, _ = memories(src_l, dst_l, 1)
        for b in plan.kv:
            expect.copy(b.src, b.dst, b.length)
        assert mem.regions[MAPPED] == expect.regions[DST_BASE]
        assert sender.ledger.in_flight() == 0  # both launches released
    finally:
        fp._board.close()


def test_refused_second_launch_lets_the_first_land_then_raises(tmp_path: Any) -> None:
    src_pages, dst_pages = list(range(100)), list(range(100, 200))
    kvp, _, (src_l, dst_l) = kv_pages(1, src_pages, dst_pages, pool_pages=200)
    fp, _ = backend_for(src_l, dst_l, tmp_path)
    sender: FakeSender = fp._sender  # type: ignore[assignment]
    pool = f"kv@{kvp.dst_bases[0]:#x}/{kvp.item}"
    sender.ledger.reserve("another request", "decode", {pool: {150}})  # in flight: a page of the rest
    try:
        with pytest.raises(OverlapError, match=r"pages \[150\]"):
            fp.submit_pages("decode", kvp)
        assert len(sender.plans) == 1  # the first eighth went, and was waited for
        assert sender.ledger.in_flight() == 1  # only the other request holds pages now
    finally:
        fp._board.close()


@pytest.mark.parametrize("pages", [3, 100])  # one launch; pipelined (the bad page in the second launch)
def test_page_past_the_end_of_the_pool_is_refused_before_it_is_written(tmp_path: Any, pages: int) -> None:
    src_pages, dst_pages = list(range(pages)), list(range(pages))
    dst_pages[-1] = 200  # the decode pool has 200 pages: 0..199
    kvp, _, (src_l, dst_l) = kv_pages(1, src_pages, list(range(pages)), pool_pages=200)
    kvp = dataclasses.replace(kvp, dst_pages=dst_pages)
    fp, _ = backend_for(src_l, dst_l, tmp_path)
    sender: FakeSender = fp._sender  # type: ignore[assignment]
    try:
        with pytest.raises(PlanError, match="past the end"):
            fp.submit_pages("decode", kvp)
        assert len(sender.plans) == (0 if pages < 64 else 1)  # at most the first eighth, all in bounds
        assert sender.ledger.in_flight() == 0
    finally:
        fp._board.close()
