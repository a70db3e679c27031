"""What the agent takes from a peer, checked before it changes anything: the speaker is the agent
the rank map gives the rank it speaks for; room info comes once per target, in the layout the spec
gives that decode rank; byte reports name only known paths; a room id names one request."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Bases
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.peer_answers import RoomInfoTaken
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_agent.service.agent import Agent
from pdfabric_agent.transfer.registry import path_labels
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import D, P, make_agent, room_info


@pytest.fixture
def prefill(tmp_path: Path) -> Agent:
    return make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])


@pytest.fixture
def decode(tmp_path: Path) -> Agent:
    return make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])


def refused(call: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        call()
    return err.value


async def refused_async(coro: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        await coro
    return err.value


def test_room_info_from_an_agent_that_does_not_host_the_decode_rank_is_refused(prefill: Agent) -> None:
    err = refused(lambda: prefill.accept_dst(room_info(1), sender_agent="a1"))
    assert (err.status, err.reason) == (403, "wrong_peer") and "gives agent a2" in err.message
    assert prefill.accept_dst(room_info(1), sender_agent="a2") == RoomInfoTaken(early=True)


def test_reports_from_an_agent_that_does_not_host_the_source_are_refused(decode: Agent) -> None:
    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 2, [3, 4], [1], 1, 0))
        report = DoneReport(2, D, P, {"mooncake": {"kv": 1}}, ok=True)
        err = await refused_async(decode.accept_done(report, sender_agent="a2"))
        assert (err.status, err.reason) == (403, "wrong_peer")
        assert decode.rooms.decode[(D, 2)].arrived == set()
        await decode.close()

    asyncio.run(go())


def test_byte_reports_name_only_known_paths(decode: Agent) -> None:
    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 3, [3, 4], [1], 1, 0))
        report = DoneReport(3, D, P, {"invented-path-7": {"kv": 1}}, ok=True)
        err = await refused_async(decode.accept_done(report, sender_agent="a1"))
        assert (err.status, err.reason) == (400, "malformed") and "invented-path-7" in err.message
        await decode.close()

    asyncio.run(go())
    assert {"mooncake", "mori", "nvlink-kernel"} <= path_labels()


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"local_heads": 1}, "local_heads 1 (expected 2)"),
        ({"head_bytes": 32}, "head_bytes 32 (expected 64)"),
        ({"layers": 3}, "layers 3 (expected 2)"),
    ],
    ids=["heads", "head-bytes", "layers"],
)
def test_room_info_in_a_layout_the_spec_does_not_give_is_refused(
    prefill: Agent, changes: dict[str, Any], what: str
) -> None:
    info = room_info(4)
    bad = dataclasses.replace(info, layout=dataclasses.replace(info.layout, **changes))
    err = refused(lambda: prefill.accept_dst(bad))
    assert err.status == 400 and what in err.message, err.message


def test_decode_aux_rows_unlike_this_ranks_fail_the_room_when_it_starts(prefill: Agent) -> None:
    """The aux rows are the engines' own (registered): decode's must equal this prefill rank's.
    Room info may come before this rank's engine registered (again, after an agent restart), so
    the room checks them when it starts, and fails naming both."""

    async def go() -> None:
        info = room_info(6)
        bad = dataclasses.replace(info, layout=dataclasses.replace(info.layout, aux_items=(8, 8)))
        assert prefill.accept_dst(bad, sender_agent="a2").early  # kept for the send
        view = prefill.submit_send(SendRequest(P, 6, [0, 1], [0], 0, 0))
        assert view.state is RoomState.FAILED
        assert "aux rows of decode-0-tp0 are [8, 8] bytes, prefill-0-tp0-cp0's [8, 16]" in view.reason
        await prefill.close()

    asyncio.run(go())


def test_second_room_info_for_a_target_cannot_redirect_the_room(prefill: Agent) -> None:
    async def go() -> None:
        prefill.submit_send(SendRequest(P, 5, [0, 1], [0], 0, 0))
        prefill.accept_dst(room_info(5))  # the room starts (its task fails on the stub pools: no matter)
        err = refused(lambda: prefill.accept_dst(room_info(5, bases=Bases(5 << 30, 6 << 30, 7 << 30))))
        assert (err.status, err.reason) == (409, "conflict")
        await prefill.close()

    asyncio.run(go())


def test_a_room_id_names_one_request(decode: Agent) -> None:
    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 6, [3], [], None, 0))
        room = decode.rooms.decode[(D, 6)]
        decode.rooms.finish(room, room.state.SUCCESS)
        err = refused(lambda: decode.submit_receive(ReceiveRequest(D, 6, [5], [], None, 0)))
        assert (err.status, err.reason) == (409, "conflict") and "already ended Success" in err.message
        await decode.close()

    asyncio.run(go())


def test_a_report_must_carry_exactly_what_the_room_planned_from_that_source(decode: Agent) -> None:
    """2 pages x 2 layers x K/V x 128 B, one 64 B state slot, one 24 B aux row: a report of
    anything else (10^15 KV bytes, a missing kind) is refused and the room keeps waiting."""
    owed = {"kv": 1024, "state": 64, "aux": 24}

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 7, [3, 4], [1], 1, 0))
        room = decode.rooms.decode[(D, 7)]
        assert room.owed == {P: owed}
        for wrong in ({"kv": 10**15, "state": 64, "aux": 24}, {"kv": 1024, "state": 64}):
            err = await refused_async(decode.accept_done(DoneReport(7, D, P, {"mooncake": wrong}, ok=True)))
            assert (err.status, err.reason) == (400, "out_of_range") and "expects" in err.message
            assert room.state.title == "Bootstrapping" and not room.arrived
        split = {"mooncake": {"kv": 1024, "state": 64}, "tcp-side-channel": {"aux": 24}}
        assert (await decode.accept_done(DoneReport(7, D, P, split, ok=True))).state.title == "Success"
        assert room.moved == owed
        await decode.close()

    asyncio.run(go())
