"""`python -m pdfabric_devcluster up|down|status` (what `make cluster-up/-down` run)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from pdfabric_devcluster.binaries import ClusterError
from pdfabric_devcluster.cluster import ClusterConfig, LocalCluster
from pdfabric_devcluster.nodes import default_node_shapes, parse_node_shapes
from pdfabric_devcluster.procs import REPO_ROOT

DEFAULT_DIR = REPO_ROOT / ".artifacts" / "cluster"


def _state(workdir: Path) -> dict | None:
    path = workdir / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def cmd_up(args: argparse.Namespace) -> int:
    state = _state(args.dir)
    if state and any(_alive(p) for p in state["pids"].values()):
        print(f"cluster already running; KUBECONFIG={state['kubeconfig']}")
        return 0
    shapes = parse_node_shapes(args.nodes) if args.nodes else default_node_shapes()
    cluster = LocalCluster(ClusterConfig(workdir=args.dir, node_shapes=shapes))
    cluster.remove_data()  # every `up` is a fresh cluster: new PKI, empty etcd
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"cluster failed to start: {exc}\nlogs: {cluster.log_dir}", file=sys.stderr)
        return 1
    print(f"cluster ready in {cluster.startup_seconds:.1f}s; logs in {cluster.log_dir}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"export PATH={cluster.bin_dir}:$PATH")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = _state(args.dir)
    if not state:
        print("no cluster running")
        return 0
    pids = list(state["pids"].values())
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    (args.dir / "state.json").unlink()
    print("cluster stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = _state(args.dir)
    if not state:
        print("no cluster running")
        return 1
    for name, pid in state["pids"].items():
        print(f"{name:26} pid {pid:7} {'running' if _alive(pid) else 'EXITED'}")
    print(f"KUBECONFIG={state['kubeconfig']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdfabric_devcluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("PDFABRIC_CLUSTER_DIR", DEFAULT_DIR)))
    parser.add_argument(
        "--nodes",
        default=os.environ.get("PDFABRIC_NODES"),
        help="node shapes, e.g. 'gb200:4:clique=c1,rdma=rdma/hca;h200:2' (default: the demo fleet)",
    )
    args = parser.parse_args(argv)
    return {"up": cmd_up, "down": cmd_down, "status": cmd_status}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
