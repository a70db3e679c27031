"""Real agent processes on this machine (loopback tcp), seen the way a serving engine sees them:
the rank map, the engine token, one client per agent (on its engine door), each agent's /readyz
and /metrics; and the way a peer agent sees them (``peer_post``: its peer door, mutual TLS).

One harness, two ways to get the agents:

- ``LocalFabric(raw_spec, ...)`` places the ranks itself (one agent per role replica, or per
  ``ranks_per_agent`` ranks), writes the rank map, the engine token, a cluster CA and one peer
  certificate per agent as the operator would (the operator's own ``pki``), and runs the agent's
  real command for each entry (e2e agent tests, benchmarks, GPU tests);
- ``LocalFabric.from_cluster(cluster, namespace, name, runner)`` reads a placed PDCluster's rank
  map and engine token from the control plane and drives the agent processes PodRunner started
  from the operator's pods, with the certificates the operator issued (the demo, the
  whole-fabric e2e test).

Every process gets free loopback ports in place of its container ports (engine door, peer door,
metrics) and learns its peers' peer-door addresses through PDFABRIC_PEERS, standing in for the
headless Service's DNS names (the certificates still carry those names, and peers verify them).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import secrets
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric_agent.client.api import AgentClient
from pdfabric_agent.protocol import tls
from pdfabric_agent.runtime.config import SETTINGS
from pdfabric_core.engines import ENGINES_ENV, EngineState, engine_launches
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RANKMAP_KEY, AgentEntry, Rank, RankMap, replica_ranks
from pdfabric_core.spec import PDClusterSpec, parse_spec
from pdfabric_devcluster.procs import REPO_ROOT, answers_200, console_argv, free_port, source_pythonpath
from pdfabric_operator import pki

if TYPE_CHECKING:
    from pdfabric_devcluster.cluster import LocalCluster
    from pdfabric_devcluster.podrunner import PodRunner

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


DEFAULT_PEER_HOST_TEMPLATE = SETTINGS["PDFABRIC_PEER_HOST_TEMPLATE"][0] or ""
# What an engine image has on its PYTHONPATH besides pdfabric's own packages: the SGLang plugin
# and the reference engine.
ENGINE_PACKAGES = ("integrations/sglang", "hack")


def python_bin(bin_dir: Path) -> Path:
    """A PATH entry whose python and python3 run this interpreter (an engine image's python).
    Scripts, not symlinks: a symlinked venv python elsewhere would not find its pyvenv.cfg."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        script = bin_dir / name
        if not script.exists():
            script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
            script.chmod(0o755)
    return bin_dir


def engine_image_env(bin_dir: Path, base: Mapping[str, str], pythonpath: Iterable[str] = ()) -> dict[str, str]:
    """An engine image's environment on this machine, over an agent's ``base`` (whose PYTHONPATH
    already has the sources): python on PATH, the engine packages and ``pythonpath`` on PYTHONPATH."""
    own = [str(REPO_ROOT / p) for p in ENGINE_PACKAGES]
    return {
        "PATH": os.pathsep.join([str(python_bin(bin_dir)), base.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([base.get("PYTHONPATH", ""), *own, *pythonpath]),
    }


def engines_env(
    spec: PDClusterSpec, ranks: Iterable[Rank], bin_dir: Path, base: Mapping[str, str], pythonpath: Iterable[str] = ()
) -> tuple[dict[str, str], list[tuple[str, int, int]]]:
    """What a node pod with spec.engine gives its agent, for a process on loopback: the launch
    message (each engine's ports a free loopback port) and the engine image's environment
    (``engine_image_env``); and (engine name, port, bootstrap port) of each engine."""
    launches = [x.to_json() for x in engine_launches(spec, list(ranks))]
    where = []
    for launch in launches:
        launch["port"] = free_port()
        if "bootstrapPort" in launch:
            launch["bootstrapPort"] = free_port()
        where.append((launch["name"], launch["port"], launch.get("bootstrapPort", 0)))
    return {ENGINES_ENV: json.dumps(launches), **engine_image_env(bin_dir, base, pythonpath)}, where


def loopback_env(
    peers: Mapping[str, int],
    api_port: int,
    peer_port: int,
    metrics_port: int,
    base: Mapping[str, str],
    peers_file: Path | None = None,
) -> dict[str, str]:
    """What a pod's network gives an agent, for a process on loopback: its own ports and address,
    its peers' peer-door addresses (agent name -> port; `peers_file`, kept current, names those
    that come later), the sources on PYTHONPATH."""
    env = {
        "PDFABRIC_BIND_ADDRESS": "127.0.0.1",
        "PDFABRIC_ENGINE_HOST": "127.0.0.1",
        "PDFABRIC_API_PORT": str(api_port),
        "PDFABRIC_PEER_PORT": str(peer_port),
        "PDFABRIC_METRICS_PORT": str(metrics_port),
        "PDFABRIC_PEERS": json.dumps({name: f"127.0.0.1:{port}" for name, port in peers.items()}),
        "PYTHONPATH": source_pythonpath(base),
        "PYTHONUNBUFFERED": "1",
    }
    if peers_file is not None:
        env["PDFABRIC_PEERS_FILE"] = str(peers_file)
    return env


@dataclass
class AgentProcess:
    """One agent process: its command, environment, loopback ports and log file."""

    name: str  # the agent's (pod's) name, as in the rank map
    node: str
    argv: list[str]
    env: dict[str, str]
    api_port: int
    metrics_port: int
    log_path: Path
    uid: str = ""  # the pod's uid when PodRunner started it: a replaced pod is a new process
    proc: subprocess.Popen[bytes] | None = None
    peer_port: int = 0  # the peer door (mutual TLS)

    @property
    def address(self) -> str:
        """The engine door (loopback, engine token)."""
        return f"127.0.0.1:{self.api_port}"

    @property
    def host(self) -> str:
        """Where the peer door and the metrics port listen (the pod address in a pod)."""
        return self.env.get("PDFABRIC_BIND_ADDRESS") or "127.0.0.1"

    @property
    def peer_address(self) -> str:
        return f"{self.host}:{self.peer_port}"

    @property
    def tls_dir(self) -> str:
        """This agent's certificate, key and cluster CA (what its Secret holds)."""
        return self.env["PDFABRIC_PEER_TLS_DIR"]

    @property
    def peer_host(self) -> str:
        """The name peers dial this agent by, and its certificate carries."""
        template = self.env.get("PDFABRIC_PEER_HOST_TEMPLATE") or DEFAULT_PEER_HOST_TEMPLATE
        with open(self.env["PDFABRIC_RANKMAP"], encoding="utf-8") as fh:
            rm = RankMap.from_json(fh.read())
        return template.format(name=self.name, cluster=rm.cluster, namespace=rm.namespace)

    def start(self) -> AgentProcess:
        """Start the process; one already running is left as it is (a second start of a running
        agent orphaned it, with its engines, for the rest of the machine's life)."""
        if self.alive():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # A session of its own, so stop() reaches whatever the agent started, too.
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM, after SIGCONT for a process a test froze with SIGSTOP."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float = 15) -> None:
        """Wait for the process to exit; SIGKILL it when it has not within ``timeout``."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 15) -> None:
        self.terminate()
        self.wait(timeout)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the agent's /readyz; (0, {}) while nothing answers."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/readyz", timeout=1) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except (urllib.error.URLError, OSError):
            return 0, {}

    def ready(self) -> bool:
        return self.readyz()[0] == 200

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.1)
        raise TimeoutError(f"agent {self.name} not ready in {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-chars:]
        except OSError:
            return ""

    def scrape(self) -> Samples:
        """The agent's /metrics as {(sample name, labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def write_tls_dir(path: Path, leaf: pki.KeyPair, ca: pki.KeyPair) -> Path:
    """A peer TLS directory as the agent's Secret volume holds it (tls.crt, tls.key, ca.crt)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, data in ((tls.CERT_FILE, leaf.cert_pem), (tls.KEY_FILE, leaf.key_pem), (tls.CA_FILE, ca.cert_pem)):
        (path / name).write_bytes(data)
        (path / name).chmod(0o400 if name == tls.KEY_FILE else 0o444)
    return path


def peer_request(
    agent: AgentProcess,
    method: str,
    path: str,
    data: bytes | None = None,
    *,
    tls_dir: str | None = None,
    timeout: float = 5.0,
) -> tuple[int, dict[str, Any]]:
    """One request on ``agent``'s peer door, presenting the certificate in ``tls_dir`` (none when
    None) and verifying the agent's certificate against its cluster CA and its peer host name.
    Raises ssl.SSLError / OSError when the door refuses the handshake."""
    if tls_dir is not None:
        ctx = tls.client_context(tls_dir)
    else:
        ctx = ssl.create_default_context(cafile=os.path.join(agent.tls_dir, tls.CA_FILE))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=os.path.join(agent.tls_dir, tls.CA_FILE))  # the server is this cluster's
    raw = socket.create_connection((agent.host, agent.peer_port), timeout=timeout)
    try:
        sock = ctx.wrap_socket(raw, server_hostname=agent.peer_host)
    except BaseException:
        raw.close()
        raise
    conn = http.client.HTTPConnection(agent.host, agent.peer_port, timeout=timeout)
    conn.sock = sock
    try:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, json.loads(body) if body else {}
    finally:
        conn.close()


@dataclass(frozen=True)
class LocalEngine:
    """One engine of a node pod, run by that pod's agent: where it serves here, what the agent says of it."""

    pod: str
    name: str
    port: int
    bootstrap_port: int
    agent: AgentProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> EngineState | None:
        _, body = self.agent.readyz()
        for raw in body.get("engines") or []:
            st = EngineState.from_json(raw)
            if st is not None and st.name == self.name:
                return st
        return None

    def healthy(self) -> bool:
        """GET /health answers 200 (what the agent probes)."""
        return answers_200(self.url + "/health", 1)

    def kill(self) -> int:
        """SIGKILL the engine's process group, as an OOM kill or a crash would end it; its pid."""
        st = self.state()
        if st is None or not st.pid:
            raise RuntimeError(f"engine {self.name} of {self.pod} is not running: {st}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(st.pid, signal.SIGKILL)
        return st.pid


def stop_all(agents: Iterable[AgentProcess], timeout: float = 10) -> None:
    """SIGTERM every process first, then wait for each: they shut down side by side."""
    agents = list(agents)
    for agent in agents:
        agent.terminate()
    for agent in agents:
        agent.wait(timeout)


def place(spec: PDClusterSpec, *, ranks_per_agent: int = 0, decode_gpu: int = 0) -> list[AgentEntry]:
    """One agent per (role, replica), or per ``ranks_per_agent`` ranks of it when > 0; decode ranks
    on GPU ``decode_gpu``, prefill ranks on GPU 0."""
    agents: list[AgentEntry] = []
    groups: list[tuple[str, int, list[Rank]]] = []
    for r in range(spec.prefill.replicas):
        groups.append(("prefill", r, replica_ranks(spec, Role.PREFILL, r)))
    for r in range(spec.decode.replicas):
        groups.append(("decode", r, replica_ranks(spec, Role.DECODE, r, gpu=decode_gpu)))
    for role, replica, ranks in groups:
        size = ranks_per_agent or len(ranks)
        for i in range(0, len(ranks), size):
            name = f"agent-{role[0]}{replica}-{i // size}"
            agents.append(AgentEntry(name, f"node-{role[0]}{replica}-{i // size}", tuple(ranks[i : i + size])))
    return agents


class LocalFabric:
    """Real agent processes of one PDCluster on this machine; a context manager that starts them
    all and, on exit, stops them and removes what they left."""

    spec: PDClusterSpec
    rankmap: RankMap
    token: str  # the engine token
    ca: pki.KeyPair | None  # the cluster CA, when this fabric issued the certificates itself
    agents: dict[str, AgentProcess]  # by agent (pod) name
    workdir: str

    def __init__(
        self,
        raw_spec: Mapping[str, Any],
        *,
        ranks_per_agent: int = 0,
        env: Mapping[str, str] | None = None,
        # The rank map's transport: default the spec's; the operator writes "tcp" after a declared
        # placement fallback, which is how pools that need GPUs are exercised on a CPU box.
        transport: str = "",
        # The GPU decode ranks use (prefill ranks use GPU 0): 1 on a two-GPU machine puts the roles
        # on two GPUs, as INTRA_NODE_NVLINK between prefill and decode needs.
        decode_gpu: int = 0,
        # With spec.engine: the installed distribution's folder the engines import (entry points).
        engine_pythonpath: Iterable[str] = (),
    ) -> None:
        spec = parse_spec(raw_spec)
        # Under /var/tmp, not /tmp: the engines' sandbox hides each agent's TLS directory here, and a
        # sandboxed engine cannot read what is created later directly in a directory on the way
        # there (sandbox.py), which /tmp would be for every temporary file an engine writes.
        base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = tempfile.TemporaryDirectory(
            prefix="pdfabric-local-", dir=base
        )
        workdir = Path(self._tmp.name)
        entries = place(spec, ranks_per_agent=ranks_per_agent, decode_gpu=decode_gpu)
        # A fresh uid per fabric, shaped like a PDCluster's metadata.uid: two fabrics in one process
        # are two clusters; the uid's first 8 characters scope the agents' pool file names and
        # their stale-pool cleanup.
        uid = str(uuid.uuid4())
        transport = transport or spec.transfer.effective_transport.value
        rankmap = RankMap("default", "demo", uid, transport, dict(raw_spec), tuple(entries))
        token = secrets.token_hex(16)
        (workdir / "rankmap.json").write_text(rankmap.to_json(), encoding="utf-8")
        (workdir / "engine-token").write_text(token, encoding="utf-8")
        # What the operator issues: the cluster's CA, one certificate per agent named as its pod.
        ca = pki.new_ca(rankmap.namespace, rankmap.cluster, uid)
        ports = {e.name: (free_port(), free_port(), free_port()) for e in entries}
        peers = {name: peer for name, (_, peer, _) in ports.items()}
        agents = {}
        engines: dict[tuple[str, str], tuple[int, int]] = {}
        for e in entries:
            api, peer, met = ports[e.name]
            host = DEFAULT_PEER_HOST_TEMPLATE.format(name=e.name, cluster=rankmap.cluster, namespace=rankmap.namespace)
            tls_dir = write_tls_dir(
                workdir / f"{e.name}-tls",
                pki.issue_agent(ca, namespace=rankmap.namespace, cluster=rankmap.cluster, agent=e.name, dns_name=host),
                ca,
            )
            agent_env = {
                **os.environ,
                "NODE_NAME": e.node,
                "POD_NAME": e.name,
                "PDFABRIC_RANKMAP": str(workdir / "rankmap.json"),
                "PDFABRIC_ENGINE_TOKEN_FILE": str(workdir / "engine-token"),
                "PDFABRIC_PEER_TLS_DIR": str(tls_dir),
                "PDFABRIC_KV_PAGES": "64",
                "PDFABRIC_STATE_SLOTS": "8",
                "PDFABRIC_AUX_SLOTS": "8",
                **loopback_env(peers, api, peer, met, os.environ),
                **(env or {}),
            }
            if spec.engine is not None:  # the agent runs its node's engines (docs/engines.md)
                extra, where = engines_env(spec, e.ranks, workdir / "bin", agent_env, engine_pythonpath)
                agent_env.update(extra)
                engines.update({(e.name, name): (port, boot) for name, port, boot in where})
            argv = console_argv(["pdfabric-agent"])
            agents[e.name] = AgentProcess(
                e.name, e.node, argv, agent_env, api, met, workdir / f"{e.name}.log", peer_port=peer
            )
        self._attach(spec, rankmap, token, agents, str(workdir))
        self.ca = ca
        self.engines = {
            key: LocalEngine(key[0], key[1], port, boot, agents[key[0]]) for key, (port, boot) in engines.items()
        }

    @classmethod
    def from_cluster(cls, cluster: LocalCluster, namespace: str, name: str, runner: PodRunner) -> LocalFabric:
        """The agents PodRunner runs for PDCluster ``namespace/name``, with the rank map and token
        the operator published for it. The runner owns the processes; close() here only stops them."""
        obj = cluster.get_json("pdcluster", name, "-n", namespace)
        selector = f"pdfabric.dev/cluster={name}"
        maps = cluster.get_json("configmaps", "-n", namespace, "-l", selector)["items"]
        (cm,) = [m for m in maps if RANKMAP_KEY in m.get("data", {})]
        rankmap = RankMap.from_json(cm["data"][RANKMAP_KEY])
        secrets_ = cluster.get_json("secrets", "-n", namespace, "-l", selector)["items"]
        (secret,) = [s for s in secrets_ if s["metadata"]["name"] == f"{name}-engine-token"]
        (token_b64,) = secret["data"].values()
        agents = {e.name: runner.pods[e.name] for e in rankmap.agents}
        fabric = cls.__new__(cls)
        fabric._tmp = None
        fabric.ca = None  # the operator's, in its Secret
        fabric._attach(parse_spec(obj["spec"]), rankmap, base64.b64decode(token_b64).decode().strip(), agents, "")
        fabric.engines = {k: v for k, v in runner.engines.items() if k[0] in agents}
        return fabric

    def _attach(
        self, spec: PDClusterSpec, rankmap: RankMap, token: str, agents: dict[str, AgentProcess], workdir: str
    ) -> None:
        self.spec, self.rankmap, self.token, self.agents, self.workdir = spec, rankmap, token, agents, workdir
        self.engines: dict[tuple[str, str], LocalEngine] = {}  # (agent, engine name), with spec.engine
        self._clients: dict[tuple[str, str, str], AgentClient] = {}

    @property
    def uid(self) -> str:
        return self.rankmap.cluster_uid

    @property
    def kv_pages(self) -> int:
        """KV pages per pool, as the agents were configured (the agent default when not set)."""
        env = next(iter(self.agents.values())).env
        return int(env.get("PDFABRIC_KV_PAGES") or SETTINGS["PDFABRIC_KV_PAGES"][0] or 0)

    @property
    def shm_dir(self) -> str:
        """Where the agents' CPU pool files live."""
        env = next(iter(self.agents.values())).env if self.agents else {}
        return env.get("PDFABRIC_SHM_DIR") or "/dev/shm"

    # ------------------------------------------------------------------ processes
    def start(self, name: str | None = None, *, wait_s: float = 60.0, ready: bool = True) -> None:
        """Start every agent (or ``name``); with ``ready``, wait until each answers /readyz 200."""
        agents = [self.agents[name]] if name else list(self.agents.values())
        for agent in agents:
            agent.start()
        if ready:
            for agent in agents:
                agent.wait_ready(wait_s)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig``; for SIGKILL and SIGTERM, wait until the process is gone."""
        agent = self.agents[name]
        if agent.alive():
            agent.signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM) and agent.proc is not None:
                agent.proc.wait(timeout=15)

    def readyz(self, name: str) -> tuple[int, dict[str, Any]]:
        return self.agents[name].readyz()

    def bytes_by_path(self, role: str = "decode") -> dict[str, float]:
        """Bytes the agents counted into ``role``'s ranks, by "path/kind" (nvlink-kernel/kv, ...)."""
        out: dict[str, float] = {}
        for name in self.agents:
            for (metric, labels), value in self.scrape(name).items():
                d = dict(labels)
                if metric == "pdfabric_transfer_bytes_total" and d.get("role") == role and value:
                    key = f"{d['path']}/{d['kind']}"
                    out[key] = out.get(key, 0) + value
        return out

    def log(self, name: str) -> str:
        return self.agents[name].log_tail()

    def stop(self) -> None:
        stop_all(self.agents.values())

    def close(self) -> None:
        self.stop()  # first: nothing below may leave agents running
        try:
            from pdfabric_agent.process.main import remove_stale_pools

            # Agents killed with SIGKILL could not unlink their pool files; nobody restarts them now.
            remove_stale_pools(self.shm_dir, self.uid)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> LocalFabric:
        # Agents with spec.engine are ready once their engines load and answer: slower.
        try:
            self.start(wait_s=240 if self.spec.engine is not None else 60)
        except BaseException:
            # __exit__ does not run when __enter__ raises: one agent that never got ready left
            # the others (and their engines) running for the machine's life.
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ access
    def agent_of(self, rank_id: str) -> str:
        return self.rankmap.agent_for_rank(rank_id).name

    def entry(self, name: str) -> AgentEntry:
        """The rank map's entry of agent ``name``: its node and ranks."""
        return next(e for e in self.rankmap.agents if e.name == name)

    def client(self, rank_id_or_agent: str, *, token: str | None = None, uid: str | None = None) -> AgentClient:
        name = rank_id_or_agent if rank_id_or_agent in self.agents else self.agent_of(rank_id_or_agent)
        key = (self.agents[name].address, token or self.token, uid or self.uid)
        client = self._clients.get(key)
        if client is None:  # one per agent and identity, so its keep-alive connections are reused
            client = self._clients[key] = AgentClient(*key)
        return client

    def issue_peer_tls(self, agent: str, path: Path, *, ca: pki.KeyPair | None = None) -> str:
        """A peer TLS directory for agent name ``agent`` (in the rank map or not), from this
        fabric's CA or from ``ca`` (another cluster's), named and addressed as the operator names
        agents; for tests that call peer doors as someone else."""
        ca = ca or self.ca
        if ca is None:
            raise RuntimeError("this fabric's CA is the operator's; pass ca=")
        rm = self.rankmap
        host = DEFAULT_PEER_HOST_TEMPLATE.format(name=agent, cluster=rm.cluster, namespace=rm.namespace)
        leaf = pki.issue_agent(ca, namespace=rm.namespace, cluster=rm.cluster, agent=agent, dns_name=host)
        return str(write_tls_dir(path, leaf, ca))

    def peer_post(
        self, target: str, path: str, data: bytes, *, as_agent: str | None, tls_dir: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """POST ``data`` to agent ``target``'s peer door as agent ``as_agent`` (its certificate),
        or with the certificate in ``tls_dir``, or with none (both None)."""
        if tls_dir is None and as_agent is not None:
            tls_dir = self.agents[as_agent].tls_dir
        return peer_request(self.agents[target], "POST", path, data, tls_dir=tls_dir)

    def scrape(self, name: str) -> Samples:
        """Parse the agent's /metrics into {(sample name, labels): value}."""
        return self.agents[name].scrape()

    def metric_sum(self, sample: str, names: list[str] | None = None, **labels: str) -> float:
        total = 0.0
        for name in names or list(self.agents):
            for (n, lbl), value in self.scrape(name).items():
                if n == sample and all(dict(lbl).get(k) == v for k, v in labels.items()):
                    total += value
        return total
