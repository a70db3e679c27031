"""End-to-end checksums (spec.transfer.verify): the sender's sum over its source bytes equals the
receiver's over the destination bytes of the same plan whatever the layout, the chunking and the
coalescing; any corrupted, lost or misplaced byte changes it; the decode agent fails a room whose
bytes do not match, and is Success only when they do."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Bases, TransferPlan, TransferSide, decode_targets, plan_transfer, sender_duties
from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools
from pdfabric_agent.protocol.peer_answers import SourceAnswer
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import ReceiveRequest
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms import integrity
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Device, Role
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec, parse_spec
from tests.unit.agents import Backend, make_agent, peer_answer

MODEL = {"layers": 2, "kvHeads": 4, "headDim": 8, "pageSizeTokens": 2, "dtype": "float32",
         "stateBytesPerRequest": 96, "stateLayers": 2, "auxRowBytes": [8, 20]}  # fmt: skip


def pools(tmp: Path, tag: str, layout: PoolLayout, fill: int | None) -> RankPools:
    rng = random.Random(fill)
    made = []
    for kind, size in (("kv", layout.kv_bytes), ("state", layout.state_bytes), ("aux", layout.aux_bytes)):
        pool = Pool.allocate(f"{tag}-{kind}", size, Device.CPU, shm_dir=str(tmp))
        if fill is not None:
            pool.view()[:] = rng.randbytes(pool.size)
        made.append(pool)
    return RankPools(layout, *made)


def copy(plan: TransferPlan, src: RankPools, dst: RankPools, coalesce: bool) -> None:
    """What an engine does with the plan: every block, byte for byte."""
    kvp = plan.kv_pages
    blocks = [*(kvp.blocks(coalesce) if kvp is not None else plan.kv), *plan.state, *plan.aux]
    for b in blocks:
        s = next(p for p in src.all() if p.addr <= b.src < p.addr + p.size)
        d = next(p for p in dst.all() if p.addr <= b.dst < p.addr + p.size)
        d.view()[b.dst - d.addr : b.dst - d.addr + b.length] = s.view()[b.src - s.addr : b.src - s.addr + b.length]
    for src_addr, dst_addr, size in plan.aux_tcp:
        dst.aux.write(dst_addr - dst.aux.addr, src.aux.read(src_addr - src.aux.addr, size))


def bases(p: RankPools) -> Bases:
    return Bases(p.kv.addr, p.state.addr, p.aux.addr)


@pytest.mark.parametrize(
    ("ptp", "dtp", "aux_tcp", "coalesce"),
    [(1, 1, False, True), (2, 4, False, True), (4, 2, True, False), (1, 4, True, True)],
    ids=["equal", "head-slices", "fewer-decode-ranks-aux-tcp", "one-to-four"],
)
def test_sender_and_receiver_sum_the_same_stream(
    tmp_path: Path, ptp: int, dtp: int, aux_tcp: bool, coalesce: bool
) -> None:
    spec = parse_spec(
        {"prefill": {"tp": ptp}, "decode": {"tp": dtp}, "model": MODEL, "transfer": {"auxOverTcp": aux_tcp}}
    )
    src_l = PoolLayout.from_geometry(spec.model, ptp, kv_pages=32, state_slots=4, aux_slots=4)
    dst_l = PoolLayout.from_geometry(spec.model, dtp, kv_pages=32, state_slots=4, aux_slots=4)
    route = decode_targets(spec, 0)[0]
    duties = sender_duties(spec, route, 0, 9)
    assert duties is not None
    src, dst = pools(tmp_path, "src", src_l, 1), pools(tmp_path, "dst", dst_l, 2)
    rng = random.Random(7)
    plan = plan_transfer(duties, TransferSide(src_l, bases(src), rng.sample(range(32), 9), [1], 2), TransferSide(dst_l, bases(dst), rng.sample(range(32), 9), [3], 0), coalesce=coalesce, kv_blocks=False)  # fmt: skip
    sent = integrity.checksum(src.all(), integrity.source_regions(plan))
    assert integrity.checksum(dst.all(), integrity.dest_regions(plan)) != sent  # not copied yet
    copy(plan, src, dst, coalesce)
    assert integrity.checksum(dst.all(), integrity.dest_regions(plan)) == sent
    # The KV buffers gathered as rows sum exactly like the same regions one by one.
    assert integrity.checksum(src.all(), integrity.flat(integrity.source_regions(plan))) == sent
    # One flipped byte anywhere in a destination region changes the sum.
    addr, n = random.Random(3).choice(integrity.flat(integrity.dest_regions(plan)))
    pool = next(p for p in dst.all() if p.addr <= addr < p.addr + p.size)
    pool.view()[addr - pool.addr + n // 2] ^= 0x40
    assert integrity.checksum(dst.all(), integrity.dest_regions(plan)) != sent


def test_the_sum_does_not_depend_on_chunking_and_sees_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = PoolLayout(layers=1, local_heads=1, head_bytes=4096, kv_pages=8, state_layers=1, state_layer_bytes=8,
                        state_slots=1, aux_items=(8,), aux_slots=1)  # fmt: skip
    p = pools(tmp_path, "p", layout, 5)
    regions = [(p.kv.addr + 4096 * i + 3, 1000 + i) for i in range(8)]
    whole = integrity.checksum(p.all(), regions)
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 1500)
    assert integrity.checksum(p.all(), regions) == whole
    rows = integrity.Rows(p.kv.addr + 3, 4096, 1000, [5, 1, 6, 2])  # 1000-byte rows: padded per row
    as_regions = integrity.flat([rows])
    assert integrity.checksum(p.all(), [rows]) == integrity.checksum(p.all(), as_regions)
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 8)  # a chunk per row
    assert integrity.checksum(p.all(), [rows, *regions[:2]]) == integrity.checksum(p.all(), [*as_regions, *regions[:2]])
    assert integrity.checksum(p.all(), regions[::-1]) != whole  # the same bytes in another order
    with pytest.raises(ValueError, match="outside the rank's memory"):
        integrity.checksum(p.all(), [(p.kv.addr + p.kv.size - 4, 8)])


def decode_agent(tmp_path: Path, spec_raw: dict[str, Any]) -> tuple[Agent, PDClusterSpec]:
    agent = make_agent(tmp_path, "n2", raw=spec_raw)
    spec = agent.spec

    async def delivered(agent_name: str, msg: Any, timeout_s: float) -> Any:
        return peer_answer(msg)  # the room info reaches the (absent) prefill agent

    agent.peers.post = delivered  # type: ignore[method-assign]
    return agent, spec


def test_decode_is_success_only_when_what_arrived_matches(tmp_path: Path) -> None:
    raw = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "model": MODEL, "transfer": {"transport": "tcp", "verify": True}}
    agent, spec = decode_agent(tmp_path, raw)
    layout = PoolLayout.from_geometry(spec.model, 1, kv_pages=16, state_slots=2, aux_slots=2)
    dst = pools(tmp_path, "dst", layout, None)
    src = pools(tmp_path, "src", layout, 9)
    agent.ranks["decode-0-tp0"] = LocalRank(Rank(Role.DECODE, 0, 0), Backend(kernel=False, takes=False), dst)
    p, d = "prefill-0-tp0-cp0", "decode-0-tp0"

    async def room(n: int, dst_pages: list[int], corrupt: bool) -> SourceAnswer:
        agent.submit_receive(ReceiveRequest(d, n, dst_pages, [1], 1, 0))
        duties = sender_duties(spec, decode_targets(spec, 0)[0], 0, len(dst_pages))
        assert duties is not None
        plan = plan_transfer(duties, TransferSide(layout, bases(src), list(range(len(dst_pages))), [0], 0), TransferSide(layout, bases(dst), dst_pages, [1], 1), kv_blocks=False)  # fmt: skip
        copy(plan, src, dst, True)
        if corrupt:
            dst.kv.view()[dst_pages[-1] * layout.page_bytes] ^= 1
        checksum = integrity.checksum(src.all(), integrity.source_regions(plan))
        owed = agent.rooms.decode[(d, n)].owed[p]
        return await agent.accept_done(DoneReport(n, d, p, {"mooncake": owed}, ok=True, checksum=checksum))

    async def go() -> None:
        assert (await room(1, [3, 4, 9], corrupt=False)).state is RoomState.SUCCESS
        bad = await room(2, [10, 11], corrupt=True)
        assert bad.room_failed and "checksum of what arrived" in bad.reason
        agent.submit_receive(ReceiveRequest(d, 3, [12], [], None, 0))
        no_sum = DoneReport(3, d, p, {"mooncake": agent.rooms.decode[(d, 3)].owed[p]}, ok=True)
        with pytest.raises(Exception, match="needs a checksum"):
            await agent.accept_done(no_sum)
        await agent.close()

    asyncio.run(go())
    for p_ in (*dst.all(), *src.all()):
        p_.close()
