"""A failed decode room's destinations go back to the pool once its sources' writes are over, not a
transfer timeout later: SGLang frees a failed request's pages and hands them to the next request
at once. Two agents wired in process (the peer messages go straight to the other's handlers):

- the decode engine aborts a room whose info waits at the prefill agent: the cancel drops that
  info, the pages are free when the abort answers, and a later send of the room fails at once
  without writing;
- the prefill engine exits, or aborts the request before sending it, while decode room info waits
  for its sends: the decode room fails at once, fenced, and its pages are free;
- a source whose write is in flight answers the cancel not fenced: the pages stay held (the 409
  says why and for how long at most) until the write returns and the source says it stopped;
- a source that never answers keeps the hold until the transfer timeout.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.peers.client import PeerRefused
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.peer_wire import DoneReport, LaunchNotice, RoomCancel, RoomInfo
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import AbortRequest, ReceiveRequest, SendRequest
from pdfabric_agent.rooms.unsent import MAX_GIVEN_UP, MAX_GIVEN_UP_REASON
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import Backend, D, P, make_agent


class GatedBackend(Backend):
    """The engine path, whose batches wait for `gate` (a write in flight)."""

    def __init__(self) -> None:
        super().__init__(kernel=False, takes=False)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        self.entered.set()
        self.gate.wait(10)
        return super().write_batch(peer, blocks)


def link(prefill: Agent, decode: Agent, *, cancels_answered: bool = True) -> list[Any]:
    """Each agent's peer posts go to the other's handler, as the peer door would hand them."""
    posts: list[Any] = []

    async def deliver(handler: Any, msg: Any) -> Any:
        posts.append(msg)
        try:
            answer = handler(msg)
            answer = await answer if asyncio.iscoroutine(answer) else answer
            return msg.read_answer(answer.to_json())  # through JSON, as the peer door hands it over
        except ApiError as exc:
            raise PeerRefused("peer", msg.PATH, exc.status, exc.reason.value, exc.message) from None

    async def to_decode(agent_name: str, msg: Any, timeout_s: float) -> Any:
        if isinstance(msg, DoneReport):
            return await deliver(lambda m: decode.accept_done(m, sender_agent="a1"), msg)
        assert isinstance(msg, LaunchNotice)
        return await deliver(lambda m: decode.accept_launched(m, sender_agent="a1"), msg)

    async def to_prefill(agent_name: str, msg: Any, timeout_s: float) -> Any:
        if isinstance(msg, RoomInfo):
            return await deliver(lambda m: prefill.accept_dst(m, sender_agent="a2"), msg)
        assert isinstance(msg, RoomCancel)
        if not cancels_answered:
            posts.append(msg)
            raise TimeoutError("no answer")
        return await deliver(lambda m: prefill.accept_cancel(m, sender_agent="a2"), msg)

    prefill.peers.post = to_decode  # type: ignore[method-assign]
    decode.peers.post = to_prefill  # type: ignore[method-assign]
    return posts


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Agent, Agent]:
    return make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)]), make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


def test_an_aborted_room_whose_info_waits_at_the_source_frees_its_pages_at_once(pair: tuple[Agent, Agent]) -> None:
    prefill, decode = pair
    posts = link(prefill, decode)
    backend = prefill.ranks[P].backend
    assert isinstance(backend, Backend)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 1, [3, 4], [1], 1, 0))
        await settle()
        assert prefill.rooms.unsent.announced((P, 1))  # the decode side was first
        await decode.abort(AbortRequest(D, 1, "aborted by SGLang"))
        assert any(isinstance(m, RoomCancel) for m in posts)
        assert not prefill.rooms.unsent.announced((P, 1))
        # Freed when the abort answered: the engine's next room takes the same destinations.
        decode.submit_receive(ReceiveRequest(D, 2, [3, 4], [1], 1, 0))
        # The prefill engine sends the given-up room late: it fails at once, nothing written.
        view = prefill.submit_send(SendRequest(P, 1, [0, 1], [0], 0, 0))
        assert (view.state.title, view.reason) == ("Failed", "decode-0-tp0 gave the room up: aborted by SGLang")
        assert backend.calls == []
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_prefill_engine_exit_fails_waiting_decode_rooms_fenced(pair: tuple[Agent, Agent]) -> None:
    prefill, decode = pair
    link(prefill, decode)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 5, [7, 8], [2], 2, 0))
        await settle()
        assert prefill.engine_exited([P], "engine prefill-0 exited (killed by signal 9)") == 1
        await settle()
        room = decode.rooms.decode[(D, 5)]
        assert room.state is RoomState.FAILED and "killed by signal 9" in room.reason
        assert room.quiet == {P}
        decode.submit_receive(ReceiveRequest(D, 6, [7, 8], [2], 2, 0))  # not 409: nothing was written
        # The restarted engine's poll of the dead one's room says Failed, not 404.
        assert (await prefill.poll(P, 5)).state.title == "Failed"
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_prefill_engine_abort_before_its_send_fails_the_decode_room_fenced(pair: tuple[Agent, Agent]) -> None:
    """SGLang aborts a request on prefill before its last chunk (nothing submitted): the decode
    room that waits for it fails at once, fenced, with the reason, and its pages are free; the
    prefill room's poll says Failed and a late send of it fails without writing."""
    prefill, decode = pair
    link(prefill, decode)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 11, [7, 8], [2], 2, 0))
        await settle()
        view = await prefill.abort(AbortRequest(P, 11, "aborted by SGLang"))
        assert (view.state.title, view.reason) == ("Failed", "aborted by SGLang")
        await settle()
        room = decode.rooms.decode[(D, 11)]
        assert room.state is RoomState.FAILED and "aborted by SGLang" in room.reason
        assert room.quiet == {P}
        decode.submit_receive(ReceiveRequest(D, 12, [7, 8], [2], 2, 0))  # the pages are free
        assert (await prefill.poll(P, 11)).state.title == "Failed"
        late = prefill.submit_send(SendRequest(P, 11, [0, 1], [0], 0, 0))
        assert (late.state.title, late.reason) == ("Failed", "aborted by SGLang")
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_prefill_abort_before_decode_announced_refuses_the_announcement(pair: tuple[Agent, Agent]) -> None:
    """The abort came before decode announced the room: the announcement is refused, so the decode
    room fails at once instead of holding its pages until its deadline."""
    prefill, decode = pair
    link(prefill, decode)

    async def go() -> None:
        await prefill.abort(AbortRequest(P, 13, "aborted by SGLang"))
        decode.submit_receive(ReceiveRequest(D, 13, [7, 8], [2], 2, 0))
        await settle()
        room = decode.rooms.decode[(D, 13)]
        assert room.state is RoomState.FAILED and "aborted by SGLang" in room.reason, room.reason
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_decode_engine_abort_before_its_receive_fails_the_prefill_room(pair: tuple[Agent, Agent]) -> None:
    """SGLang aborts a request on decode before it submitted its room (it waited for prefill):
    naming the prefill replica, the abort reaches the prefill agent, whose engine's poll of the
    room says Failed with the reason at once, and whose late send fails without writing."""
    prefill, decode = pair
    link(prefill, decode)

    async def go() -> None:
        view = await decode.abort(AbortRequest(D, 14, "aborted by SGLang", peer_replica=0))
        assert (view.state.title, view.told) == ("Failed", 1)
        await settle()
        polled = await prefill.poll(P, 14)
        assert polled.state is RoomState.FAILED and "aborted by SGLang" in polled.reason, polled
        late = prefill.submit_send(SendRequest(P, 14, [0, 1], [0], 0, 0))
        assert late.state is RoomState.FAILED
        with pytest.raises(ApiError):  # naming no replica, an unknown decode room is still 404
            await decode.abort(AbortRequest(D, 15, "aborted by SGLang"))
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_write_in_flight_holds_the_pages_until_it_returns(tmp_path: Path) -> None:
    prefill = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    decode = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    backend = GatedBackend()
    prefill.ranks[P].backend = backend
    link(prefill, decode)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 9, [3, 4], [1], 1, 0))
        await settle()
        prefill.submit_send(SendRequest(P, 9, [0, 1], [0], 0, 0))
        assert await asyncio.to_thread(backend.entered.wait, 5)
        await decode.abort(AbortRequest(D, 9, "aborted by SGLang"))
        assert prefill.rooms.prefill[(P, 9)].state is RoomState.FAILED
        with pytest.raises(ApiError) as err:
            decode.submit_receive(ReceiveRequest(D, 10, [4], [], None, 0))
        assert err.value.status == 409 and "may still be writing" in err.value.message
        assert "at most" in err.value.message
        backend.gate.set()  # the write returns; the source stops there and says so
        await settle()
        assert decode.rooms.decode[(D, 9)].quiet == {P}
        decode.submit_receive(ReceiveRequest(D, 10, [4], [], None, 0))
        # Only the batch in flight went: the room's later batches (state, aux) were never sent.
        assert len(backend.calls) == 1
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_a_source_that_does_not_answer_keeps_the_hold_until_the_transfer_timeout(pair: tuple[Agent, Agent]) -> None:
    prefill, decode = pair
    link(prefill, decode, cancels_answered=False)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 3, [5], [], None, 0))
        await settle()
        failed_at = decode.clock()
        await decode.abort(AbortRequest(D, 3, "aborted by SGLang"))
        with pytest.raises(ApiError) as err:
            decode.submit_receive(ReceiveRequest(D, 4, [5], [], None, 0))
        assert err.value.status == 409
        decode.arrivals.claims.sweep(failed_at + decode.ctx.spec.transfer.timeout_seconds - 1)
        with pytest.raises(ApiError):
            decode.submit_receive(ReceiveRequest(D, 4, [5], [], None, 0))
        decode.arrivals.claims.sweep(decode.clock() + decode.ctx.spec.transfer.timeout_seconds)
        decode.submit_receive(ReceiveRequest(D, 4, [5], [], None, 0))
        await prefill.close()
        await decode.close()

    asyncio.run(go())


def test_cancel_comes_only_from_the_decode_ranks_agent(pair: tuple[Agent, Agent]) -> None:
    prefill, _ = pair
    with pytest.raises(ApiError) as err:
        prefill.accept_cancel(RoomCancel(1, D, P, "x"), sender_agent="a1")
    assert (err.value.status, err.value.reason.value) == (403, "wrong_peer")
    with pytest.raises(ApiError) as err:
        prefill.accept_cancel(RoomCancel(1, "decode-0-tp3", P, "x"), sender_agent="a2")
    assert err.value.status in (400, 404)


def test_a_failure_report_says_fenced_as_a_boolean_and_defaults_to_not_fenced() -> None:
    head = {"room": 1, "decode_rank": D, "prefill_rank": P, "ok": False, "reason": "x"}
    assert DoneReport.parse(head).writes_over is False  # an older agent's report: assume writing
    report = DoneReport.parse({**head, "fenced": True})
    assert report.writes_over and DoneReport.parse(report.to_json()) == report
    with pytest.raises(ApiError) as err:
        DoneReport.parse({**head, "fenced": "yes"})
    assert err.value.status == 400 and "fenced" in err.value.message


def test_a_burst_of_cancels_for_rooms_that_never_come_is_remembered_bounded(pair: tuple[Agent, Agent]) -> None:
    """20,000 cancels with long reasons (issue 40: they grew an agent by 14 MB): the newest
    MAX_GIVEN_UP are remembered, each reason cut; a send of a remembered room fails at once with it."""
    prefill, _ = pair
    reason = "r" * 10_000
    for room in range(20_000):
        assert prefill.accept_cancel(RoomCancel(room, D, P, reason), sender_agent="a2").fenced
    given_up = prefill.rooms.unsent.given_up_reasons()
    assert len(given_up) == MAX_GIVEN_UP
    assert min(room for _, room in given_up) == 20_000 - MAX_GIVEN_UP  # the oldest went first
    assert all(len(why) <= MAX_GIVEN_UP_REASON for why in given_up.values())
    failed = prefill.submit_send(SendRequest(P, 19_999, [0], [], None, 0))
    assert failed.state is RoomState.FAILED and failed.reason.startswith(f"{D} gave the room up: rrr")
