"""LocalCluster: start, use and stop the real control plane as local processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdfabric_devcluster.binaries import CONTROLPLANE_DIR, ClusterError, ensure_binaries, wait_for
from pdfabric_devcluster.nodes import NODE_DOWN_ANNOTATION, GpuNodeShape, build_gpu_node, default_node_shapes
from pdfabric_devcluster.pki import Pki
from pdfabric_devcluster.procs import cpu_seconds, free_port
from pdfabric_devcluster.timings import record

SERVICE_CIDR = "10.96.0.0/16"  # allocation range for Service IPs only; nothing is sent there


NODE_BATCH = 200  # nodes per kubectl create


@dataclass
class ClusterConfig:
    workdir: Path
    node_shapes: Sequence[GpuNodeShape] = field(default_factory=default_node_shapes)
    bin_dir: Path | None = None
    start_timeout: float = 90.0
    verbosity: int = 1
    # The API server's /debug/pprof (admin only): for a benchmark's profile, off otherwise.
    profiling: bool = False


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class LocalCluster:
    """The control plane of one test session or one `make cluster-up`.

    Every process runs in its own session so stop() can end it and all its children.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workdir = config.workdir
        self.bin_dir = config.bin_dir or ensure_binaries()
        self.log_dir = self.workdir / "logs"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.procs: list[_Proc] = []
        self.ports: dict[str, int] = {}
        self.startup_seconds: float | None = None

    @classmethod
    def attach(cls, workdir: Path) -> LocalCluster:
        """Use a cluster that `python -m pdfabric_devcluster up` started (it is not stopped here)."""
        state_path = workdir / "state.json"
        if not state_path.exists():
            raise ClusterError(f"no cluster running in {workdir}: run make cluster-up")
        state = json.loads(state_path.read_text())
        cluster = cls(ClusterConfig(workdir=workdir, node_shapes=(), bin_dir=Path(state["bin_dir"])))
        cluster.server = state["server"]
        cluster.ca = workdir / "pki" / "ca.crt"
        return cluster

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        record("control plane start", self.startup_seconds)
        self._write_state()
        return self

    def _start(self) -> None:
        for name in ("etcd_client", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok"):
            self.ports[name] = free_port()
        pki = Pki(self.workdir / "pki")
        self.ca = pki.ca_path
        serving = pki.issue("apiserver", "kube-apiserver", server=True)
        admin = pki.issue("admin", "pdfabric-admin", org="system:masters")
        kcm = pki.issue("controller-manager", "system:kube-controller-manager")
        sched = pki.issue("scheduler", "system:kube-scheduler")
        sa_pub, sa_key = pki.service_account_keys()
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self._write_kubeconfig(self.kubeconfig, "pdfabric-admin", *admin)
        kcm_kc = self._write_kubeconfig(self.workdir / "controller-manager.kubeconfig", "kcm", *kcm)
        sched_kc = self._write_kubeconfig(self.workdir / "scheduler.kubeconfig", "scheduler", *sched)
        self.admin_cert = admin

        etcd_url = f"http://127.0.0.1:{self.ports['etcd_client']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        self._spawn(
            "etcd",
            [
                "--name=pdfabric",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=pdfabric={peer_url}",
                "--listen-metrics-urls=",
                "--unsafe-no-fsync=true",  # test data: durability is not worth the latency
                "--log-level=warn",
            ],
        )
        wait_for(lambda: self._http_ok(f"{etcd_url}/health"), timeout=30, what="etcd health")

        v = str(self.config.verbosity)
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={serving[0]}",
                f"--tls-private-key-file={serving[1]}",
                f"--client-ca-file={pki.ca_path}",
                "--authorization-mode=RBAC",
                "--anonymous-auth=false",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                f"--profiling={str(self.config.profiling).lower()}",
                "--endpoint-reconciler-type=none",
                f"--v={v}",
            ],
        )
        wait_for(self._apiserver_ready, timeout=self.config.start_timeout, what="kube-apiserver /readyz")

        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['kcm']}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={pki.ca_path}",
                "--controllers=*",
                "--concurrent-gc-syncs=10",
                f"--v={v}",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                "--leader-elect=false",
                f"--v={v}",
            ],
        )
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--config={CONTROLPLANE_DIR / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
                "--node-lease-duration-seconds=40",
                f"--tls-cert-file={serving[0]}",
                f"--tls-private-key-file={serving[1]}",
            ],
        )
        # The controller manager is working once it has made the default ServiceAccount.
        wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            timeout=self.config.start_timeout,
            interval=0.25,
            what="the controller manager to create the default ServiceAccount",
        )
        self.add_gpu_nodes(self.config.node_shapes)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after 10 s); safe to call twice."""
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(timeout=10)
        self.procs.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.workdir / "state.json").unlink()

    def remove_data(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- helpers ---------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.log_dir / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        popen = subprocess.Popen(
            [str(self.bin_dir / name), *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        fh.close()
        self.procs.append(_Proc(name, popen, log))

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise ClusterError(f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{tail}")

    def _http_ok(self, url: str) -> bool:
        self._check_alive()
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200

    def _apiserver_ready(self) -> bool:
        self._check_alive()
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(*map(str, self.admin_cert))
        try:
            with urllib.request.urlopen(f"{self.server}/readyz", timeout=2, context=ctx) as resp:
                return resp.status == 200
        except urllib.error.HTTPError:
            return False

    def _write_kubeconfig(self, path: Path, user: str, cert: Path, key: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "pdfabric", "cluster": {"server": self.server, "certificate-authority": str(self.ca)}}
            ],
            "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": "pdfabric", "context": {"cluster": "pdfabric", "user": user}}],
            "current-context": "pdfabric",
        }
        path.write_text(json.dumps(config, indent=1))
        path.chmod(0o600)
        return path

    def token_kubeconfig(self, name: str, token: str) -> Path:
        """A kubeconfig that authenticates with a bearer token (a ServiceAccount's, say)."""
        path = self.workdir / f"{name}.kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "pdfabric", "cluster": {"server": self.server, "certificate-authority": str(self.ca)}}
            ],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "pdfabric", "context": {"cluster": "pdfabric", "user": name}}],
            "current-context": "pdfabric",
        }
        path.write_text(json.dumps(config, indent=1))
        path.chmod(0o600)
        return path

    def service_account_kubeconfig(self, namespace: str, name: str, *, duration: str = "2h") -> Path:
        """Mint a token for a ServiceAccount (TokenRequest) and write a kubeconfig that uses it."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        return self.token_kubeconfig(f"sa-{namespace}-{name}", token)

    def _write_state(self) -> None:
        state = {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "pids": {p.name: p.popen.pid for p in self.procs},
            "startup_seconds": self.startup_seconds,
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=1))

    # ---- what tests and the demo use --------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster (as admin unless `kubeconfig` says otherwise)."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def apply(self, objects: Iterable[dict[str, Any]] | dict[str, Any], *, namespace: str | None = None) -> str:
        items = [objects] if isinstance(objects, dict) else list(objects)
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=doc).stdout

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def api_client(self) -> Any:
        """An admin kubernetes.client.ApiClient for this cluster."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    def add_gpu_nodes(self, shapes: Iterable[GpuNodeShape], *, wait: bool = True) -> list[str]:
        nodes = [build_gpu_node(name, shape) for shape in shapes for name in shape.names()]
        if not nodes:
            return []
        # Nodes keep the status (capacity, allocatable) they are created with; apply would not
        # write status, so create them, in batches: one kubectl create of 2,000 nodes outlasts its
        # timeout on two cores.
        for start in range(0, len(nodes), NODE_BATCH):
            batch = nodes[start : start + NODE_BATCH]
            self.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": batch}))
        names = [n["metadata"]["name"] for n in nodes]
        if wait:
            self.wait_nodes_ready(names)
        return names

    def _names_with(self, kind: str, condition: str) -> set[str]:
        """Names of the `kind` objects whose `condition` is True (a new object may have none yet)."""
        return {
            item["metadata"]["name"]
            for item in self.get_json(kind)["items"]
            for cond in item.get("status", {}).get("conditions") or []
            if cond["type"] == condition and cond["status"] == "True"
        }

    def ready_nodes(self) -> set[str]:
        return self._names_with("nodes", "Ready")

    def wait_nodes_ready(self, names: Iterable[str], timeout: float = 60) -> None:
        wanted = set(names)
        wait_for(
            lambda: wanted <= self.ready_nodes(), timeout=timeout, interval=0.25, what=f"nodes {sorted(wanted)} Ready"
        )

    def wait_crds_established(self, names: Iterable[str], timeout: float = 60) -> None:
        # Not `kubectl wait --for=condition=Established`: on a CRD created a moment ago it can read
        # status before the apiserver wrote any conditions and fail at once instead of waiting.
        wanted = set(names)
        wait_for(
            lambda: wanted <= self._names_with("crds", "Established"),
            timeout=timeout,
            interval=0.25,
            what=f"CRDs {sorted(wanted)} Established",
        )

    def set_node_down(self, name: str, down: bool = True) -> None:
        """Simulate a lost node: kwok reports it Ready=Unknown until brought back."""
        value = f"{NODE_DOWN_ANNOTATION}=true" if down else f"{NODE_DOWN_ANNOTATION}-"
        self.kubectl("annotate", "node", name, value, "--overwrite")

    def delete_nodes(self, names: Iterable[str]) -> None:
        self.kubectl("delete", "node", *names, "--wait=false")

    def process_cpu_s(self) -> dict[str, float]:
        """CPU seconds (user and system) each control-plane process has used so far."""
        out = {}
        for proc in self.procs:
            try:
                out[proc.name] = cpu_seconds(proc.popen.pid)
            except FileNotFoundError:
                continue
        return out

    def process_rss_mib(self) -> dict[str, float]:
        """Resident memory of each control-plane process (including children), in MiB."""
        out = {}
        for proc in self.procs:
            try:
                status = Path(f"/proc/{proc.popen.pid}/status").read_text()
            except FileNotFoundError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    out[proc.name] = int(line.split()[1]) / 1024
        return out
