"""The pre-flight link check through real agent processes and the real engine (tcp on loopback):
each prefill rank probes the decode ranks it sends to before its agent reports Ready, the results
are exported per (rank, peer agent), and a transfer.minProbeGBps the link cannot reach keeps the
agent not Ready with a reason naming the slow peer."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pdfabric_agent.runtime.metrics import peer_pairs
from pdfabric_devcluster.fabric import LocalFabric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = {"layers": 1, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4}


def spec(**transfer: Any) -> dict[str, Any]:
    return {"prefill": {"tp": 2}, "decode": {"tp": 1, "replicas": 2}, "model": MODEL, "transfer": transfer}


def probe_samples(lc: LocalFabric, name: str, metric: str) -> dict[tuple[str, str], float]:
    return {(dict(lbl)["rank"], dict(lbl)["peer"]): v for (n, lbl), v in lc.scrape(name).items() if n == metric}


def test_every_pair_is_probed_before_ready_and_exported() -> None:
    with LocalFabric(spec(transport="tcp")) as lc:
        for name in lc.agents:
            pairs = {(r, p) for r, p, role in peer_pairs(lc.rankmap, lc.spec, name) if role == "prefill"}
            gbps = probe_samples(lc, name, "pdfabric_peer_probe_bandwidth_gbps")
            latency = probe_samples(lc, name, "pdfabric_peer_probe_latency_seconds")
            assert set(gbps) == set(latency) == pairs, name  # decode agents send nothing: none
            assert all(v > 0 for v in gbps.values()) and all(0 < v < 1 for v in latency.values())
        prefill = [n for n in lc.agents if "-p" in n]
        assert prefill and all(probe_samples(lc, n, "pdfabric_peer_probe_bandwidth_gbps") for n in prefill)


def test_below_min_probe_gbps_stays_not_ready_naming_the_slow_peer() -> None:
    lc = LocalFabric(spec(transport="tcp", minProbeGBps=10000))
    try:
        lc.start(ready=False)
        decode = sorted(n for n in lc.agents if "-d" in n)
        for name in decode:  # they send nothing: nothing to probe, Ready
            lc.agents[name].wait_ready(60)
        (prefill,) = [n for n in lc.agents if "-p" in n]
        deadline = time.monotonic() + 60
        status, body = lc.readyz(prefill)
        while body.get("reason") != "ProbeBelowThreshold" and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = lc.readyz(prefill)
        assert (status, body["reason"]) == (503, "ProbeBelowThreshold"), lc.log(prefill)
        assert "below transfer.minProbeGBps 10000" in body["message"]
        assert any(f"peer {d}:" in body["message"] for d in decode), body["message"]
        gbps = probe_samples(lc, prefill, "pdfabric_peer_probe_bandwidth_gbps")
        assert gbps and all(0 < v < 10000 for v in gbps.values())
    finally:
        lc.close()
