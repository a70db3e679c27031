"""Rooms that take their pages in several sends (issue 23): the chunk planner covers exactly the
whole room's plan, state and aux with the final chunk only; a room fed chunk by chunk moves each at
once and reports the whole room once (no completion marks for a part); an abort between chunks
ends the target's task fenced, moving nothing more; chunks out of order or out of range are
refused with the reason and fail the room; a chunk moves the room's deadline on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Bases, TransferPlan
from pdfabric_agent.memory.pools import PoolLayout, RankPools
from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.chunks import add_chunk, until_deadline
from pdfabric_agent.rooms.room import PrefillRoom, Target
from pdfabric_agent.rooms.targets import EngineDelivery
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import Backend, kernel_agent, record_posts

RANK = "prefill-0-tp0-cp0"
PAGES = [9, 3, 7, 1, 12, 5, 30, 2]  # scattered: nothing coalesces across chunks


def setup(tmp_path: Path, backend: Backend, first: list[int]) -> tuple[Agent, LocalRank, PrefillRoom, Target]:
    agent = kernel_agent(tmp_path)
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=64, state_slots=2, aux_slots=2)
    pool = SimpleNamespace(addr=0x1000_0000)
    local = LocalRank(Rank(Role.PREFILL, 0, 0), backend, RankPools(layout, pool, pool, pool))  # type: ignore[arg-type]
    agent.ranks[local.rank.rank_id] = local
    target = Target("decode-0-tp0", 0, "a2")
    target.dst = RoomInfo(1, "decode-0-tp0", RANK, "peer:1", layout, Bases(0x4000_0000, 0x5000_0000, 0x6000_0000),
                          list(range(20, 20 + len(PAGES)))[::-1], [1], 1)  # fmt: skip
    now = agent.clock()
    room = PrefillRoom(rank=RANK, room=1, submitted=now, deadline=now + 30, src_pages=list(first), src_state=[],
                       src_aux=None, targets={target.decode_rank: target}, sealed=False)  # fmt: skip
    agent.rooms.add(room)
    return agent, local, room, target


def kv_pairs(plan: TransferPlan) -> list[tuple[int, int, int]]:
    assert plan.kv_pages is not None
    return [(b.src, b.dst, b.length) for b in plan.kv_pages.blocks(False)]


def chunk(offset: int, pages: list[int], final: bool = False) -> SendChunk:
    return SendChunk(RANK, 1, pages, [0] if final else [], 0 if final else None, 0, page_offset=offset, final=final)


def test_the_chunk_plans_cover_exactly_the_whole_rooms_plan(tmp_path: Path) -> None:
    agent, local, room, target = setup(tmp_path, Backend(kernel=False, takes=False), PAGES)
    targets = agent.sender.targets
    parts = [
        targets.plan_chunk(room, local, target, range(0, 3))[0],
        targets.plan_chunk(room, local, target, range(3, 6))[0],
    ]
    assert all(p.state == [] and p.aux == [] and p.aux_tcp == [] for p in parts)  # not sealed: KV only
    with pytest.raises(ValueError, match="must not reach past"):
        targets.plan_chunk(room, local, target, range(6, 9))
    room.sealed, room.src_state, room.src_aux = True, [0], 0
    with pytest.raises(ValueError, match="the final one must end there"):
        targets.plan_chunk(room, local, target, range(3, 6))
    parts.append(targets.plan_chunk(room, local, target, range(6, 8))[0])
    whole = targets.plan_target(room, local, target)[0]
    assert sorted(p for part in parts for p in kv_pairs(part)) == sorted(kv_pairs(whole))
    assert (parts[-1].state, parts[-1].aux, parts[-1].aux_tcp) == (whole.state, whole.aux, whole.aux_tcp)
    assert whole.state or whole.aux or whole.aux_tcp  # the final chunk carries something besides KV


def test_a_room_fed_in_chunks_moves_each_at_once_and_reports_the_whole_room_once(tmp_path: Path) -> None:
    backend = Backend(kernel=True, takes=True, launch=True, marks=True)
    agent, local, room, target = setup(tmp_path, backend, PAGES[:3])
    posts: list[tuple[str, dict[str, Any]]] = []
    record_posts(agent, posts)
    launches: list[list[tuple[str, int]]] = []

    async def go() -> None:
        room.state = RoomState.TRANSFERRING
        agent.sender.targets.feed(room, local)
        run = asyncio.ensure_future(agent.sender._run(room))
        await asyncio.sleep(0.05)
        launches.append(list(backend.calls))
        assert posts == []  # chunk 1 moved; the room is not reported before its final chunk
        add_chunk(agent.sender, local, chunk(3, PAGES[3:6]))
        await asyncio.sleep(0.05)
        launches.append(list(backend.calls))
        add_chunk(agent.sender, local, chunk(6, PAGES[6:], final=True))
        await asyncio.wait_for(run, 5)
        await agent.close()

    asyncio.run(go())
    assert room.state is RoomState.SUCCESS, room.reason
    # Each chunk launched and landed as it came (KV only), the final one with state and aux.
    assert [c for c in launches[0] if c[0] == "submit_pages"] == [("submit_pages", launches[0][0][1])]
    assert len([c for c in launches[1] if c[0] == "submit_pages"]) == 2
    assert len([c for c in backend.calls if c[0] == "submit_pages"]) == 3
    assert [c[0] for c in backend.calls if c[0] == "submit_blocks"] == ["submit_blocks", "submit_blocks"]
    # With the final chunk's launch, decode is told the completion marks of all five launches and
    # the whole room's bytes (it watches them instead of waiting for the report); not before.
    assert [p for p, _ in posts] == ["/v1/peer/launched", "/v1/peer/done"]
    notice, body = posts[0][1], posts[1][1]
    assert len(notice["marks"]) == len([c for c in backend.calls if c[0] == "mark"]) == 5
    whole = agent.sender.targets.plan_target(room, local, target)[0]
    assert whole.kv_pages is not None
    assert body["bytes_by_path"]["nvlink-kernel"]["kv"] == whole.kv_pages.nbytes == room.moved["kv"]
    assert notice["bytes_by_path"] == body["bytes_by_path"]
    assert room.marks["first-byte"] <= room.marks["chunk:3"] <= room.marks["chunk:6"]


def test_an_abort_between_chunks_ends_the_target_fenced_and_moves_nothing_more(tmp_path: Path) -> None:
    backend = Backend(kernel=False, takes=False)
    agent, local, room, target = setup(tmp_path, backend, PAGES[:3])
    posts: list[tuple[str, dict[str, Any]]] = []
    record_posts(agent, posts)

    async def go() -> None:
        room.state = RoomState.TRANSFERRING
        agent.sender.targets.feed(room, local)
        run = asyncio.ensure_future(agent.sender._run(room))
        await asyncio.sleep(0.05)
        agent.sender.abort(room, "aborted by the engine")
        await asyncio.wait_for(run, 5)
        # A chunk after the abort changes nothing: the room's view says how it ended.
        view = add_chunk(agent.sender, local, chunk(3, PAGES[3:6]))
        assert view.state is RoomState.FAILED
        await asyncio.sleep(0.05)
        await agent.close()

    asyncio.run(go())
    assert room.state is RoomState.FAILED and room.reason == "aborted by the engine"
    assert not target.writing and not target.done
    written = sum(n for what, n in backend.calls if what == "engine")
    assert written == 3 * 2 * agent.spec.model.layers  # chunk 1's pages only (per layer, K and V)
    failures = [body for path, body in posts if path == "/v1/peer/done"]
    assert failures and all(not b["ok"] and b["fenced"] for b in failures)  # decode may reuse its pages at once


def test_an_engine_chunk_starts_moving_in_the_call_that_fed_it(tmp_path: Path) -> None:
    """Nothing of the target in flight: the chunk's first engine batch goes to a worker in the
    feed itself (the chunk's API call), before the room's task runs; a chunk fed while an earlier
    one is written waits its turn."""
    backend = Backend(kernel=False, takes=False)
    agent, local, room, target = setup(tmp_path, backend, PAGES[:3])
    posts: list[tuple[str, dict[str, Any]]] = []
    record_posts(agent, posts)
    plans: list[TransferPlan] = []

    def batches(plan: TransferPlan) -> list[int]:
        """The engine batches a plan makes (the test backend takes 16 blocks a batch)."""
        made = agent.sender.targets.writer.engine_batches(local, plan)
        assert made is not None
        return [len(b) for b in made]

    async def go() -> None:
        room.state = RoomState.TRANSFERRING
        agent.sender.targets.feed(room, local)  # no room task yet
        delivery = target.deliveries.get_nowait()
        assert isinstance(delivery, EngineDelivery) and delivery.first is not None
        assert await asyncio.wait_for(delivery.first, 5) is None  # written by the worker already
        assert backend.calls == [("engine", batches(delivery.plan)[0])]  # the rest goes with the task
        plans.append(delivery.plan)
        target.deliveries.put_nowait(delivery)
        add_chunk(agent.sender, local, chunk(3, PAGES[3:6]))  # chunk 1 not confirmed yet: it waits
        second = target.deliveries._queue[-1]  # type: ignore[attr-defined]
        assert isinstance(second, EngineDelivery) and second.first is None
        plans.append(second.plan)
        run = asyncio.ensure_future(agent.sender._run(room))
        await asyncio.sleep(0.05)
        add_chunk(agent.sender, local, chunk(6, PAGES[6:], final=True))
        plans.append(agent.sender.targets.plan_chunk(room, local, target, range(6, 8))[0])
        await asyncio.wait_for(run, 5)
        await agent.close()

    asyncio.run(go())
    assert room.state is RoomState.SUCCESS, room.reason
    # Chunk 1 once (its eager batch is not sent again), chunk 2, then the final chunk with its
    # state and aux blocks in the same batch.
    assert plans[-1].aux and plans[-1].state
    assert [n for what, n in backend.calls if what == "engine"] == [n for p in plans for n in batches(p)]
    assert [p for p, _ in posts] == ["/v1/peer/done"]


@pytest.mark.parametrize(
    ("msg", "status", "words"),
    [
        (chunk(4, PAGES[4:6]), 409, "send page_offset 3"),
        (chunk(2, PAGES[2:6]), 409, "without gaps or overlap"),
        (chunk(3, [*PAGES[3:], 40]), 400, "no chunk may reach past them"),
        (chunk(3, PAGES[3:6], final=True), 400, "the final one must end there"),
    ],
    ids=["gap", "overlap", "past-decode-pages", "final-short"],
)
def test_a_chunk_out_of_order_or_range_is_refused_and_fails_the_room(
    tmp_path: Path, msg: SendChunk, status: int, words: str
) -> None:
    agent, local, room, _ = setup(tmp_path, Backend(kernel=False, takes=False), PAGES[:3])
    record_posts(agent, [])

    async def go() -> None:
        with pytest.raises(ApiError) as refused:
            add_chunk(agent.sender, local, msg)
        assert refused.value.status == status and words in str(refused.value)
        await asyncio.sleep(0.01)
        await agent.close()

    asyncio.run(go())
    assert room.state is RoomState.FAILED and room.reason.startswith("chunk refused")


def test_send_chunk_parse_keeps_state_and_aux_for_the_final_chunk() -> None:
    body = chunk(3, PAGES[3:6]).to_json()
    assert SendChunk.parse(body) == chunk(3, PAGES[3:6])
    assert SendChunk.parse(chunk(6, PAGES[6:], final=True).to_json()).final
    with pytest.raises(ApiError, match="go with the final chunk"):
        SendChunk.parse({**body, "state_indices": [0]})
    with pytest.raises(ApiError, match="'final' must be true or false"):
        SendChunk.parse({**body, "final": "yes"})


def test_a_chunk_moves_the_rooms_deadline_on() -> None:
    clock = [0.0]
    room = SimpleNamespace(deadline=0.05)

    async def slow() -> None:
        await asyncio.sleep(0.12)

    async def go() -> None:
        async def move_on() -> None:
            for _ in range(4):
                await asyncio.sleep(0.03)
                clock[0] += 0.03
                room.deadline = clock[0] + 0.05  # a chunk came

        mover = asyncio.ensure_future(move_on())
        await until_deadline(room, slow(), lambda: clock[0])  # type: ignore[arg-type]
        await mover
        room.deadline = clock[0]  # no chunk comes any more
        with pytest.raises(TimeoutError):
            await until_deadline(room, slow(), lambda: clock[0])  # type: ignore[arg-type]

    asyncio.run(go())
