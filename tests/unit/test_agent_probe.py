"""The link check's pure parts: a peer's description is clamped to the probe size and must be
well formed; the verdict names the slowest pair first."""

from __future__ import annotations

import time

import pytest

from pdfabric_agent.node import probe
from pdfabric_agent.node.probe import PROBE_BYTES, LinkCheck, Region, Result, parse_regions, spread
from tests.unit.agents import agent_per_replica


def test_a_peers_region_is_clamped_and_checked() -> None:
    got = parse_regions({"ranks": {"decode-0-tp0": {"endpoint": "h:1", "addr": 4096, "size": 1 << 40}}})
    assert got == {"decode-0-tp0": Region("h:1", 4096, PROBE_BYTES)}  # a peer cannot make us write more
    for bad in ({}, {"ranks": []}, {"ranks": {"r": {"endpoint": "h:1", "addr": "0", "size": 1}}}):
        with pytest.raises(ValueError):
            parse_regions(bad)


def test_verdict_names_the_slowest_peer_first() -> None:
    check = LinkCheck.__new__(LinkCheck)
    check.threshold = 5.0
    check.results = {
        ("p0", "d0"): Result("p0", "d0", 7.0, 0.001),
        ("p0", "d1"): Result("p0", "d1", 2.0, 0.001),
        ("p1", "d1"): Result("p1", "d1", 0.0, None, "ClientError: refused"),
    }
    assert [r.peer for r in check.slow()] == ["d1", "d1"]
    assert check.verdict() == (
        "link check below transfer.minProbeGBps 5: rank p1 -> peer d1: probe failed (ClientError: refused); "
        "rank p0 -> peer d1: 2 GB/s"
    )
    check.threshold = 0.0
    assert check.slow() == []


def test_peers_that_refuse_this_agents_certificate_are_named_until_they_admit_it() -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from pdfabric_agent.peers.client import PeerRefused

    check = LinkCheck.__new__(LinkCheck)
    check.cluster, check.threshold, check.backends, check.regions = "c", 0.0, {}, {}
    check.targets = [("prefill-0-tp0-cp0", "d1", "decode-1-tp0")]
    check.measured = frozenset({"d1"})
    check.results, check.refused = {}, {}
    told: list[str] = []
    answers: list[Exception] = [PeerRefused("d1", "/v1/peer/probe", 403, "unauthorized", "not in the rank map")] * 3

    async def fetch(peer: str) -> dict[str, object]:
        raise answers.pop(0) if answers else ValueError("no ranks")

    async def go() -> None:
        with ThreadPoolExecutor(1) as pool:
            await check.run(fetch, pool, discover_s=0.8, waiting=told.append)
            assert set(check.refused) == {"d1"} and "HTTP 403" in check.refused["d1"]
            assert told and told[0].startswith("link check: 1 of 1 peer agents not answering yet; d1: PeerRefused")
            assert check.refusals().startswith("1 peer agents refuse this agent (their rank map does not list it yet)")
            await check.run(fetch, pool, discover_s=0, only={"d1"})  # it answers now (here: malformed)
            assert check.refused == {}

    asyncio.run(go())


def test_a_ranks_transfer_metadata_travels_with_its_probe_region_and_bad_metadata_is_refused() -> None:
    """A backend that needs its peer's metadata (NIXL) finds it in the probe description, encoded
    and read as the metadata route's answer is."""
    body = {"ranks": {"d0": {"endpoint": "n#e", "addr": 4096, "size": 64, "metadata": "AAEC"}}}
    assert parse_regions(body)["d0"].metadata == b"\x00\x01\x02"
    assert parse_regions({"ranks": {"d0": {"endpoint": "n#e", "addr": 1, "size": 1}}})["d0"].metadata is None
    for bad, why in (("@@@", "not base64"), (7, "must be strings")):
        body["ranks"]["d0"]["metadata"] = bad
        with pytest.raises(ValueError, match=why):
            parse_regions(body)


def test_the_agents_spread_their_writes_over_every_peer() -> None:
    """512 decode agents, 16 written to by each of 512 prefill agents (offsets 0..511): each peer
    is written to by 16 of them, none left out; with fewer peers than the bound, all of them."""
    peers = [f"decode-{i:03d}" for i in range(512)]
    chosen = [spread(peers, offset, 16) for offset in range(512)]
    assert {len(c) for c in chosen} == {16}
    times = {peer: sum(peer in c for c in chosen) for peer in peers}
    assert set(times.values()) == {16}
    assert spread(peers[:5], 3, 16) == frozenset(peers[:5])


def largest_check(max_peers: int = probe.MAX_PEERS) -> LinkCheck:
    """A prefill agent of the largest PDCluster the CRD admits (512 x 512 replicas of TP 8)."""
    rankmap, spec, entries = agent_per_replica("cmax-probe", 512, 8, "rdma")
    local = {r.rank_id: object() for r in entries[7].ranks}  # measure() is replaced where they are used
    return LinkCheck(rankmap, spec, "prefill-7", local, local, max_peers)  # type: ignore[arg-type]


def test_a_prefill_agent_of_the_largest_pdcluster_asks_every_peer_and_writes_to_16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 47: 4,096 peer ranks in 512 agents; every agent is asked for its regions (it must
    answer and admit this one), the writes go to 16 agents' ranks: 128 pairs, not 4,096."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    check = largest_check()
    assert len(check.targets) == 4096 and len(check.measured) == 16 and check.measured_pairs == 128
    asked: list[str] = []
    written: list[str] = []

    at_once = [0, 0]  # now, most

    async def fetch(peer: str) -> dict[str, object]:
        asked.append(peer)
        at_once[0] += 1
        at_once[1] = max(at_once)
        await asyncio.sleep(0.01)  # a GET with its TLS handshake
        at_once[0] -= 1
        ranks = {t[2]: {"endpoint": f"{peer}:1", "addr": 0, "size": PROBE_BYTES} for t in check.targets if t[1] == peer}
        return {"ranks": ranks}

    def measure(backend: object, src: object, region: Region) -> tuple[float, float]:
        written.append(region.endpoint.split(":")[0])
        return 10.0, 0.001

    monkeypatch.setattr(probe, "measure", measure)

    async def go() -> float:
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            await check.run(fetch, pool, discover_s=0)
        return time.monotonic() - started

    took = asyncio.run(go())
    # 16 asked at a time: 32 rounds of 10 ms, not 512 in a row (5 s).
    assert at_once[1] == probe.ASK_CONCURRENCY and took < 3.0, (at_once, took)
    assert len(set(asked)) == 512 and set(written) == check.measured and len(written) == 128
    assert len(check.results) == 128 and "with 16 of 512 peer agents" in check.summary()
