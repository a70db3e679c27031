"""Agent processes on this machine, as a pod's kubelet and network would run them: the command
and environment (``loopback_env``: loopback ports for the pod's ports, peers' peer doors;
``engines_env``/``engine_image_env``: an engine image's python and packages), the process
(``AgentProcess``: start, signal, /readyz, /metrics), its engines (``LocalEngine``), and a call
on a peer door with a client certificate (``peer_request``). LocalFabric and PodRunner both
start their agents through these.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfabric_agent.protocol import tls
from pdfabric_agent.runtime.config import SETTINGS
from pdfabric_core.engines.groups import engine_launches
from pdfabric_core.engines.launch import ENGINES_ENV
from pdfabric_core.engines.state import EngineState
from pdfabric_core.rankmap import Rank, RankMap
from pdfabric_core.spec import PDClusterSpec
from pdfabric_devcluster.binaries import wait_for
from pdfabric_devcluster.procs import REPO_ROOT, answers_200, file_tail, free_port, source_pythonpath
from pdfabric_operator import pki

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


DEFAULT_PEER_HOST_TEMPLATE = SETTINGS["PDFABRIC_PEER_HOST_TEMPLATE"][0] or ""
# What an engine image has on its PYTHONPATH besides pdfabric's own packages: the engines'
# integrations (SGLang's plugin, vLLM's connector) and the reference engine.
ENGINE_PACKAGES = ("integrations/sglang", "integrations/vllm", "hack")


@dataclass(frozen=True)
class LocalImage:
    """An image's Python as this machine has it: the interpreter its ``python`` runs (an
    environment of its own, e.g. vLLM's, whose console scripts such as vllm-router are on its
    PATH too) and what more it has on its PYTHONPATH (e.g. pdfabric installed with its entry points)."""

    python: str = sys.executable
    pythonpath: tuple[str, ...] = ()


def python_bin(bin_dir: Path, python: str = sys.executable) -> Path:
    """A PATH entry whose python and python3 run ``python`` (an engine image's python).
    Scripts, not symlinks: a symlinked venv python elsewhere would not find its pyvenv.cfg."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        script = bin_dir / name
        if not script.exists():
            script.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
            script.chmod(0o755)
    return bin_dir


def engine_image_env(bin_dir: Path, base: Mapping[str, str], image: LocalImage = LocalImage()) -> dict[str, str]:
    """An engine image's environment on this machine, over an agent's ``base`` (whose PYTHONPATH
    already has the sources): the image's python on PATH (and its environment's scripts, when it is
    not this one), the engine packages and the image's own on PYTHONPATH."""
    own = [str(REPO_ROOT / p) for p in ENGINE_PACKAGES]
    scripts = [str(Path(image.python).parent)] if image.python != sys.executable else []
    return {
        "PATH": os.pathsep.join([str(python_bin(bin_dir, image.python)), *scripts, base.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([base.get("PYTHONPATH", ""), *own, *image.pythonpath]),
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
    image = LocalImage(pythonpath=tuple(pythonpath))
    return {ENGINES_ENV: json.dumps(launches), **engine_image_env(bin_dir, base, image)}, where


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

    def answered_readyz(self, timeout_s: float = 20.0) -> tuple[int, dict[str, Any]]:
        """/readyz as soon as the agent answers: on a loaded machine one probe can miss its
        1 s, which says nothing of what the agent runs on."""
        answer: tuple[int, dict[str, Any]] = wait_for(
            lambda: (got := self.readyz())[0] and got,
            timeout=timeout_s,
            interval=0.2,
            what=f"agent {self.name}'s /readyz",
        )
        return answer

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
        return file_tail(self.log_path, chars)

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
        """GET /health answers 200 (what the agent probes). SGLang's /health generates a token, which
        on a busy machine with TP over processes takes longer than a second."""
        return answers_200(self.url + "/health", 5)

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
