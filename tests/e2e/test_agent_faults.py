"""Failure behaviour of real agents: refused requests change nothing; a dead or frozen peer fails
its rooms within the timeout, is counted, blacklisted, re-probed, and the session recovers (on
Mooncake, and on NIXL where a case names it)."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol.views import RoomState
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.transfer import transfer_room
from tests.deadlines import wait_until
from tests.e2e.specs import BIG, FAST_RECOVERY, SMALL

# Real agent processes over the real engine; tests that start a cluster of their own are `slow`.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def small() -> Iterator[LocalFabric]:
    with LocalFabric(SMALL) as lc:
        yield lc


def raw_post(lc: LocalFabric, agent: str, path: str, data: bytes, token: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://{lc.agents[agent].address}{path}", data=data, method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


REFUSALS = [
    ("wrong-token", {"token": "x" * 32}, {}, 401, "unauthorized"),
    ("wrong-cluster", {"uid": "uid-of-another-cluster"}, {}, 403, "wrong_cluster"),
    ("pages-not-a-list", {}, {"kv_pages": "0,1"}, 400, "malformed"),
    ("missing-room", {}, {"room": None}, 400, "malformed"),
    ("room-negative", {}, {"room": -1}, 400, "out_of_range"),
    ("page-out-of-range", {}, {"kv_pages": [0, 64]}, 400, "out_of_range"),
    ("aux-out-of-range", {}, {"aux_index": 8}, 400, "out_of_range"),
    ("decode-replica-out-of-range", {}, {"decode_replica": 1}, 400, "out_of_range"),
    ("unknown-rank", {}, {"rank": "prefill-7-tp0-cp0"}, 404, "unknown_rank"),
    ("decode-rank-on-send", {}, {"rank": "decode-0-tp0"}, 404, "unknown_rank"),
]


@pytest.mark.parametrize(("case", "who", "override", "status", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_bad_send_is_refused_and_changes_nothing(
    small: LocalFabric, case: str, who: dict[str, str], override: dict[str, Any], status: int, reason: str
) -> None:
    lc = small
    agent = lc.agent_of("prefill-0-tp0-cp0")
    body: dict[str, Any] = {
        "cluster": who.get("uid", lc.uid),
        "rank": "prefill-0-tp0-cp0",
        "room": 900,
        "kv_pages": [0, 1],
        "decode_replica": 0,
        **override,
    }
    body = {k: v for k, v in body.items() if v is not None}
    refused_before = lc.metric_sum("pdfabric_api_refusals_total", reason=reason)
    bytes_before = lc.metric_sum("pdfabric_transfer_bytes_total")
    code, doc = raw_post(lc, agent, "/v1/send", json.dumps(body).encode(), who.get("token", lc.token))
    assert (code, doc["reason"]) == (status, reason), doc
    assert doc["error"]
    assert lc.metric_sum("pdfabric_api_refusals_total", reason=reason) == refused_before + 1
    assert lc.metric_sum("pdfabric_transfer_bytes_total") == bytes_before
    with pytest.raises(AgentRefused) as info:
        lc.client("prefill-0-tp0-cp0").poll("prefill-0-tp0-cp0", 900)
    assert info.value.reason == "unknown_room"


def test_a_second_fabric_is_another_cluster(small: LocalFabric) -> None:
    other = LocalFabric(SMALL)  # placed, never started: only its identity is used
    try:
        assert other.uid[:8] != small.uid[:8]  # the agents' pool file prefix
        # This cluster's token, the other cluster's uid: refused, nothing created.
        with pytest.raises(AgentRefused) as info:
            small.client("decode-0-tp0", uid=other.uid).receive("decode-0-tp0", 905, [0, 1])
        assert (info.value.status, info.value.reason) == (403, "wrong_cluster")
        with pytest.raises(AgentRefused) as info:
            small.client("decode-0-tp0").poll("decode-0-tp0", 905)
        assert info.value.reason == "unknown_room"
    finally:
        other.close()


def test_body_that_is_not_json_is_refused(small: LocalFabric) -> None:
    code, doc = raw_post(small, small.agent_of("decode-0-tp0"), "/v1/receive", b"{not json", small.token)
    assert (code, doc["reason"]) == (400, "malformed")


def test_duplicate_destination_pages_are_refused(small: LocalFabric) -> None:
    with pytest.raises(AgentRefused) as info:
        small.client("decode-0-tp0").receive("decode-0-tp0", 901, [4, 5, 4])
    assert (info.value.status, info.value.reason) == (400, "malformed")
    assert "repeat" in info.value.message


def test_done_report_for_unknown_room_is_refused(small: LocalFabric) -> None:
    body = {
        "cluster": small.uid,
        "room": 902,
        "decode_rank": "decode-0-tp0",
        "prefill_rank": "prefill-0-tp0-cp0",
        "ok": True,
    }
    code, doc = small.peer_post(
        small.agent_of("decode-0-tp0"),
        "/v1/peer/done",
        json.dumps(body).encode(),
        as_agent=small.agent_of("prefill-0-tp0-cp0"),
    )
    assert (code, doc["reason"]) == (404, "unknown_room")


def test_active_room_cannot_be_submitted_twice(small: LocalFabric) -> None:
    # Pages no other test's rooms use (the pool has 64): this room stays open until its deadline.
    small.client("decode-0-tp0").receive("decode-0-tp0", 903, [62], aux_index=6)
    with pytest.raises(AgentRefused) as info:
        small.client("decode-0-tp0").receive("decode-0-tp0", 903, [63], aux_index=7)
    assert (info.value.status, info.value.reason) == (409, "conflict")


def test_valid_room_still_succeeds_after_refusals(small: LocalFabric) -> None:
    result = transfer_room(small, 904, pages=4)
    assert result.errors == {"decode-0-tp0": []}


def prefill_outcome(lc: LocalFabric, outcome: str) -> float:
    return lc.metric_sum("pdfabric_requests_total", [lc.agent_of("prefill-0-tp0-cp0")], role="prefill", outcome=outcome)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_frozen_decode_fails_within_timeout_then_session_recovers(backend: str) -> None:
    with LocalFabric({**BIG, "backend": backend}, env={**FAST_RECOVERY, "PDFABRIC_KV_PAGES": "128"}) as lc:
        prefill, decode = "prefill-0-tp0-cp0", "decode-0-tp0"
        pages = list(range(128))
        lc.client(decode).receive(decode, 1, pages)
        # The decode agent's room info must be at the prefill agent before it freezes.
        wait_until(
            lambda: lc.client(decode).poll(decode, 1).state.title == "WaitingForInput",
            timeout=5,
            what="room info delivered",
        )
        lc.kill(lc.agent_of(decode), signal.SIGSTOP)
        sent_at = time.monotonic()
        lc.client(prefill).send(prefill, 1, pages)
        wait_until(
            lambda: lc.client(prefill).poll(prefill, 1).state.title == "Failed",
            timeout=3 + 2,
            what="frozen peer fails room",
        )
        failed_after = time.monotonic() - sent_at
        view = lc.client(prefill).poll(prefill, 1)
        assert "did not complete within 3 s" in view.reason
        assert failed_after <= 3 + 2
        assert prefill_outcome(lc, "timeout") == 1
        # Bytes counted are only confirmed batches: less than the room, never more.
        assert view.moved["kv"] < 128 * 4 * 2 * 32 * 1024
        # While blacklisted, new rooms to that peer fail at once instead of hanging.
        lc.client(prefill).send(prefill, 2, [0])
        assert lc.client(prefill).wait(prefill, 2, 2).reason.startswith("peer agent")
        assert prefill_outcome(lc, "failed") == 1

        lc.kill(lc.agent_of(decode))  # SIGKILL the frozen process, then bring the peer back
        lc.start(lc.agent_of(decode))
        wait_until(
            lambda: lc.metric_sum("pdfabric_session_recoveries_total") >= 1, timeout=10, what="probe re-admits the peer"
        )
        assert lc.metric_sum("pdfabric_peers_blacklisted") == 0
        result = transfer_room(lc, 3, pages=16)
        assert result.errors == {decode: []}
        assert prefill_outcome(lc, "success") == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_killed_decode_fails_fast_and_is_counted(backend: str) -> None:
    """A restarted decode agent is a new engine (NIXL: a new agent and metadata, loaded again)."""
    with LocalFabric({**SMALL, "backend": backend}, env=FAST_RECOVERY) as lc:
        prefill, decode = "prefill-0-tp0-cp0", "decode-0-tp0"
        lc.client(decode).receive(decode, 5, [0, 1, 2])
        wait_until(
            lambda: lc.client(decode).poll(decode, 5).state.title == "WaitingForInput",
            timeout=5,
            what="room info delivered",
        )
        lc.kill(lc.agent_of(decode))
        lc.client(prefill).send(prefill, 5, [3, 4, 5])
        view = lc.client(prefill).wait(prefill, 5, 3 + 2)
        assert view.state is RoomState.FAILED
        assert prefill_outcome(lc, "failed") + prefill_outcome(lc, "timeout") == 1
        lc.start(lc.agent_of(decode))
        wait_until(
            lambda: lc.metric_sum("pdfabric_session_recoveries_total") >= 1, timeout=10, what="probe re-admits the peer"
        )
        assert transfer_room(lc, 6, pages=3).errors == {decode: []}


@pytest.mark.slow
def test_dead_prefill_fails_decode_room_at_its_deadline() -> None:
    with LocalFabric(SMALL, env=FAST_RECOVERY) as lc:
        decode = "decode-0-tp0"
        lc.client(decode).receive(decode, 7, [0, 1])
        wait_until(
            lambda: lc.client(decode).poll(decode, 7).state.title == "WaitingForInput",
            timeout=5,
            what="room info delivered",
        )
        lc.kill(lc.agent_of("prefill-0-tp0-cp0"))
        view = lc.client(decode).wait(decode, 7, 3 + 2)
        assert view.state is RoomState.FAILED
        assert "no data from prefill-0-tp0-cp0" in view.reason
        assert lc.metric_sum("pdfabric_requests_total", [lc.agent_of(decode)], role="decode", outcome="timeout") == 1


def test_prefill_sees_waiting_for_input_once_decode_announced(small: LocalFabric) -> None:
    lc, p, d = small, "prefill-0-tp0-cp0", "decode-0-tp0"
    with pytest.raises(AgentRefused):
        lc.client(p).poll(p, 906)
    lc.client(d).receive(d, 906, [40])

    def prefill_state() -> str:
        try:
            return lc.client(p).poll(p, 906).state.title
        except AgentRefused:  # the decode agent's announcement is still on its way
            return ""

    wait_until(lambda: prefill_state() == "WaitingForInput", timeout=5, what="prefill sees decode ready")
    assert lc.client(p).poll(p, 906).decode_ranks_ready == (d,)
    lc.client(p).send(p, 906, [41])
    assert lc.client(p).wait(p, 906, 10).state.title == "Success"


def test_send_before_receive_waits_in_bootstrapping_then_succeeds(small: LocalFabric) -> None:
    from pdfabric_devcluster.synthetic import fill_prefill, verify_decode

    lc, p, d = small, "prefill-0-tp0-cp0", "decode-0-tp0"
    pools = lc.client(p).map_pools(p)
    try:
        fill_prefill(pools, lc.spec, tp_rank=0, room=905, positions=range(3), pages=[7, 8, 20])
    finally:
        pools.close()
    assert lc.client(p).send(p, 905, [7, 8, 20]).state.title == "Bootstrapping"
    assert lc.client(p).poll(p, 905, wait_s=0.3).state.title == "Bootstrapping"  # nothing to send to yet
    lc.client(d).receive(d, 905, [30, 31, 32])
    assert lc.client(d).wait(d, 905, 10).state.title == "Success"
    assert lc.client(p).wait(p, 905, 10).state.title == "Success"
    pools = lc.client(d).map_pools(d)
    try:
        assert verify_decode(pools, lc.spec, tp_rank=0, room=905, pages=[30, 31, 32]) == []
    finally:
        pools.close()


@pytest.mark.slow
def test_prefill_room_without_decode_fails_at_the_bootstrap_deadline() -> None:
    with LocalFabric(SMALL, env=FAST_RECOVERY) as lc:
        p = "prefill-0-tp0-cp0"
        start = time.monotonic()
        lc.client(p).send(p, 9, [0])
        view = lc.client(p).wait(p, 9, 3 + 2)
        assert view.state is RoomState.FAILED
        assert view.reason == "no room info from decode-0-tp0 in time"
        assert time.monotonic() - start <= 3 + 2
        assert prefill_outcome(lc, "timeout") == 1


@pytest.mark.slow
def test_missed_heartbeats_fail_decode_rooms_long_before_the_deadline() -> None:
    env = {**FAST_RECOVERY, "PDFABRIC_BOOTSTRAP_TIMEOUT_S": "60", "PDFABRIC_HEARTBEAT_S": "0.3"}
    with LocalFabric(SMALL, env=env) as lc:
        decode = "decode-0-tp0"
        lc.client(decode).receive(decode, 8, [0, 1])
        wait_until(
            lambda: lc.client(decode).poll(decode, 8).state.title == "WaitingForInput",
            timeout=5,
            what="room info delivered",
        )
        lc.kill(lc.agent_of("prefill-0-tp0-cp0"))
        start = time.monotonic()
        view = lc.client(decode).wait(decode, 8, 10)
        assert view.state is RoomState.FAILED
        assert view.reason == f"prefill agent {lc.agent_of('prefill-0-tp0-cp0')} stopped answering"
        # Two missed heartbeats 0.3 s apart (each ping may wait up to 0.3 s), far from the 60 s deadline.
        assert time.monotonic() - start < 3
        assert lc.metric_sum("pdfabric_requests_total", [lc.agent_of(decode)], role="decode", outcome="failed") == 1


def test_latency_runs_from_submit_to_the_decode_acknowledgement(small: LocalFabric) -> None:
    lc, p = small, "prefill-0-tp0-cp0"
    agent = [lc.agent_of(p)]
    count = lc.metric_sum("pdfabric_request_duration_seconds_count", agent, role="prefill")
    total = lc.metric_sum("pdfabric_request_duration_seconds_sum", agent, role="prefill")
    view = transfer_room(lc, 907, pages=4).prefill[p]
    assert lc.metric_sum("pdfabric_request_duration_seconds_count", agent, role="prefill") == count + 1
    observed = lc.metric_sum("pdfabric_request_duration_seconds_sum", agent, role="prefill") - total
    phases = view.phases_s
    # Not from the last chunk (upstream #31993): the observation covers the writes and the ack.
    assert phases["transferring"] <= phases["written:decode-0-tp0"] <= phases["acknowledged:decode-0-tp0"]
    assert observed >= phases["acknowledged:decode-0-tp0"]


def test_done_report_cannot_write_outside_the_rooms_aux_row(small: LocalFabric) -> None:
    import base64

    lc, d = small, "decode-0-tp0"
    lc.client(d).receive(d, 908, [50], aux_index=2)
    wait_until(
        lambda: lc.client(d).poll(d, 908).state.title == "WaitingForInput", timeout=5, what="room info delivered"
    )
    pools = lc.client(d).map_pools(d)
    try:
        before = bytes(pools.aux[:])
        body = {
            "cluster": lc.uid,
            "room": 908,
            "decode_rank": d,
            "prefill_rank": "prefill-0-tp0-cp0",
            "ok": True,
            "bytes_by_path": {},
            "aux_rows": [[0, base64.b64encode(b"X" * 8).decode()]],  # item 0 of row 0, not row 2
        }
        code, doc = lc.peer_post(
            lc.agent_of(d), "/v1/peer/done", json.dumps(body).encode(), as_agent=lc.agent_of("prefill-0-tp0-cp0")
        )
        assert (code, doc["reason"]) == (400, "out_of_range")
        assert bytes(pools.aux[:]) == before
        assert lc.client(d).poll(d, 908).state.title == "WaitingForInput"
    finally:
        pools.close()
