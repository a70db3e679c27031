"""The room feed (GET /v1/events/{rank}) through real agents: an engine rank's table, kept by one
long-lived connection, says what a poll says (the decode side's announcement, each outcome, a
failed room's quiet sources), survives an agent restart by resynchronising (the rooms the agent
lost read Failed), and refuses what it cannot serve with a 4xx and a reason."""

from __future__ import annotations

import http.client
import json
import signal
from collections.abc import Iterator

import pytest

from pdfabric_agent.client.feed import LOST, RoomEvents
from pdfabric_agent.protocol.views import RoomState
from pdfabric_devcluster.fabric import LocalFabric
from tests.deadlines import wait_until

pytestmark = [pytest.mark.e2e]

SPEC = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 5},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "auxRowBytes": [16, 8]},
}
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


@pytest.fixture(scope="module")
def lc() -> Iterator[LocalFabric]:
    with LocalFabric(SPEC, env={"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "4"}) as fabric:
        yield fabric


def feed(lc: LocalFabric, rank: str) -> RoomEvents:
    events = RoomEvents(lc.agents[lc.agent_of(rank)].address, lc.token, rank).start(wait_s=10)
    assert events.synced.is_set(), f"no snapshot from {lc.agent_of(rank)}"
    return events


def test_the_feed_says_what_a_poll_says(lc: LocalFabric) -> None:
    pf, df = feed(lc, P), feed(lc, D)
    try:
        assert lc.metric_sum("pdfabric_room_feed_subscribers") == 2  # one per engine rank, on its agent
        assert pf.hello is not None and pf.hello.sends and pf.view(11) is None  # nothing said of room 11
        lc.client(D).receive(D, 11, [1, 2], state_indices=[], aux_index=0)
        early = wait_until(lambda: pf.view(11), timeout=5, what="decode's announcement on the prefill feed")
        assert (early.state, early.decode_ranks_ready) == (RoomState.WAITING_FOR_INPUT, (D,))
        assert early == lc.client(P).poll(P, 11)
        lc.client(P).send(P, 11, [5, 6], aux_index=1)
        for events, rank in ((pf, P), (df, D)):
            done = wait_until(lambda ev=events: (v := ev.view(11)) and v.finished and v, timeout=10, what=f"{rank}")
            assert done.state is RoomState.SUCCESS and done == lc.client(rank).poll(rank, 11)
            assert sum(done.moved.values()) > 0
    finally:
        pf.close()
        df.close()
    wait_until(lambda: lc.metric_sum("pdfabric_room_feed_subscribers") == 0, timeout=10, what="the feeds' ends counted")


def test_a_failed_rooms_quiet_sources_reach_the_decode_feed(lc: LocalFabric) -> None:
    """A decode room given up before its prefill sent: Failed at once, and once its source said
    nothing of it will land (it never started), the feed says its sources are quiet."""
    df = feed(lc, D)
    try:
        lc.client(D).receive(D, 12, [3], aux_index=0)
        lc.client(D).abort(D, 12, "the request was cancelled")
        quiet = wait_until(
            lambda: (v := df.view(12)) and v.finished and v.sources_quiet and v, timeout=5, what="quiet sources"
        )
        assert quiet.state is RoomState.FAILED and "cancelled" in quiet.reason
        # The prefill side learnt it too: its feed's snapshot holds the room as given up.
        pf = feed(lc, P)
        try:
            assert pf.view(12) is not None and pf.view(12).state is RoomState.FAILED  # type: ignore[union-attr]
        finally:
            pf.close()
    finally:
        df.close()


def test_after_an_agent_restart_the_feed_resynchronises_and_lost_rooms_read_failed(lc: LocalFabric) -> None:
    df = feed(lc, D)
    try:
        lc.client(D).receive(D, 13, [4], aux_index=1)
        df.put(lc.client(D).poll(D, 13))  # as a submit's answer would
        assert df.view(13) is not None and not df.view(13).finished  # type: ignore[union-attr]
        name = lc.agent_of(D)
        lc.kill(name, signal.SIGKILL)
        wait_until(lambda: not df.synced.is_set(), timeout=10, what="the feed noticing the agent is gone")
        lc.start(name)
        wait_until(df.synced.is_set, timeout=15, what="the feed resynchronised")
        lost = df.view(13)
        assert lost is not None and (lost.state, lost.reason) == (RoomState.FAILED, LOST)
        assert df.reconnects >= 1
    finally:
        df.close()


@pytest.mark.parametrize(
    ("path", "token", "status", "reason"),
    [
        (f"/v1/events/{D}", "wrong", 401, "unauthorized"),
        ("/v1/events/decode-7-tp0", None, 404, "unknown_rank"),
    ],
)
def test_the_feed_refuses_with_a_reason(
    lc: LocalFabric, path: str, token: str | None, status: int, reason: str
) -> None:
    host, port = lc.agents[lc.agent_of(D)].address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token or lc.token}"})
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())["reason"]) == (status, reason)
    finally:
        conn.close()
