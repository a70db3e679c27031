"""An agent that was stopped (SIGSTOP, a frozen node) finds every deadline passed when it resumes:
it fails the rooms that timed out but blames no peer for its own pause; a peer that really did not
answer while this agent ran is still blacklisted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdfabric_agent.plan import Bases
from pdfabric_agent.pools import PoolLayout, RankPools
from pdfabric_agent.ranks import LocalRank
from pdfabric_agent.rooms import PrefillRoom, Target
from pdfabric_agent.tasks import Liveness
from pdfabric_agent.wire import RoomInfo
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.test_agent_kernel_path import Backend, make_agent, record_posts


def test_liveness_sees_a_gap_in_the_ticks() -> None:
    live = Liveness(now=100.0)
    for t in (100.1, 100.2, 100.3):
        live.tick(t)
    assert live.stalled_since(99.0, now=100.35) == 0.0
    assert live.stalled_since(99.0, now=103.0) == pytest.approx(2.7)  # in a stall right now
    live.tick(103.0)  # it resumes
    live.tick(103.1)
    assert live.stalled_since(99.0, now=103.2) == pytest.approx(2.7)  # a stall during the room
    assert live.stalled_since(103.05, now=103.2) == 0.0  # a room submitted after it saw none


class Blocking(Backend):
    """An engine whose batch does not return before the room's deadline."""

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        time.sleep(0.5)
        return None


@pytest.mark.parametrize("stalled", [True, False], ids=["agent-stalled", "peer-silent"])
def test_a_stalled_agent_fails_the_room_but_blames_no_peer(tmp_path: Path, stalled: bool) -> None:
    agent = make_agent(tmp_path)
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=64, state_slots=2, aux_slots=2)
    pool = SimpleNamespace(addr=0x1000_0000)
    local = LocalRank(
        Rank(Role.PREFILL, 0, 0), Blocking(kernel=False, takes=False), RankPools(layout, pool, pool, pool)
    )  # type: ignore[arg-type]
    agent.ranks[local.rank.rank_id] = local
    record_posts(agent, [])
    target = Target("decode-0-tp0", 0, "a2")
    target.dst = RoomInfo(1, "decode-0-tp0", local.rank.rank_id, "peer:1", layout, Bases(1 << 30, 2 << 30, 3 << 30),
                          list(range(8)), [1], 1)  # fmt: skip
    now = agent.clock()
    room = PrefillRoom(rank=local.rank.rank_id, room=1, submitted=now, deadline=now + 0.2, src_pages=list(range(8)),
                       src_state=[0], src_aux=0, targets={"decode-0-tp0": target})  # fmt: skip
    agent.rooms.add(Role.PREFILL, room)
    if stalled:  # the loop last ticked long ago: this agent itself was not running
        agent.ctx.liveness.last_tick -= 10.0

    async def go() -> None:
        await agent.sender._run(room, {})
        await agent.close()

    asyncio.run(go())
    assert room.state.title == "Failed" and "did not complete within" in room.reason
    assert ("stalled for" in room.reason) is stalled
    assert agent.peers.is_blacklisted("a2") is not stalled
