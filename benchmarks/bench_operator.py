"""Operator at scale: apply-to-Ready latency, then many PDClusters on many fake GPU nodes.

Starts a private local control plane with `--nodes` fake 8-GPU nodes (NVLink domains of 8 nodes,
each with an RDMA device), installs the CRDs and the chart's RBAC, and runs the real operator as its
own process under the chart's ServiceAccount. Then:

1. latency: `--latency-runs` PDClusters created one at a time; time from the create call until
   the API server shows Ready=True for the current generation (polled every 50 ms);
2. bulk: the remaining PDClusters (up to `--clusters`) created back to back; time until all are
   Ready; the transports rotate tcp, rdma, nvlink-intra, nvlink; each cluster takes 16 GPUs.

Reported: latency median/max, time to all Ready, operator peak RSS (VmHWM of its process), and API
requests the operator made, counted two ways: server-side (the API server's priority-and-fairness
counter for the `service-accounts` flow, which in this private cluster only the operator uses)
and client-side (the reconciler's own counter; kopf's watches and patches excluded there).

Default size runs in a few minutes on a 2-core machine; `--full` is 500 nodes x 8 GPUs
with 100 PDClusters (goal: all Ready within 15 s), `--nodes 2000 --clusters 500` the fleet of issue 47
(goal: within 60 s); the operator under 500 MB in both. Nodes are created in batches and the clock
starts once every node is Ready and untainted (a fleet at rest).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "hack")]

import yaml  # noqa: E402

from pdfabric_devcluster import ClusterConfig, LocalCluster  # noqa: E402
from pdfabric_devcluster.binaries import ensure_binaries, wait_for  # noqa: E402
from pdfabric_devcluster.nodes import GpuNodeShape  # noqa: E402
from pdfabric_devcluster.procs import cpu_seconds, free_port  # noqa: E402

# Issue 47's goals: 100 PDClusters on 500 nodes all Ready within 15 s, 500 on 2,000 within 60 s,
# the operator under 500 MB.
GOAL_ALL_READY_S = {100: 15.0, 500: 60.0}
GOAL_RSS_MB = 500.0
OPERATOR_NS = "pdfabric-system"
TRANSPORTS = ("tcp", "rdma", "nvlink-intra", "nvlink")


# With --largest: a small PDCluster is applied this long after the largest, while its pods are made.
BESIDE_AFTER_S = 2.0


def pdcluster(name: str, transport: str) -> dict[str, Any]:
    pool = {"nvlink-intra": "INTRA_NODE_NVLINK", "nvlink": "NVLINK"}.get(transport, "NONE")
    spec: dict[str, Any] = {
        "transfer": {"memPool": pool, "transport": transport},
        # 16 GPUs: two prefill TP4 replicas and two decode TP4 replicas (intra-node: 2 x 8 per node)
        "prefill": {"replicas": 2, "tp": 4},
        "decode": {"replicas": 2, "tp": 4},
        "placement": {"nodeSelector": {"pool": "bench"}},
    }
    return {"apiVersion": "pdfabric.dev/v1alpha1", "kind": "PDCluster", "metadata": {"name": name}, "spec": spec}


def largest_pdcluster(name: str) -> dict[str, Any]:
    """The largest PDCluster the CRD admits: MAX_RANKS ranks, 512 prefill and 512 decode replicas of
    TP 8 over RDMA, 1,024 agent pods of eight GPUs."""
    spec: dict[str, Any] = {
        "transfer": {"memPool": "NONE", "transport": "rdma"},
        "prefill": {"replicas": 512, "tp": 8},
        "decode": {"replicas": 512, "tp": 8},
        "placement": {"nodeSelector": {"pool": "bench"}},
    }
    return {"apiVersion": "pdfabric.dev/v1alpha1", "kind": "PDCluster", "metadata": {"name": name}, "spec": spec}


def node_shapes(nodes: int) -> list[GpuNodeShape]:
    shapes = []
    for i in range(0, nodes, 8):
        shapes.append(
            GpuNodeShape(
                f"b{i // 8}",
                min(8, nodes - i),
                clique=f"dom-{i // 8}",
                rdma_resource="rdma/hca",
                labels={"pool": "bench"},
            )
        )
    return shapes


class Operator:
    """The operator as a child process, with its RSS sampled for the peak."""

    def __init__(self, cluster: LocalCluster, kubeconfig: Path, log: Path) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("core", "operator")),
            "PDFABRIC_KUBECONFIG": str(kubeconfig),
            "PDFABRIC_PEERING": "pdfabric",
            "PDFABRIC_METRICS_PORT": str(self.metrics_port),
            "PDFABRIC_RECONCILE_INTERVAL": "20",
        }
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kopf",
                "run",
                "-A",
                "--quiet",
                f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
                "-m",
                "pdfabric_operator.main",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.peak_rss_mb = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _status(self, field: str) -> float:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
        return int(match.group(1)) / 1024 if match else 0.0

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.peak_rss_mb = max(self.peak_rss_mb, self._status("VmRSS"))
            time.sleep(0.2)

    def wait_live(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("operator liveness endpoint did not answer")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pdfabric_operator_"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def cpu_s(self) -> float:
        """CPU seconds the operator's process has used (user and system)."""
        return cpu_seconds(self.proc.pid)

    def stop(self) -> float:
        peak = max(self.peak_rss_mb, self._status("VmHWM") if self.proc.poll() is None else 0.0)
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return peak


class NodeChurn:
    """Label changes on the fleet's nodes at a steady rate, in a thread, as a fleet sees them
    (feature discovery, maintenance tools): each is a placement input of that node."""

    def __init__(self, cluster: LocalCluster, nodes: int, per_s: float) -> None:
        self.cluster, self.period = cluster, 1.0 / per_s
        self.names = [name for shape in node_shapes(nodes) for name in shape.names()]
        self.changes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            node = self.names[self.changes % len(self.names)]
            self.cluster.kubectl("label", "node", node, f"bench-churn={self.changes}", "--overwrite")
            self.changes += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.changes


def start_profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling the operator's threads (GIL holders and waiters alike) into collapsed stacks."""
    exe = os.environ.get("PY_SPY", "py-spy")
    cmd = [exe, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def apiserver_profile(cluster: LocalCluster, out: Path, seconds: int = 12) -> None:
    with out.open("wb") as f:
        subprocess.run(
            [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "get", "--raw",
             f"/debug/pprof/profile?seconds={seconds}"],
            stdout=f, stderr=subprocess.DEVNULL, timeout=seconds + 30, check=False,
        )  # fmt: skip


def stop_profiler(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def apf_requests(cluster: LocalCluster) -> float:
    """Requests the API server dispatched for the `service-accounts` flow (the operator's SA)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("apiserver_flowcontrol_dispatched_requests_total")
            and 'flow_schema="service-accounts"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def apiserver_requests(cluster: LocalCluster) -> dict[str, float]:
    """Every request the API server answered so far, from all clients, by "VERB resource[/sub]"
    and by "flow <flow schema>" (who asked: the operator's service account, the scheduler, ...)."""
    out: dict[str, float] = {}
    for line in cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        name, _, value = line.rpartition(" ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
        if name.startswith("apiserver_request_total{"):
            sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
            key = f"{labels.get('verb')} {labels.get('resource')}{sub}"
        elif name.startswith("apiserver_flowcontrol_dispatched_requests_total{"):
            key = f"flow {labels.get('flow_schema')}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def ready_names(api: Any) -> set[str]:
    items = api.list_namespaced_custom_object("pdfabric.dev", "v1alpha1", "bench", "pdclusters")["items"]
    ready = set()
    for obj in items:
        status = obj.get("status") or {}
        if status.get("observedGeneration") != obj["metadata"]["generation"]:
            continue
        for cond in status.get("conditions") or []:
            if cond["type"] == "Ready" and cond["status"] == "True":
                ready.add(obj["metadata"]["name"])
    return ready


def wait_nodes_settled(cluster: LocalCluster, count: int, timeout: float = 300) -> None:
    """Until every node is Ready with no taint left by the node lifecycle controller: a fleet at
    rest, so that the clusters measure the operator, not nodes still coming up."""

    def untainted() -> set[str]:
        return {
            n["metadata"]["name"]
            for n in cluster.get_json("nodes")["items"]
            if not any(t["key"].startswith("node.kubernetes.io/") for t in n.get("spec", {}).get("taints") or [])
        }

    wait_for(
        lambda: len(cluster.ready_nodes() & untainted()) >= count,
        timeout=timeout,
        interval=1.0,
        what=f"{count} nodes Ready and untainted",
    )


def install(cluster: LocalCluster) -> Path:
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/pdclusters.pdfabric.dev")
    cluster.kubectl("create", "namespace", OPERATOR_NS)
    cluster.kubectl("create", "namespace", "bench")
    rendered = subprocess.run(
        [str(cluster.bin_dir / "helm"), "template", "pdfabric", str(ROOT / "charts" / "pdfabric"), "-n", OPERATOR_NS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    keep = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in keep]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return cluster.service_account_kubeconfig(OPERATOR_NS, "pdfabric")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=16)
    parser.add_argument("--latency-runs", type=int, default=4)
    parser.add_argument("--full", action="store_true", help="500 nodes x 8 GPUs, 100 PDClusters")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="record the operator with py-spy (on PATH or $PY_SPY) while the bulk PDClusters come up, "
        "collapsed stacks written here (and of the rest phase beside them, .rest.txt), and the API server's first "
        "12 s of it (pprof) beside them",
    )
    parser.add_argument(
        "--largest",
        action="store_true",
        help="after the rest, one PDCluster of the CRD's largest size (8,192 ranks in 1,024 pods of 8 GPUs), "
        "timed from apply to Ready",
    )
    parser.add_argument("--rest-s", type=float, default=5.0, help="seconds at rest after all are Ready, counted")
    parser.add_argument(
        "--churn-per-s",
        type=float,
        default=0.0,
        help="node label changes per second while the bulk PDClusters come up (a fleet's routine churn)",
    )
    args = parser.parse_args()
    if args.full:
        args.nodes, args.clusters = 500, 100
    if args.clusters * 16 > args.nodes * 8:
        parser.error("not enough GPUs: each PDCluster takes 16")

    from kubernetes import client, config

    bin_dir = ensure_binaries(quiet=True)
    with tempfile.TemporaryDirectory(prefix="pdfabric-bench-op-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        cluster = LocalCluster(
            ClusterConfig(
                workdir=work, bin_dir=bin_dir, node_shapes=node_shapes(args.nodes), profiling=args.profile is not None
            )
        )
        cluster.start()
        print(f"control plane with {args.nodes} nodes ready in {time.monotonic() - t0:.1f} s")
        t1 = time.monotonic()
        wait_nodes_settled(cluster, args.nodes, timeout=max(300.0, args.nodes * 0.5))
        print(f"nodes Ready and untainted {time.monotonic() - t1:.1f} s later")
        operator: Operator | None = None
        try:
            kubeconfig = install(cluster)
            api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(cluster.kubeconfig)))
            apf_before = apf_requests(cluster)
            operator = Operator(cluster, kubeconfig, work / "operator.log")
            operator.wait_live()

            latencies = []
            names = [f"pd-{i:03d}" for i in range(args.clusters)]
            for i, name in enumerate(names[: args.latency_runs]):
                start = time.monotonic()
                api.create_namespaced_custom_object(
                    "pdfabric.dev", "v1alpha1", "bench", "pdclusters", pdcluster(name, TRANSPORTS[i % 4])
                )
                while name not in ready_names(api):
                    if time.monotonic() - start > 60:
                        raise RuntimeError(f"{name} not Ready after 60 s")
                    time.sleep(0.05)
                latencies.append(time.monotonic() - start)

            bulk = names[args.latency_runs :]
            served_before = apiserver_requests(cluster)
            start, cpu_before, plane_before = time.monotonic(), operator.cpu_s(), cluster.process_cpu_s()
            churn = NodeChurn(cluster, args.nodes, args.churn_per_s) if args.churn_per_s > 0 else None
            profiler = start_profiler(operator.proc.pid, args.profile) if args.profile else None
            if args.profile:  # the API server's own CPU profile over the same seconds (pprof)
                threading.Thread(
                    target=apiserver_profile, args=(cluster, args.profile.with_suffix(".apiserver.pprof")), daemon=True
                ).start()
            for i, name in enumerate(bulk, start=args.latency_runs):
                api.create_namespaced_custom_object(
                    "pdfabric.dev", "v1alpha1", "bench", "pdclusters", pdcluster(name, TRANSPORTS[i % 4])
                )
            created = time.monotonic() - start
            while True:
                ready = ready_names(api)
                if ready >= set(names):
                    break
                if time.monotonic() - start > args.timeout:
                    raise RuntimeError(f"only {len(ready)}/{len(names)} Ready after {args.timeout:.0f} s")
                time.sleep(0.5)
            all_ready = time.monotonic() - start
            bulk_cpu = operator.cpu_s() - cpu_before
            plane_cpu = {k: v - plane_before.get(k, 0.0) for k, v in cluster.process_cpu_s().items()}
            served = {k: v - served_before.get(k, 0.0) for k, v in apiserver_requests(cluster).items()}
            if profiler is not None:
                stop_profiler(profiler)

            # At rest: every PDCluster Ready, the nodes still changing. A node's change may wake the
            # PDClusters with a pod on it, not the others: node-woken reconciles per change.
            def node_woken() -> float:
                return operator.metrics().get('pdfabric_operator_reconcile_causes_total{cause="node"}', 0.0)

            woken, changes = node_woken(), churn.changes if churn is not None else 0
            rest_plane, rest_operator = cluster.process_cpu_s(), operator.cpu_s()
            rest_profiler = (
                start_profiler(operator.proc.pid, args.profile.with_suffix(".rest.txt")) if args.profile else None
            )
            time.sleep(args.rest_s)
            if rest_profiler is not None:
                stop_profiler(rest_profiler)
            rest_plane_cpu = sum(cluster.process_cpu_s().values()) - sum(rest_plane.values())
            rest_operator_cpu = operator.cpu_s() - rest_operator
            woken, changes = node_woken() - woken, (churn.changes if churn is not None else 0) - changes
            churned = churn.stop() if churn is not None else 0
            largest_s = beside_s = None
            if args.largest:
                start = time.monotonic()
                api.create_namespaced_custom_object(
                    "pdfabric.dev", "v1alpha1", "bench", "pdclusters", largest_pdcluster("pd-largest")
                )
                # One small PDCluster applied while the largest is being made: it must not wait for it.
                time.sleep(BESIDE_AFTER_S)
                beside_start = time.monotonic()
                api.create_namespaced_custom_object(
                    "pdfabric.dev", "v1alpha1", "bench", "pdclusters", pdcluster("pd-beside", "tcp")
                )
                while not {"pd-largest", "pd-beside"} <= (ready := ready_names(api)):
                    if beside_s is None and "pd-beside" in ready:
                        beside_s = time.monotonic() - beside_start
                    if time.monotonic() - start > args.timeout:
                        raise RuntimeError(f"the largest PDCluster not Ready after {args.timeout:.0f} s")
                    time.sleep(0.2)
                largest_s = time.monotonic() - start
                if beside_s is None:  # Ready in the same poll as the largest
                    beside_s = time.monotonic() - beside_start
            time.sleep(2)  # let the last status writes land before counting
            apf = apf_requests(cluster) - apf_before
            metrics = operator.metrics()
        finally:
            peak = operator.stop() if operator else 0.0
            cluster.stop()

    client_requests = sum(v for k, v in metrics.items() if k.startswith("pdfabric_operator_api_requests_total"))
    by_request = {
        f"{labels['verb']} {labels['resource']}": v
        for k, v in metrics.items()
        if k.startswith("pdfabric_operator_api_requests_total{") and v
        for labels in [dict(re.findall(r'(\w+)="([^"]*)"', k))]
    }
    reconciles = {
        re.search(r'result="(\w+)"', k).group(1): v  # type: ignore[union-attr]
        for k, v in metrics.items()
        if k.startswith("pdfabric_operator_reconciles_total{")
    }
    causes = {
        re.search(r'cause="(\w+)"', k).group(1): v  # type: ignore[union-attr]
        for k, v in metrics.items()
        if k.startswith("pdfabric_operator_reconcile_causes_total{")
    }
    results = {
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "clusters": args.clusters,
        "latency_s": {"median": statistics.median(latencies), "max": max(latencies), "runs": latencies},
        "bulk_clusters": len(bulk),
        "bulk_created_s": created,
        "all_ready_s": all_ready,
        "node_label_changes": churned,
        "rest_s": args.rest_s,
        "rest_node_changes": changes,
        "rest_node_woken_reconciles": woken,
        "operator_cpu_s_until_all_ready": bulk_cpu,
        "control_plane_cpu_s_until_all_ready": plane_cpu,
        "at_rest_cores": {"control_plane": rest_plane_cpu / args.rest_s, "operator": rest_operator_cpu / args.rest_s},
        "apiserver_requests_until_all_ready": {k: v for k, v in served.items() if v},
        "operator_peak_rss_mb": peak,
        "api_requests_server_side": apf,
        "api_requests_reconciler": client_requests,
        "api_requests_reconciler_by_request": by_request,
        "reconciles": reconciles,
        "largest_pdcluster_ready_s": largest_s,
        "beside_largest_ready_s": beside_s,
        "reconcile_causes": causes,
    }
    goal_s = next(
        (s for n, s in sorted(GOAL_ALL_READY_S.items()) if args.clusters <= n), max(GOAL_ALL_READY_S.values())
    )
    print(f"\n{'metric':42} {'value':>12} {'goal':>10}")
    print(f"{'apply-to-Ready latency, median (s)':42} {results['latency_s']['median']:>12.2f}")
    print(f"{'apply-to-Ready latency, max (s)':42} {results['latency_s']['max']:>12.2f}")
    print(f"{f'{len(bulk)} more PDClusters: all Ready (s)':42} {all_ready:>12.2f} {goal_s:>10.0f}")
    print(f"{'operator CPU until all Ready (s)':42} {bulk_cpu:>12.2f}")
    print(f"{'control plane CPU until all Ready (s)':42} {sum(plane_cpu.values()):>12.2f}")
    for name, cpu in sorted(plane_cpu.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.05:
            print(f"{'  ' + name:42} {cpu:>12.2f}")
    print(f"{'at rest: control plane cores busy':42} {rest_plane_cpu / args.rest_s:>12.2f}")
    print(f"{'at rest: operator cores busy':42} {rest_operator_cpu / args.rest_s:>12.2f}")
    top = sorted(((k, v) for k, v in served.items() if v and not k.startswith("flow ")), key=lambda kv: -kv[1])
    print(f"{'API server requests until all Ready (all)':42} {sum(v for _, v in top):>12.0f}")
    for request, count in top[:12]:
        print(f"{'  ' + request:42} {count:>12.0f}")
    for flow, count in sorted(
        ((k, v) for k, v in served.items() if v and k.startswith("flow ")), key=lambda kv: -kv[1]
    ):
        print(f"{'  ' + flow:42} {count:>12.0f}")
    if churned:
        print(f"{'node label changes meanwhile':42} {churned:>12}")
    if changes:
        print(f"{'node-woken reconciles per change at rest':42} {woken / changes:>12.2f}")
    if largest_s is not None:
        print(f"{'largest PDCluster (8,192 ranks): Ready (s)':42} {largest_s:>12.2f} {60:>10}")
    if beside_s is not None:
        print(f"{f'  a small one applied {BESIDE_AFTER_S:g} s into it: Ready (s)':42} {beside_s:>12.2f}")
    print(f"{'operator peak RSS (MB)':42} {peak:>12.1f} {GOAL_RSS_MB:>10.0f}")
    print(f"{'API requests (server-side, operator SA)':42} {apf:>12.0f}")
    print(f"{'API requests (reconciler, client-side)':42} {client_requests:>12.0f}")
    for request, count in sorted(by_request.items(), key=lambda kv: -kv[1]):
        print(f"{'  per PDCluster: ' + request:42} {count / args.clusters:>12.2f}")
    print(f"{'reconciles by result':42} {json.dumps({k: int(v) for k, v in reconciles.items() if v})}")
    print(f"{'reconciles by cause':42} {json.dumps({k: int(v) for k, v in causes.items() if v})}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ok = all_ready <= goal_s and peak <= GOAL_RSS_MB and (largest_s is None or largest_s <= 60)
    print(f"\n{'PASS' if ok else 'FAIL'}: {args.nodes} nodes x 8 GPUs, {args.clusters} PDClusters")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
