"""One real agent of the largest PDCluster the CRD admits, with and without its fleet bounds (issue 47).

Run: ``python benchmarks/bench_agent_fleet.py [--replicas 512] [--tp 8]``.

The PDCluster: ``--replicas`` prefill and as many decode replicas of TP ``--tp`` on tcp (512 x 512 of
TP 8: 8,192 ranks, 1,024 agents of 8 ranks), its rank map, certificates and ports written as the
operator would (``LocalFabric``). One decode agent runs, as its own process; its 512 prefill peers'
doors are not there (a decode agent does not probe, and talks to a peer only for a room). Each run
measures that agent from its start: to Ready, its RSS, its /metrics (bytes, lines, time to serve),
its CPU at rest, and how long it takes to adopt a newer rank map (one prefill replica fewer). Twice,
in the same run: with the bound of the per-peer series off (``PDFABRIC_PEER_SERIES_MAX`` past the
pairs the map implies: every pair at zero from the start, as before issue 47) and with the default.
What else is bounded is not measured here (unit tests): the peer door's connections follow the map,
idle streams close, the link check writes to 16 peer agents.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]
os.environ.setdefault("MC_FORCE_TCP", "1")

from pdfabric_agent.runtime.peer_series import DEFAULT_LIMIT  # noqa: E402
from pdfabric_core.rankmap import RankMap  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.procs import cpu_seconds  # noqa: E402

REST_S = 10.0
SCRAPES = 5


def spec(replicas: int, tp: int) -> dict[str, Any]:
    return {
        "prefill": {"tp": tp, "replicas": replicas},
        "decode": {"tp": tp, "replicas": replicas},
        "transfer": {"transport": "tcp", "timeoutSeconds": 20},
        "model": {"layers": 2, "kvHeads": tp, "headDim": 8, "pageSizeTokens": 4},
    }


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def scrape(port: int) -> tuple[bytes, float]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        body = resp.read()
    return body, time.perf_counter() - started


def readyz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        doc = json.loads(exc.read())
    return doc


def one_run(raw: dict[str, Any], series_max: int) -> dict[str, float]:
    env = {"PDFABRIC_PEER_SERIES_MAX": str(series_max), "PDFABRIC_KV_PAGES": "16"}
    built = time.perf_counter()
    fabric = LocalFabric(raw, env=env)  # not entered: that would start every agent
    try:
        made_s = time.perf_counter() - built
        name = next(a.name for a in fabric.rankmap.agents if a.ranks[0].role.value == "decode")
        agent = fabric.agents[name]
        started = time.perf_counter()
        fabric.start(name, wait_s=300)
        ready_s = time.perf_counter() - started
        assert agent.proc is not None
        pid = agent.proc.pid
        times, body = [], b""
        for _ in range(SCRAPES):
            body, took = scrape(agent.metrics_port)
            times.append(took)
        cpu0 = cpu_seconds(pid)
        time.sleep(REST_S)
        rest_cores = (cpu_seconds(pid) - cpu0) / REST_S
        # A newer map: the last prefill replica scaled away (its agent leaves; nothing else moves).
        old = fabric.rankmap
        dropped = [a for a in old.agents if a.name != f"agent-p{raw['prefill']['replicas'] - 1}-0"]
        newer_raw = {**old.spec, "prefill": {**old.spec["prefill"], "replicas": raw["prefill"]["replicas"] - 1}}
        newer = RankMap(old.namespace, old.cluster, old.cluster_uid, old.transport, newer_raw, tuple(dropped))
        path = agent.env["PDFABRIC_RANKMAP"]
        written = time.perf_counter()
        with open(path + ".new", "w", encoding="utf-8") as fh:
            fh.write(newer.to_json())
        os.replace(path + ".new", path)
        while readyz(agent.metrics_port).get("rankmap") != newer.digest:
            if time.perf_counter() - written > 120:
                raise TimeoutError(f"{name} did not adopt the newer rank map: {readyz(agent.metrics_port)}")
            time.sleep(0.05)
        adopt_s = time.perf_counter() - written
        rss = rss_mb(pid)
        return {
            "fabric written (s)": made_s,
            "start to Ready (s)": ready_s,
            "RSS (MB)": rss,
            "/metrics (KB)": len(body) / 1024,
            "/metrics lines": float(body.count(b"\n")),
            "/metrics served in (ms)": statistics.median(times) * 1000,
            "cores at rest": rest_cores,
            "adopt a newer map (s)": adopt_s,
        }
    finally:
        fabric.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=512)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    raw = spec(args.replicas, args.tp)
    unbounded = one_run(raw, series_max=1 << 30)
    bounded = one_run(raw, series_max=DEFAULT_LIMIT)
    ranks = 2 * args.replicas * args.tp
    print(f"\none decode agent of {ranks} ranks ({2 * args.replicas} agents of {args.tp} ranks), tcp\n")
    print(f"| measure | every pair at start (before) | bounded ({DEFAULT_LIMIT} pairs) | bounded / before |")
    print("|---|---|---|---|")
    for key in unbounded:
        before, after = unbounded[key], bounded[key]
        ratio = f"{after / before:.3f}" if before else "-"
        print(f"| {key} | {before:,.2f} | {after:,.2f} | {ratio} |")


if __name__ == "__main__":
    main()
