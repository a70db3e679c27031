"""Live membership (service/membership.py): a running agent adopts a newer rank map, admits the
agents it adds at once, drains the ones it drops, and refuses a map it cannot run on."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Bases
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.process.rankmap_file import RankMapFile
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.peer_series import PEERS
from pdfabric_agent.service.agent import Agent
from pdfabric_agent.service.membership import MembershipRefused
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from tests.unit.agents import TCP_RAW, D, P, make_agent, record_posts

A1 = AgentEntry("a1", "n1", (Rank(Role.PREFILL, 0, 0),))
A2 = AgentEntry("a2", "n2", (Rank(Role.DECODE, 0, 0),))
A3 = AgentEntry("a3", "n3", (Rank(Role.DECODE, 1, 0),))
P1 = AgentEntry("p1", "n4", (Rank(Role.PREFILL, 1, 0),))


def rankmap(*agents: AgentEntry, prefill: int = 1, decode: int = 1, **changes: Any) -> RankMap:
    raw = {**TCP_RAW, "prefill": {"tp": 1, "replicas": prefill}, "decode": {"tp": 1, "replicas": decode}}
    feeds = {p: tuple(range(decode)) for p in range(prefill)}
    return dataclasses.replace(RankMap("ns", "c", "uid-1", "tcp", raw, agents, feeds), **changes)


@pytest.fixture(autouse=True)
def _forget_the_peers_these_tests_add() -> Iterator[None]:
    """The metric registry is the process's: the series of agents added here go with the test."""
    yield
    for name in ("a3", "p1"):
        PEERS.forget_peer(name)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def decode_agent(tmp_path: Path, clock: Clock) -> Agent:
    agent = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    agent.clock = clock
    agent.ctx.clock = clock
    return agent


def test_an_added_agent_is_a_peer_at_once_and_its_ranks_are_known(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    assert "a3" not in agent.ctx.ranks.peer_agents()
    with pytest.raises(ApiError):
        agent.ctx.ranks.agent_for("decode-1-tp0")
    adopted = agent.adopt(rankmap(A1, A2, A3, decode=2))
    assert (adopted.added, adopted.dropped) == (("a3",), ())
    assert "a3" in agent.ctx.ranks.peer_agents()
    assert agent.ctx.ranks.agent_for("decode-1-tp0") == "a3"
    assert agent.spec.decode.replicas == 2 and agent.rankmap.feeds == {0: (0, 1)}
    # Its per-peer series exist at zero from now on (a dashboard shows the pair before traffic).
    assert metrics.peer_bytes.labels("c", "prefill-0-tp0-cp0", "a3", "prefill")._value.get() == 0


def test_an_added_prefill_replica_is_in_range_for_a_decode_engines_receive(tmp_path: Path) -> None:
    agent = decode_agent(tmp_path, Clock())
    record_posts(agent, [])

    async def go() -> None:
        with pytest.raises(ApiError, match="outside"):
            agent.submit_receive(ReceiveRequest(D, 1, [0], [], None, 1))  # prefill replica 1: not yet
        agent.adopt(rankmap(A1, A2, P1, prefill=2))
        view = agent.submit_receive(ReceiveRequest(D, 2, [0], [], None, 1))
        assert view.state.title == RoomState.BOOTSTRAPPING.title
        await agent.close()

    asyncio.run(go())


# (id, the new map, what the refusal says)
REFUSALS = [
    ("another-cluster", rankmap(A1, A2, cluster_uid="uid-2"), "cluster uid-2"),
    ("own-pod-dropped", rankmap(A2, A3, decode=2), "no longer lists a1"),
    (
        "own-ranks-moved",
        rankmap(dataclasses.replace(A1, ranks=(Rank(Role.PREFILL, 0, 0, gpu=1),)), A2),
        "moved a1's ranks",
    ),
    ("transport-changed", rankmap(A1, A2, transport="rdma"), "transport is rdma"),
    (
        "setup-changed",
        rankmap(A1, A2, spec={**TCP_RAW, "transfer": {"transport": "tcp", "timeoutSeconds": 7}}),
        "set itself up from",
    ),
]


@pytest.mark.parametrize(("new", "why"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_a_map_the_agent_cannot_run_on_is_refused_and_the_one_in_use_stays(
    tmp_path: Path, new: RankMap, why: str
) -> None:
    agent = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    before = agent.rankmap
    with pytest.raises(MembershipRefused, match=why):
        agent.adopt(new)
    assert agent.rankmap is before and agent.ctx.ranks.peer_agents() == {"a1", "a2"}


def test_a_dropped_agent_drains_then_its_waiting_rooms_fail_saying_it_left(tmp_path: Path) -> None:
    clock = Clock()
    agent = decode_agent(tmp_path, clock)  # a2, decode-0, fed by a1 and (after the first step) p1
    record_posts(agent, [])

    async def go() -> None:
        agent.adopt(rankmap(A1, A2, P1, prefill=2))
        waiting = agent.submit_receive(ReceiveRequest(D, 7, [0], [], None, 1))  # from p1
        other = agent.submit_receive(ReceiveRequest(D, 8, [1], [], None, 0))  # from a1
        assert waiting.state.title == other.state.title == RoomState.BOOTSTRAPPING.title
        adopted = agent.adopt(rankmap(A1, A2, prefill=1))  # prefill scaled back: p1 dropped
        assert adopted.dropped == ("p1",)
        # Still a peer while it drains: its certificate is admitted, its ranks are known.
        assert "p1" in agent.ctx.ranks.peer_agents()
        assert agent.ctx.ranks.agent_for("prefill-1-tp0-cp0") == "p1"
        await agent.tick()
        assert agent.rooms.decode[(D, 7)].state is RoomState.BOOTSTRAPPING
        clock.now += agent.leave_grace_s + 0.1
        agent.rooms.decode[(D, 7)].deadline = agent.rooms.decode[(D, 8)].deadline = 1e9  # only the leave counts
        await agent.tick()
        room = agent.rooms.decode[(D, 7)]
        assert room.state is RoomState.FAILED
        assert room.reason == "agent p1 left the cluster's rank map (its replica was scaled away)"
        assert agent.rooms.decode[(D, 8)].state is RoomState.BOOTSTRAPPING  # a1's room is untouched
        assert "p1" not in agent.ctx.ranks.peer_agents()
        with pytest.raises(ApiError):
            agent.ctx.ranks.agent_for("prefill-1-tp0-cp0")
        await agent.close()

    asyncio.run(go())


def test_a_replica_scaled_away_takes_new_rooms_while_it_leaves_then_is_refused(tmp_path: Path) -> None:
    """A router that has not yet heard of a scale-down still pairs engines with the replica the new
    map dropped (seen in the live-scaling e2e: a prefill refused decode-1's room info, 'decode-1-tp0
    is not fed by prefill-1-tp0-cp0', while the status still listed decode-1). Both sides take such a
    room while that replica's agent leaves, as they drain the rooms it had open, and refuse it after."""
    clock = Clock()
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    prefill = make_agent(tmp_path / "p", "n1", [Rank(Role.PREFILL, 0, 0)])
    prefill.clock = prefill.ctx.clock = clock
    decode = decode_agent(tmp_path / "d", clock)
    record_posts(decode, [])
    record_posts(prefill, [])
    layout = PoolLayout.from_geometry(prefill.spec.model, 1, kv_pages=4, state_slots=1, aux_slots=1)

    def room_info(room: int) -> RoomInfo:
        bases = Bases(1 << 30, 2 << 30, 3 << 30)
        return RoomInfo(room, "decode-1-tp0", "prefill-0-tp0-cp0", "peer:3", layout, bases, [0], [0], 0)

    async def go() -> None:
        prefill.adopt(rankmap(A1, A2, A3, decode=2))
        prefill.adopt(rankmap(A1, A2))  # decode-1 scaled away: a3 leaving (the map feeds it no more)
        assert prefill.accept_dst(room_info(5), sender_agent="a3").early
        assert not prefill.submit_send(SendRequest(P, 5, [0], [], None, 1)).state.finished
        decode.adopt(rankmap(A1, A2, P1, prefill=2))
        decode.adopt(rankmap(A1, A2))  # prefill-1 scaled away: p1 leaving
        view = decode.submit_receive(ReceiveRequest(D, 9, [0], [], None, 1))
        assert view.state.title == RoomState.BOOTSTRAPPING.title
        clock.now += prefill.leave_grace_s + 0.1
        await prefill.tick()
        await decode.tick()
        with pytest.raises(ApiError, match="decode-1-tp0 is not fed by prefill-0-tp0-cp0"):
            prefill.accept_dst(room_info(6), sender_agent="a3")
        with pytest.raises(ApiError, match=r"outside 0\.\.0"):
            decode.submit_receive(ReceiveRequest(D, 10, [0], [], None, 1))
        with pytest.raises(ApiError, match=r"outside 0\.\.0"):
            prefill.submit_send(SendRequest(P, 6, [0], [], None, 1))
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_an_agent_back_under_a_known_name_starts_with_a_clean_record(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    agent.adopt(rankmap(A1, A2, A3, decode=2))
    agent.peers.health.fail("a3", "connection refused")
    agent.adopt(rankmap(A1, A2))  # scaled down: leaving
    adopted = agent.adopt(rankmap(A1, A2, A3, decode=2))  # and up again: a new pod of that name
    assert adopted.added == ("a3",) and not agent.ctx.ranks.leaving
    assert not agent.peers.is_blacklisted("a3")


def test_the_rankmap_file_says_a_newer_map_once_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "rankmap.json"
    first = rankmap(A1, A2)
    path.write_text(first.to_json())
    source = RankMapFile(str(path))
    assert source.rankmap == first and source.newer() is None
    second = rankmap(A1, A2, A3, decode=2)
    path.write_text(second.to_json())
    assert source.newer() == second and source.newer() is None
    path.write_text("{not json")
    assert source.newer() is None and source.rankmap == second
    path.unlink()
    assert source.newer() is None


def test_own_entry_by_pod_name_where_a_node_holds_several_pods() -> None:
    two = rankmap(AgentEntry("a1", "n1", A1.ranks), AgentEntry("a2", "n1", A2.ranks))
    assert two.own_entry("a2", "n1").name == "a2"
    with pytest.raises(LookupError, match="set POD_NAME"):
        two.own_entry("", "n1")
    with pytest.raises(LookupError, match="not 'n2'"):
        two.own_entry("a2", "n2")
    assert rankmap(A1, A2).own_entry("", "n2").name == "a2"  # one agent on the node: found by node


def test_a_failed_call_to_a_leaving_agent_says_it_is_leaving(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    agent.adopt(rankmap(A1, A2, A3, decode=2))
    agent.adopt(rankmap(A1, A2))  # decode-1 scaled away: a3 leaving
    why = agent.peers.blame("a3", "connection refused", agent.clock())
    assert why == "connection refused; a3 is leaving the cluster (its replica was scaled away)"
    assert agent.peers.blame("a2", "connection refused", agent.clock()) == "connection refused"
