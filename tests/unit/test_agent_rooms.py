"""The agent's room bookkeeping on a fake clock: deadlines scan only open rooms, finished rooms are
forgotten after their TTL (a newer room with the same id stays), unclaimed room info expires."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdfabric_agent.memory.plan import Bases
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.rooms.room import DecodeRoom, PrefillRoom, Target
from pdfabric_agent.rooms.unsent import MAX_GIVEN_UP, UnsentRooms
from pdfabric_agent.service.agent import Agent
from tests.unit.agents import make_agent


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    env = {"PDFABRIC_ROOM_TTL_S": "10", "PDFABRIC_BOOTSTRAP_TIMEOUT_S": "5", "PDFABRIC_HEARTBEAT_S": "1000"}
    return make_agent(tmp_path, raw={"prefill": {"tp": 1}, "decode": {"tp": 1}}, env=env, clock=Clock())


def prefill_room(agent: Agent, room: int) -> PrefillRoom:
    r = PrefillRoom(
        rank="prefill-0-tp0-cp0", room=room, submitted=agent.clock(), deadline=agent.clock() + 5,
        src_pages=[0], src_state=[], src_aux=None, targets={"decode-0-tp0": Target("decode-0-tp0", 0, "a2")},
    )  # fmt: skip
    agent.rooms.add(r)
    return r


def decode_room(agent: Agent, room: int) -> DecodeRoom:
    r = DecodeRoom(
        rank="decode-0-tp0", room=room, submitted=agent.clock(), deadline=agent.clock() + 5, dst_pages=[0],
        dst_state=[], dst_aux=None, expected={"prefill-0-tp0-cp0": "a1"},
    )  # fmt: skip
    agent.rooms.add(r)
    return r


def tick(agent: Agent, at: float) -> None:
    agent.clock.now = at  # type: ignore[attr-defined]
    asyncio.run(agent.tick())


def test_deadlines_fail_open_rooms_with_timeout(agent: Agent) -> None:
    p, d = prefill_room(agent, 1), decode_room(agent, 1)
    tick(agent, 104.9)
    assert (p.state, d.state) == (RoomState.BOOTSTRAPPING, RoomState.BOOTSTRAPPING)
    tick(agent, 105.0)
    assert (p.state, p.reason) == (RoomState.FAILED, "no room info from decode-0-tp0 in time")
    assert (d.state, d.reason) == (RoomState.FAILED, "no data from prefill-0-tp0-cp0 in time")
    assert agent.rooms.open_count == 0


def test_transferring_prefill_room_is_left_to_its_transfer_task(agent: Agent) -> None:
    p = prefill_room(agent, 2)
    p.state = RoomState.TRANSFERRING
    tick(agent, 200)
    assert p.state is RoomState.TRANSFERRING


def test_finished_rooms_are_forgotten_after_the_ttl_but_a_newer_use_stays(agent: Agent) -> None:
    old = prefill_room(agent, 3)
    agent.rooms.finish(old, RoomState.SUCCESS)
    agent.clock.now = 105  # type: ignore[attr-defined]
    new = prefill_room(agent, 3)  # the same room id used again
    agent.rooms.finish(new, RoomState.SUCCESS)
    tick(agent, 110.5)  # old is past its 10 s TTL, new is not
    assert agent.rooms.prefill[("prefill-0-tp0-cp0", 3)] is new
    tick(agent, 116)
    assert ("prefill-0-tp0-cp0", 3) not in agent.rooms.prefill


def test_unclaimed_room_info_expires(agent: Agent) -> None:
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=4, state_slots=1, aux_slots=1)
    info = RoomInfo(4, "decode-0-tp0", "prefill-0-tp0-cp0", "peer:1", layout, Bases(1, 1, 1), [0], [], None)
    agent.rooms.unsent.announce(("prefill-0-tp0-cp0", 4), info, 100.0)
    tick(agent, 104)
    assert agent.rooms.unsent.announced(("prefill-0-tp0-cp0", 4)) == {"decode-0-tp0": info}
    tick(agent, 106)
    assert not agent.rooms.unsent


def test_unsent_rooms_keep_announced_info_until_taken_and_given_up_rooms_with_their_reason(agent: Agent) -> None:
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=4, state_slots=1, aux_slots=1)

    def info(room: int, decode_rank: str) -> RoomInfo:
        return RoomInfo(room, decode_rank, "p", "peer:1", layout, Bases(1, 1, 1), [0], [], None)

    unsent = UnsentRooms()
    assert not unsent
    unsent.announce(("p", 1), info(1, "d0"), 10.0)
    unsent.announce(("p", 1), info(1, "d1"), 12.0)
    assert set(unsent.announced(("p", 1))) == {"d0", "d1"} and unsent.announced_keys({"p"}) == [("p", 1)]
    unsent.withdraw(("p", 1), "d0")
    assert set(unsent.announced(("p", 1))) == {"d1"}
    assert set(unsent.take_announced(("p", 1))) == {"d1"} and not unsent  # the send took it
    unsent.give_up(("p", 2), 20.0, "first")
    unsent.give_up(("p", 2), 21.0, "second", replace=False)
    assert unsent.given_up(("p", 2)) == "first" and unsent.keys("p") == {("p", 2)}
    unsent.announce(("p", 3), info(3, "d0"), 20.0)
    unsent.expire(30.5, 10.0)  # given up at 20.0, announced at 20.0: past the 10 s TTL
    assert not unsent
    for room in range(MAX_GIVEN_UP + 5):
        unsent.give_up(("p", room), 40.0, "why")
    assert len(unsent.given_up_reasons()) == MAX_GIVEN_UP and unsent.given_up(("p", 4)) is None  # the oldest went
    assert unsent.take_given_up(("p", MAX_GIVEN_UP + 4)) == "why" and unsent.given_up(("p", MAX_GIVEN_UP + 4)) is None
