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

from pdfabric_agent.memory.plan import Bases
from pdfabric_agent.memory.pools import PoolLayout, RankPools
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.room import PrefillRoom, Target
from pdfabric_agent.runtime.tasks import Liveness
from pdfabric_agent.transfer.base import TransferError
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import Backend, record_posts
from tests.unit.agents import kernel_agent as make_agent


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


def test_liveness_names_the_stall_of_the_operation_not_the_longest_ever() -> None:
    live = Liveness(now=0.0)
    live.tick(30.0)  # a 30 s stall, long ago
    live.tick(30.1)
    live.tick(33.1)  # a 3 s stall
    live.tick(33.2)
    assert live.stalled_since(31.0, now=33.3) == pytest.approx(3.0)
    assert live.stalled_since(-1.0, now=33.3) == pytest.approx(30.0)  # both ended after it: the longer


class Blocking(Backend):
    """An engine whose batch does not return before the room's deadline."""

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        time.sleep(0.5)
        return None


class Failing(Backend):
    """An engine whose batch fails (Mooncake's -1), as an in-flight write does once the process
    that issued it resumes from a stop longer than the engine's own timeout."""

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        raise TransferError(f"batch write to {peer} returned -1")


def prefill_room(agent: Any, backend: Backend, deadline_s: float) -> PrefillRoom:
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=64, state_slots=2, aux_slots=2)
    pool = SimpleNamespace(addr=0x1000_0000)
    local = LocalRank(Rank(Role.PREFILL, 0, 0), backend, RankPools(layout, pool, pool, pool))  # type: ignore[arg-type]
    agent.ranks[local.rank.rank_id] = local
    target = Target("decode-0-tp0", 0, "a2")
    target.dst = RoomInfo(1, "decode-0-tp0", local.rank.rank_id, "peer:1", layout, Bases(1 << 30, 2 << 30, 3 << 30),
                          list(range(8)), [1], 1)  # fmt: skip
    now = agent.clock()
    room = PrefillRoom(rank=local.rank.rank_id, room=1, submitted=now, deadline=now + deadline_s,
                       src_pages=list(range(8)), src_state=[0], src_aux=0, targets={"decode-0-tp0": target})  # fmt: skip
    agent.rooms.add(room)
    return room


def run(agent: Any, room: PrefillRoom) -> None:
    async def go() -> None:
        await agent.sender._run(room)
        await agent.close()

    asyncio.run(go())


@pytest.mark.parametrize("stalled", [True, False], ids=["agent-stalled", "peer-silent"])
def test_a_stalled_agent_fails_the_room_but_blames_no_peer(tmp_path: Path, stalled: bool) -> None:
    agent = make_agent(tmp_path)
    record_posts(agent, [])
    room = prefill_room(agent, Blocking(kernel=False, takes=False), 0.2)
    if stalled:  # the loop last ticked long ago: this agent itself was not running
        agent.ctx.liveness.last_tick -= 10.0
    run(agent, room)
    assert room.state.title == "Failed" and "did not complete within" in room.reason
    assert ("stalled for" in room.reason) is stalled
    assert agent.peers.is_blacklisted("a2") is not stalled


@pytest.mark.parametrize("stalled", [True, False], ids=["agent-stalled", "peer-failed"])
def test_a_write_that_failed_after_this_agent_stalled_blames_no_peer(tmp_path: Path, stalled: bool) -> None:
    agent = make_agent(tmp_path)
    record_posts(agent, [])
    room = prefill_room(agent, Failing(kernel=False, takes=False), 5.0)
    if stalled:  # resumed, its tick not run yet: the write's error comes first
        agent.ctx.liveness.last_tick -= 10.0
    run(agent, room)
    assert room.state.title == "Failed" and "returned -1" in room.reason
    assert ("so a2 is not blamed" in room.reason) is stalled
    assert agent.peers.is_blacklisted("a2") is not stalled


@pytest.mark.parametrize("stalled", [True, False], ids=["agent-stalled", "peer-silent"])
def test_a_done_report_that_failed_after_this_agent_stalled_blames_no_peer(tmp_path: Path, stalled: bool) -> None:
    agent = make_agent(tmp_path)

    async def post(agent_name: str, msg: Any, timeout_s: float) -> dict[str, Any]:
        if stalled:
            agent.ctx.liveness.last_tick -= 10.0  # stopped while the report was on its way
        raise TimeoutError("no answer")

    agent.peers.post = post
    room = prefill_room(agent, Backend(kernel=False, takes=False), 5.0)
    run(agent, room)
    assert room.state.title == "Failed" and "did not acknowledge" in room.reason
    assert agent.peers.is_blacklisted("a2") is not stalled


def test_a_missed_heartbeat_while_this_agent_stalled_is_not_counted(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    peers, live = agent.peers, agent.ctx.liveness
    sent = agent.clock()
    live.last_tick -= 10.0  # the pings went out, then this agent stopped
    assert not peers.heartbeat_result("a2", False, sent) and not peers.heartbeat_result("a2", False, sent)
    assert not peers.is_blacklisted("a2")
    live.tick(agent.clock())  # it runs again; the stall ended after `sent`, still not counted
    assert not peers.heartbeat_result("a2", False, sent)
    later = agent.clock()  # pings sent after the stall: two misses blacklist, as before
    assert not peers.heartbeat_result("a2", False, later)
    assert peers.heartbeat_result("a2", False, later)
    assert peers.is_blacklisted("a2")


def test_a_peer_blacklisted_for_silence_that_calls_in_is_readmitted(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    peers = agent.peers
    peers.blame("a2", "missed 2 heartbeats", agent.clock(), silent=True)
    assert peers.is_blacklisted("a2")
    peers.heard_from("a2")
    assert not peers.is_blacklisted("a2")
    # A failed transfer is not refuted by a call: the probe's backoff re-admits it.
    peers.blame("a2", "batch write returned -1", agent.clock())
    peers.heard_from("a2")
    assert peers.is_blacklisted("a2")


def test_a_new_room_pings_a_peer_blacklisted_for_silence_once_a_second_at_most(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    peers = agent.peers
    pings: list[str] = []
    answers = {"a2": False}

    async def ping(agent_name: str, timeout_s: float = 2.0) -> bool:
        pings.append(agent_name)
        await asyncio.sleep(0.01)
        return answers[agent_name]

    peers.ping = ping  # type: ignore[method-assign]

    async def go() -> list[bool]:
        peers.blame("a2", "missed 2 heartbeats", agent.clock(), silent=True)
        silent_dead = await asyncio.gather(peers.usable("a2"), peers.usable("a2"))  # one ping, shared
        again = await peers.usable("a2")  # within the second: no ping, refused at once
        peers._recheck_after["a2"] = 0.0  # a second later
        answers["a2"] = True
        resumed = await peers.usable("a2")
        peers.blame("a2", "batch write returned -1", agent.clock())  # a failed transfer: no ping
        failed = await peers.usable("a2")
        await agent.close()
        return [*silent_dead, again, resumed, failed]

    assert asyncio.run(go()) == [False, False, False, True, False]
    assert pings == ["a2", "a2"]
