"""The operator's cost per PDCluster, held to a bound kept in the repo (issue 47).

Runs `benchmarks/bench_operator.py` at a CI size (its own control plane, fake GPU nodes at rest,
the operator as a process of its own under the chart's RBAC) and compares what each PDCluster cost
the operator, counted, not timed: API requests (server-side, the operator's ServiceAccount), and
reconciles not started by the reconcile interval, while node labels change at a steady rate (a
fleet's routine churn); and, once all are Ready, the reconciles in a few seconds at rest with the
churn going on, when a node's change wakes only the PDClusters with a pod on it. A change that makes either grow by more than
half over `benchmarks/operator_cost.json` fails here; a change that lowers them should lower the
bound (run this test with PDFABRIC_WRITE_OPERATOR_COST=1 to print the measured values).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOUND = ROOT / "benchmarks" / "operator_cost.json"
GROWTH = 1.5  # how far over the bound a measured cost may go


def per_cluster(results: dict[str, object]) -> dict[str, float]:
    clusters = float(results["clusters"])  # type: ignore[arg-type]
    causes = dict(results["reconcile_causes"])  # type: ignore[call-overload]
    return {
        "api_requests": float(results["api_requests_server_side"]) / clusters,  # type: ignore[arg-type]
        # what events started: the timers (interval, resync, a certificate due) are not the cost measured
        "reconciles": sum(v for k, v in causes.items() if k not in ("interval", "resync", "certificate")) / clusters,
    }


def test_the_cost_per_pdcluster_stays_within_half_again_its_bound(tmp_path: Path) -> None:
    bound = json.loads(BOUND.read_text())
    out = tmp_path / "bench.json"
    args = ["--nodes", str(bound["nodes"]), "--clusters", str(bound["clusters"]), "--latency-runs", "2"]
    args += ["--churn-per-s", str(bound["churn_per_s"]), "--rest-s", str(bound["rest_s"])]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_operator.py"), *args, "--timeout", "240", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    measured = per_cluster(results)
    print(
        f"per PDCluster at {bound['nodes']} nodes, {bound['clusters']} PDClusters: {measured}; bound {bound['per_cluster']}"
    )
    if os.environ.get("PDFABRIC_WRITE_OPERATOR_COST"):
        print(json.dumps({**bound, "per_cluster": {k: round(v, 1) for k, v in measured.items()}}, indent=1))
    over = {k: v for k, v in measured.items() if v > GROWTH * bound["per_cluster"][k]}
    assert not over, f"the operator's cost per PDCluster grew past {GROWTH}x its bound {bound['per_cluster']}: {over}"
    # At rest, every PDCluster Ready: a node's label change wakes the PDClusters with a pod on it
    # (about one here), never all of them (16).
    per_change = results["rest_node_woken_reconciles"] / max(1, results["rest_node_changes"])
    assert results["rest_node_changes"] >= 10, results
    assert per_change <= bound["node_woken_per_change"], (
        f"{results['rest_node_woken_reconciles']} reconciles woken by {results['rest_node_changes']} node changes at rest"
    )
    assert results["all_ready_s"] < 240
