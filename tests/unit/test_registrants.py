"""One live engine instance per rank (service/registrants.py): a second registration of a rank whose
registrant still follows its room feed is refused with the reason; once that engine's feed is gone
(its process exited: the connection closed), a new instance takes the rank, as a restart does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_agent.rooms import feed as feed_mod
from pdfabric_agent.rooms.feed import RoomFeed
from pdfabric_agent.service.registrants import check_registrant
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank

RANK = Rank(Role.DECODE, 0, 0, dp_rank=1)


def held(instance: str) -> SimpleNamespace:
    """A rank whose memory ``instance`` registered (the check reads only these two)."""
    return SimpleNamespace(rank=RANK, engine=object(), engine_instance=instance)


def test_a_rank_nobody_registered_is_anyones() -> None:
    check_registrant(SimpleNamespace(rank=RANK, engine=None, engine_instance=""), "b", RoomFeed())  # type: ignore[arg-type]


def test_a_second_live_instance_is_refused_with_the_reason_and_the_first_may_register_again() -> None:
    feed = RoomFeed()
    feed.subscribe(RANK.rank_id, "a")
    with pytest.raises(ApiError) as err:
        check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]
    assert (err.value.status, err.value.reason) == (409, Refusal.RANK_TAKEN)
    assert "decode-0-dp1-tp0 is registered by engine instance 'a'" in err.value.message
    assert "'b' may register it once that engine exits" in err.value.message
    check_registrant(held("a"), "a", feed)  # type: ignore[arg-type]  # its own registration again


@pytest.mark.parametrize("gone", ["closed", "unsubscribed", "never-subscribed", "other-rank"])
def test_a_registrant_whose_feed_is_gone_is_replaced(gone: str) -> None:
    """An engine restart: the previous process's connection closed (or it never followed the feed);
    the new instance's own feed does not hold the rank against it."""
    feed = RoomFeed()
    open_ = [True]
    if gone in ("closed", "unsubscribed"):
        sub = feed.subscribe(RANK.rank_id, "a", lambda: open_[0])
        open_[0] = gone != "closed"
        if gone == "unsubscribed":
            sub.close()
    if gone == "other-rank":
        feed.subscribe("decode-0-tp0", "a")  # DP group 0's feed: another rank
    feed.subscribe(RANK.rank_id, "b")
    check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]


def test_a_feed_the_agent_dropped_holds_the_rank_while_its_engine_reconnects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent drops a live engine's feed for falling behind (it closes the connection, not the
    engine): the instance still holds its rank until it subscribes again, or until RECONNECT_HOLD_S
    passed without it (its process died meanwhile)."""
    monkeypatch.setattr(feed_mod, "MAX_BACKLOG", 2)
    now = [100.0]
    feed = RoomFeed(clock=lambda: now[0])

    def drop() -> None:
        sub = feed.subscribe(RANK.rank_id, "a")
        for room in range(3):
            sub.put(RoomView(rank=RANK.rank_id, room=room, state=RoomState.TRANSFERRING))
        assert sub.dropped
        sub.close()  # the server ends the stream once the subscription says so

    drop()
    now[0] += feed_mod.RECONNECT_HOLD_S - 1
    with pytest.raises(ApiError, match="still follows its room feed"):
        check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]
    feed.subscribe(RANK.rank_id, "a").close()  # it reconnected, then its process exited: free at once
    check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]

    drop()
    now[0] += feed_mod.RECONNECT_HOLD_S
    check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]  # never came back

    sub = feed.subscribe(RANK.rank_id, "a", lambda: False)  # dropped after its connection closed
    sub.dropped = True
    sub.close()
    check_registrant(held("a"), "b", feed)  # type: ignore[arg-type]


def test_unnamed_registrants_are_one_instance_as_before() -> None:
    feed = RoomFeed()
    feed.subscribe(RANK.rank_id)
    check_registrant(held(""), "", feed)  # type: ignore[arg-type]
    with pytest.raises(ApiError, match="engine instance '\\(unnamed\\)'"):
        check_registrant(held(""), "b", feed)  # type: ignore[arg-type]


def test_the_instance_and_the_peer_dp_group_travel_on_the_wire() -> None:
    reg = MemoryRegistration.parse(
        {
            "rank": RANK.rank_id,
            "page_order": "token-major",
            "page_tokens": 16,
            "kv_page_bytes": 64,
            "k": [{"kind": "shm", "nbytes": 64, "offset": 0, "path": "/dev/shm/k"}],
            "v": [{"kind": "shm", "nbytes": 64, "offset": 0, "path": "/dev/shm/v"}],
            "state_slot_bytes": 0,
            "state": [],
            "aux_row_bytes": [],
            "aux": [],
            "instance": "host/12/ab",
        }
    )
    assert reg.instance == "host/12/ab" and MemoryRegistration.parse(reg.to_json()) == reg
    rx = ReceiveRequest(RANK.rank_id, 7, [1], [], None, 0, peer_dp=1)
    assert rx.to_json()["prefill_dp"] == 1 and ReceiveRequest.parse(rx.to_json()) == rx
    tx = SendRequest("prefill-0-tp0-cp0", 7, [1], [], None, 0)
    assert "decode_dp" not in tx.to_json() and SendRequest.parse(tx.to_json()).peer_dp == 0


def test_a_peer_dp_group_outside_the_spec_is_refused() -> None:
    from pdfabric_agent.memory.pools import PoolLayout
    from pdfabric_core.spec import parse_spec

    layout = PoolLayout.from_geometry(parse_spec({}).model, 1, kv_pages=4, state_slots=1, aux_slots=1)
    rx = ReceiveRequest(RANK.rank_id, 7, [1], [], None, 0, peer_dp=2)
    rx.check_bounds(layout, 1, 3)
    with pytest.raises(ApiError, match=r"prefill_dp 2 outside 0..1 \(the spec's dp\)"):
        rx.check_bounds(layout, 1, 2)
