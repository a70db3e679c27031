"""The agent's room feed (rooms/feed.py): views reach the subscribers of their rank only, a
subscriber that falls MAX_BACKLOG views behind is dropped instead of buffered without bound, and
an engine-side table (client/feed.py) keeps an end final and marks rooms a restarted agent lost."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from pdfabric_agent.client.feed import LOST, RoomEvents
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.views import FeedHello, RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest
from pdfabric_agent.rooms import feed as feed_mod
from pdfabric_agent.rooms.feed import RoomFeed
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import make_agent

P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


def view(room: int, state: RoomState = RoomState.TRANSFERRING, rank: str = D) -> RoomView:
    return RoomView(rank=rank, room=room, state=state)


def test_views_reach_their_ranks_subscribers_in_order_and_a_quiet_feed_times_out() -> None:
    async def go() -> None:
        feed = RoomFeed()
        mine, other = feed.subscribe(D), feed.subscribe(P)
        assert feed.watched(D) and feed.subscribers() == 2
        feed.publish(view(1))
        feed.publish(view(1, RoomState.SUCCESS))
        assert [await mine.next(1.0), await mine.next(1.0)] == [view(1), view(1, RoomState.SUCCESS)]
        with pytest.raises(TimeoutError):
            await other.next(0.05)
        mine.close()
        assert not feed.watched(D)
        feed.publish(view(2))  # nobody listens: nothing kept
        assert mine.backlog == 0

    asyncio.run(go())


def test_a_subscriber_that_falls_behind_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feed_mod, "MAX_BACKLOG", 4)

    async def go() -> None:
        feed = RoomFeed()
        sub = feed.subscribe(D)
        for room in range(6):
            feed.publish(view(room))
        assert sub.dropped and sub.backlog == 1 and await sub.next(0.1) is None  # ends: resync

    asyncio.run(go())


def test_the_engines_table_keeps_an_end_final_and_marks_what_a_restarted_agent_lost() -> None:
    table = RoomEvents("127.0.0.1:1", "t", D)  # not started: the test feeds it
    table.put(view(1, RoomState.SUCCESS))
    table.put(view(1, RoomState.TRANSFERRING))  # late, from before the end
    assert table.view(1) == view(1, RoomState.SUCCESS)
    table.put(view(2))
    table.put(view(3))
    with table._lock:
        table._lost_since(started=float("inf"), seen={3})  # a resync whose snapshot has only room 3
    lost = table.view(2)
    assert lost is not None and (lost.state, lost.reason) == (RoomState.FAILED, LOST)
    assert table.view(3) == view(3) and table.view(1) == view(1, RoomState.SUCCESS)
    table.forget(1)
    assert table.view(1) is None and len(table) == 2


def test_closing_the_engines_table_ends_its_read_at_once() -> None:
    """An engine stops its ranks' feeds on shutdown: close() returns without waiting for the
    agent's next heartbeat (a feed that says nothing for a while)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def agent() -> None:  # answers the feed's GET as the agent streams it (chunked), then is quiet
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(65536)
        body = json.dumps(FeedHello(rank=D, sends=True).to_json()).encode() + b"\n\n"  # hello, snapshot end
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(head + b"%x\r\n" % len(body) + body + b"\r\n")

    server = threading.Thread(target=agent, daemon=True)
    server.start()
    events = RoomEvents(f"127.0.0.1:{listener.getsockname()[1]}", "token", D).start(wait_s=5.0)
    try:
        assert events.synced.is_set()
        started = time.monotonic()
        events.close()
        assert time.monotonic() - started < 0.5
        assert not events._thread.is_alive()
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def test_a_rank_that_sends_nothing_answers_every_room_at_once() -> None:
    hello = FeedHello(P, sends=False, reason="TP rank 1's KV heads are replicated")
    assert FeedHello.parse(hello.to_json()) == hello
    early = hello.view_of(42)
    assert early is not None and (early.state, early.sends, early.room) == (RoomState.WAITING_FOR_INPUT, False, 42)
    assert FeedHello(P).view_of(42) is None


def test_the_engines_feed_has_a_rooms_end_before_the_source_has_its_answer(tmp_path: Path) -> None:
    """The done report that completes a decode room: the feed of the room's engine rank (on the
    request's critical path) takes the Success view before the source's answer is made."""
    decode = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    order: list[str] = []

    async def go() -> None:
        sub = decode.ctx.feed.subscribe(D)

        async def engine() -> None:
            while True:
                view = await sub.next(5.0)
                if view is not None and view.room == 81 and view.finished:
                    order.append(f"feed {view.state.name}")
                    return

        reader = asyncio.ensure_future(engine())
        decode.submit_receive(ReceiveRequest(D, 81, [3, 4], [1], 1, 0))
        report = DoneReport(81, D, P, {"mooncake": {"kv": 1024, "state": 64, "aux": 24}}, ok=True)
        answer = await decode.accept_done(report)
        order.append(f"answer {answer.state.name}")
        await asyncio.wait_for(reader, 5)
        await decode.close()

    asyncio.run(go())
    assert order == ["feed SUCCESS", "answer SUCCESS"]


def test_a_changed_view_wakes_who_waits_for_one() -> None:
    """``RoomEvents.wait_change``: an engine step with nothing to compute waits on the table for a
    room's news, woken by the next change, never longer than it asked."""
    import threading
    import time as _time

    from pdfabric_agent.client.feed import RoomEvents
    from pdfabric_agent.protocol.views import RoomState, RoomView

    events = RoomEvents("127.0.0.1:1", "token", "decode-0-tp0")
    started = _time.monotonic()
    assert not events.wait_change(0.05) and _time.monotonic() - started >= 0.05
    timer = threading.Timer(0.05, events.put, [RoomView(rank="decode-0-tp0", room=3, state=RoomState.SUCCESS)])
    timer.start()
    started = _time.monotonic()
    assert events.wait_change(5.0) and _time.monotonic() - started < 2.0
    assert not events.wait_change(0.0)  # seen: the next wait is for the next change
    timer.join()
