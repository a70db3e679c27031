"""Local control-plane start-up time and memory (binaries already built).

Starts the cluster `--runs` times from nothing (new PKI, empty etcd, default GPU fleet), and prints
per run the time until the apiserver is ready, the controller manager has made the default
ServiceAccount and every fake node is Ready; then the resident memory of each component. Goal:
ready in under 30 s on a 2-core machine; the ratio column is measured / goal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "hack")]

from pdfabric_devcluster import ClusterConfig, LocalCluster  # noqa: E402
from pdfabric_devcluster.binaries import ensure_binaries  # noqa: E402

GOAL_SECONDS = 30.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bin_dir = ensure_binaries(quiet=True)
    times: list[float] = []
    rss: dict[str, float] = {}
    print(f"{'run':>4} {'ready (s)':>10} {'/ goal':>8} {'nodes':>6}")
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="pdfabric-bench-") as tmp:
            cluster = LocalCluster(ClusterConfig(workdir=Path(tmp), bin_dir=bin_dir))
            cluster.start()
            try:
                assert cluster.startup_seconds is not None
                times.append(cluster.startup_seconds)
                nodes = len(cluster.ready_nodes())
                if run == args.runs - 1:
                    rss = cluster.process_rss_mib()
            finally:
                cluster.stop()
        print(f"{run:>4} {times[-1]:>10.2f} {times[-1] / GOAL_SECONDS:>8.2f} {nodes:>6}")
    median = statistics.median(times)
    print(f"\nmedian ready time {median:.2f} s = {median / GOAL_SECONDS:.2f} of the {GOAL_SECONDS:.0f} s goal")
    print(f"\n{'component':26} {'RSS (MiB)':>10}")
    for name, mib in sorted(rss.items()):
        print(f"{name:26} {mib:>10.1f}")
    print(f"{'total':26} {sum(rss.values()):>10.1f}")
    return 0 if median < GOAL_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
