"""The per-peer view: series per (local rank, peer agent) pair of the rank map, pre-created at
start, counted under the agent the rank map gives the other side (never a name a message carried),
and bounded by the cluster's size (docs/agent.md gives the count for a 64-rank cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_agent.rooms.targets import DecodeFailed
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.peer_series import PEERS, PeerSeries
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from tests.unit.agents import Backend, D, P, agent_per_replica, make_agent, run_room

PEER_METRICS = ("pdfabric_peer_transfer_bytes_total", "pdfabric_peer_requests_total")


def samples(cluster: str) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(metrics.REGISTRY).decode()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pdfabric_peer_") and s.labels.get("pdcluster") == cluster
    ]


def pair_series(cluster: str) -> set[tuple[str, str]]:
    """(rank, peer) of every pair with series under ``cluster``."""
    return {(lbl["rank"], lbl["peer"]) for _, lbl, _ in samples(cluster) if "rank" in lbl}


def value(name: str, **labels: str) -> float:
    return sum(v for n, lbl, v in samples(labels["pdcluster"]) if n == name and labels.items() <= lbl.items())


def test_decode_counts_a_source_under_the_rank_maps_agent_only(tmp_path: Path) -> None:
    """Agent a2 serves the decode rank; the rank map gives its one source to a1. A report from an
    agent speaking for a rank it does not host is refused and creates no series; the accepted one
    is counted under a1, whoever delivered it."""
    # Series other tests in this process left under cluster "c" (make test's workers run the unit
    # modules in another order than one process does): only what this test adds is judged.
    left = pair_series("c")
    decode = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    pre = {(lbl["rank"], lbl["peer"], lbl["role"]) for _, lbl, _ in samples("c") if "rank" in lbl}
    assert (D, "a1", "decode") in pre  # pre-created at start, from the rank map
    labels = {"pdcluster": "c", "rank": D, "peer": "a1", "role": "decode"}
    before = {n: value(n, **labels) for n in PEER_METRICS}

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 81, [3, 4], [1], 1, 0))
        report = DoneReport(81, D, P, {"mooncake": {"kv": 1024, "state": 64, "aux": 24}}, ok=True)
        with pytest.raises(ApiError):
            await decode.accept_done(report, sender_agent="intruder")
        with pytest.raises(ApiError):  # a source the room does not expect
            await decode.accept_done(DoneReport(81, D, "prefill-0-tp7-cp0", {"mooncake": {"kv": 1}}, ok=True))
        assert (await decode.accept_done(report)).state.title == "Success"  # off the peer door: no certificate
        await asyncio.sleep(0)  # counted after the answer (``later``)
        await decode.close()

    asyncio.run(go())
    after = {n: value(n, **labels) for n in PEER_METRICS}
    assert after["pdfabric_peer_transfer_bytes_total"] - before["pdfabric_peer_transfer_bytes_total"] == 1112
    assert value("pdfabric_peer_requests_total", **labels, outcome="success") >= 1
    added = pair_series("c") - left
    peers, ranks = {peer for _, peer in added}, {rank for rank, _ in added}
    assert peers <= {"a1", "a2"} and ranks <= {P, D}, (peers, ranks)


def test_a_decode_room_that_times_out_counts_each_missing_source(tmp_path: Path) -> None:
    decode = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    labels = {"pdcluster": "c", "rank": D, "peer": "a1", "role": "decode", "outcome": "timeout"}
    before = value("pdfabric_peer_requests_total", **labels)

    async def go() -> None:
        decode.submit_receive(ReceiveRequest(D, 82, [3], [], None, 0))
        decode.arrivals.expire(decode.rooms.decode[(D, 82)])
        decode.arrivals.expire(decode.rooms.decode[(D, 82)])  # one outcome: counted once
        await decode.close()

    asyncio.run(go())
    assert value("pdfabric_peer_requests_total", **labels) - before == 1


def test_prefill_counts_each_target_with_what_it_moved(tmp_path: Path) -> None:
    labels = {"pdcluster": "c", "rank": P, "peer": "a2", "role": "prefill"}
    bytes_before = value("pdfabric_peer_transfer_bytes_total", **labels)
    ok_before = value("pdfabric_peer_requests_total", **labels, outcome="success")
    _, room = run_room(tmp_path, Backend(kernel=False, takes=False), list(range(40)))
    moved = sum(room.moved.values())
    assert moved > 0
    assert value("pdfabric_peer_transfer_bytes_total", **labels) - bytes_before == moved
    assert value("pdfabric_peer_requests_total", **labels, outcome="success") - ok_before == 1
    assert value("pdfabric_peer_request_duration_seconds_count", **labels) >= 1
    # Decode answered Failed: the part failed, the bytes the engine confirmed still count.
    failed_before = value("pdfabric_peer_requests_total", **labels, outcome="failed")
    bytes_before = value("pdfabric_peer_transfer_bytes_total", **labels)
    with pytest.raises(DecodeFailed):
        run_room(tmp_path, Backend(kernel=False, takes=False), list(range(40)), answer={"state": "Failed"})
    assert value("pdfabric_peer_requests_total", **labels, outcome="failed") - failed_before == 1
    assert value("pdfabric_peer_transfer_bytes_total", **labels) - bytes_before == moved


def test_a_room_refused_for_a_blacklisted_peer_counts_its_targets_failed(tmp_path: Path) -> None:
    prefill = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    labels = {"pdcluster": "c", "rank": P, "peer": "a2", "role": "prefill", "outcome": "failed"}
    before = value("pdfabric_peer_requests_total", **labels)

    async def go() -> None:
        prefill.peers.blame("a2", "test", prefill.clock())
        assert prefill.submit_send(SendRequest(P, 83, [0], [], None, 0)).state.title == "Failed"
        await prefill.close()

    asyncio.run(go())
    assert value("pdfabric_peer_requests_total", **labels) - before == 1


def cluster_64() -> tuple[RankMap, Any]:
    """64 ranks: prefill TP8 x 4 replicas and decode TP8 x 4 replicas, one agent per 8-GPU node."""
    rankmap, spec, _ = agent_per_replica("c64", 4, 8)
    return rankmap, spec


def test_series_per_agent_in_a_64_rank_cluster_are_bounded_by_the_rank_map() -> None:
    """The figure in docs/agent.md: 8 local ranks x 4 peer agents = 32 pairs, 13 series a pair
    (bytes, 3 outcomes, a histogram of 6 buckets + +Inf + _sum + _count): 416 series per agent."""
    rankmap, spec = cluster_64()
    for entry in rankmap.agents:
        paths = {r.rank_id: ("mooncake", "mooncake") for r in entry.ranks}
        assert PEERS.publish(rankmap, spec, entry.name, "tcp", "tcp", paths) == 32
    per_agent: dict[str, int] = {}
    owner = {r.rank_id: a.name for a in rankmap.agents for r in a.ranks}
    for name, lbl, _ in samples("c64"):
        if "rank" in lbl and not name.endswith("_created") and name != "pdfabric_peer_transport_info":
            per_agent[owner[lbl["rank"]]] = per_agent.get(owner[lbl["rank"]], 0) + 1
    assert per_agent == {a.name: 416 for a in rankmap.agents}
    # Each prefill rank talks to its decode TP rank in every decode replica's agent, and back.
    pairs = metrics.peer_pairs(rankmap, spec, "prefill-0")
    assert {peer for _, peer, _ in pairs} == {f"decode-{r}" for r in range(4)}


def test_transport_in_use_per_pair_is_bounded_by_the_rank_map() -> None:
    """pdfabric_peer_transport_info: one series per pair of ``peer_pairs``, with the transport in
    use, the one asked for and the path (the kernel path only to a peer on the same node)."""
    rankmap, spec = cluster_64()
    # prefill-0 shares its node with decode-0: the same-node path for that pair only.
    entries = tuple(
        AgentEntry(a.name, "node-shared" if a.name in ("prefill-0", "decode-0") else a.node, a.ranks)
        for a in rankmap.agents
    )
    rankmap = RankMap("ns", "c64t", "uid-64t", "rdma", rankmap.spec, entries)
    prefill0 = next(a for a in entries if a.name == "prefill-0")
    paths = {r.rank_id: ("fastpath", "mooncake") for r in prefill0.ranks}
    assert PEERS.publish(rankmap, spec, "prefill-0", "rdma", "tcp", paths) == 32
    series = [lbl for n, lbl, v in samples("c64t") if n == "pdfabric_peer_transport_info" and v == 1]
    assert len(series) == 32
    assert {(s["requested"], s["transport"]) for s in series} == {("rdma", "tcp")}
    assert {s["path"] for s in series if s["peer"] == "decode-0"} == {"fastpath"}
    assert {s["path"] for s in series if s["peer"] != "decode-0"} == {"mooncake"}
    assert {(s["rank"], s["peer"]) for s in series} == {
        (r, p) for r, p, _ in metrics.peer_pairs(rankmap, spec, "prefill-0")
    }


def pairs_gauge(cluster: str, state: str) -> float:
    return value("pdfabric_peer_series_pairs", pdcluster=cluster, state=state)


def test_past_the_bound_the_most_recently_active_pairs_keep_their_series() -> None:
    """32 pairs implied, a bound of 4: none made at start; each active pair gets its series, the
    least recently active pair's go to make room (counted), and an evicted pair active again starts
    at zero. The gauge says 32 implied, 4 held."""
    rankmap, spec = cluster_64()
    rankmap = RankMap("ns", "cbound", "uid-b", "tcp", rankmap.spec, rankmap.agents)
    view = PeerSeries(limit=4)
    paths = {r.rank_id: ("mooncake", "mooncake") for r in rankmap.agents[0].ranks}
    assert view.publish(rankmap, spec, "prefill-0", "tcp", "tcp", paths) == 32
    assert pair_series("cbound") == set() and pairs_gauge("cbound", "implied") == 32
    pairs = sorted(metrics.peer_pairs(rankmap, spec, "prefill-0"))[:6]
    evicted = value("pdfabric_peer_series_evictions_total", pdcluster="cbound")
    for rank, peer, role in pairs[:4]:
        view.count("cbound", rank, peer, role, Outcome.SUCCESS, 0.01, nbytes=100)
    assert pair_series("cbound") == {(r, p) for r, p, _ in pairs[:4]}
    view.count("cbound", pairs[0][0], pairs[0][1], Role.PREFILL, Outcome.FAILED)  # the first, active again
    view.count("cbound", pairs[4][0], pairs[4][1], Role.PREFILL, Outcome.SUCCESS, 0.01, nbytes=7)
    assert pair_series("cbound") == {(r, p) for r, p, _ in (pairs[0], *pairs[2:5])}  # the second made room
    assert value("pdfabric_peer_series_evictions_total", pdcluster="cbound") - evicted == 1
    assert (pairs_gauge("cbound", "implied"), pairs_gauge("cbound", "held")) == (32, 4)
    first = {"pdcluster": "cbound", "rank": pairs[0][0], "peer": pairs[0][1], "role": "prefill"}
    assert value("pdfabric_peer_transfer_bytes_total", **first) == 100
    assert value("pdfabric_peer_requests_total", **first, outcome="failed") == 1
    view.count("cbound", pairs[1][0], pairs[1][1], Role.PREFILL, Outcome.SUCCESS, 0.01, nbytes=5)
    second = {"pdcluster": "cbound", "rank": pairs[1][0], "peer": pairs[1][1], "role": "prefill"}
    assert value("pdfabric_peer_transfer_bytes_total", **second) == 5  # from zero again
    info = [lbl for n, lbl, _ in samples("cbound") if n == "pdfabric_peer_transport_info"]
    assert len(info) == 4 and {lbl["path"] for lbl in info} == {"mooncake"}
    assert view.forget_peer(pairs[1][1]) >= 1 and (pairs[1][0], pairs[1][1]) not in pair_series("cbound")


def test_a_bound_of_zero_exports_no_per_peer_series() -> None:
    rankmap, spec = cluster_64()
    rankmap = RankMap("ns", "czero", "uid-z", "tcp", rankmap.spec, rankmap.agents)
    view = PeerSeries(limit=0)
    paths = {r.rank_id: ("mooncake", "mooncake") for r in rankmap.agents[0].ranks}
    assert view.publish(rankmap, spec, "prefill-0", "tcp", "tcp", paths) == 32
    view.count("czero", P, "decode-0", Role.PREFILL, Outcome.SUCCESS, 0.01, nbytes=100)
    assert pair_series("czero") == set() and pairs_gauge("czero", "held") == 0


def test_an_agent_of_the_largest_pdcluster_exports_a_bounded_per_peer_view() -> None:
    """Issue 47: 8,192 ranks (512 x 512 replicas of TP 8, one agent per 8-GPU node). One decode
    agent's ranks expect sources in all 512 prefill agents: 4,096 pairs, about 74,000 series (10 MB
    of /metrics) made at start unbounded. With the default bound none are made at start, and
    however many pairs carry traffic, 256 keep series."""
    rankmap, spec, entries = agent_per_replica("cmax", 512, 8, "rdma")
    view = PeerSeries()
    decode0 = entries[512]
    paths = {r.rank_id: ("mooncake", "mooncake") for r in decode0.ranks}
    assert view.publish(rankmap, spec, decode0.name, "rdma", "rdma", paths) == 4096
    assert pair_series("cmax") == set()
    for rank, peer, role in sorted(metrics.peer_pairs(rankmap, spec, decode0.name)):
        view.count("cmax", rank, peer, role, Outcome.SUCCESS, 0.01, nbytes=1)
    assert len(pair_series("cmax")) == 256 == pairs_gauge("cmax", "held")
    exported = sum(1 for _, lbl, _ in samples("cmax") if "rank" in lbl)
    assert exported == 256 * (13 + 5 + 1), exported  # 13 series a pair, 5 _created, one transport_info
