"""The engine containers of the operator's node pods (spec.engine), run as local processes.

EnginePodRunner is a PodRunner that, beside each pod's agent, runs every other container's real
command the way the kubelet would: its env (the operator's PDFABRIC_* contract, downward API),
``$(VAR)`` expanded in command and args, its volumes (the engine token Secret; the pod's
memory-backed /dev/shm ``emptyDir`` becomes one directory under this machine's /dev/shm, shared by
the pod's agent and engines), and the pod's network: each container port gets a free loopback
port (PDFABRIC_PORT and PDFABRIC_BOOTSTRAP_PORT say it) and the engine door on the pod's loopback
is this pod's agent's. An engine that exits is restarted with backoff, doubling from
``backoff_s`` up to ``max_backoff_s`` and reset after ``BACKOFF_RESET_S`` of running (the kubelet:
10 s doubling to 5 min, reset after 10 min), its exits counted as a container status would.

The image is this machine's environment: ``python``/``python3`` is this interpreter, with the
repository's packages (and ``pythonpath``, e.g. an installed distribution's entry points) on
PYTHONPATH; a command that is one of the project's console scripts runs from the sources.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdfabric_devcluster.cluster import ClusterError, LocalCluster
from pdfabric_devcluster.fabric import AgentProcess
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.procs import REPO_ROOT, console_argv, console_scripts

AGENT_CONTAINER = "agent"
ENGINE_PACKAGES = ("core", "operator", "agent", "integrations/sglang", "hack")
SHM_PATH = "/dev/shm"
BACKOFF_RESET_S = 30.0
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable is replaced, an undefined one kept,
    $$ is a literal $."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)


@dataclass
class EngineProcess:
    """One engine container's process, and its restarts."""

    pod: str
    pod_uid: str
    container: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    port: int  # the serving port (the container's first port) on loopback
    bootstrap_port: int = 0  # prefill's bootstrap server, on loopback
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)  # every exit seen, in order
    next_start: float = 0.0  # while waiting out a backoff
    failures: int = 0  # consecutive short-lived runs (the backoff's exponent)
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.restarts} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.started_at = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a crash would end it; the supervisor restarts it."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=15)

    def stop(self, timeout: float = 10) -> None:
        self.stopped = True
        self.signal(signal.SIGTERM)
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def healthy(self) -> bool:
        """GET /health answers 200 (the readiness probe)."""
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class EnginePodRunner(PodRunner):
    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        selector: str,
        workdir: Path,
        *,
        pythonpath: Sequence[str] = (),
        backoff_s: float = 1.0,
        max_backoff_s: float = 16.0,
    ) -> None:
        super().__init__(cluster, namespace, selector, workdir)
        self.pythonpath = list(pythonpath)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.engines: dict[tuple[str, str], EngineProcess] = {}  # (pod name, container)
        self._empty_dirs: dict[tuple[str, ...], Path] = {}
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ---- the runner's lifecycle ----------------------------------------------------------------
    def sync(self) -> dict[str, AgentProcess]:
        pods = super().sync()
        with self._lock:
            for key, engine in list(self.engines.items()):
                if engine.pod not in pods or pods[engine.pod].uid != engine.pod_uid:
                    engine.stop()
                    del self.engines[key]
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
            self._supervisor.start()
        return pods

    def stop(self) -> None:
        self._done.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        with self._lock:
            engines = list(self.engines.values())
            for engine in engines:
                engine.stopped = True
                engine.signal(signal.SIGTERM)
            for engine in engines:
                engine.stop()
            self.engines.clear()
        super().stop()
        for path in self._empty_dirs.values():
            shutil.rmtree(path, ignore_errors=True)
        self._empty_dirs.clear()

    def engine(self, pod: str, container: str) -> EngineProcess:
        with self._lock:
            return self.engines[(pod, container)]

    def wait_engines_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                engines = list(self.engines.values())
            if engines and all(e.healthy() for e in engines):
                return
            time.sleep(0.2)
        sick = [e for e in engines if not e.healthy()]
        raise TimeoutError(
            f"engines not healthy in {timeout:.0f} s: {[e.container for e in sick]}\n"
            + "\n".join(f"--- {e.pod}/{e.container}:\n{e.log_tail()}" for e in sick)
        )

    def _supervise(self) -> None:
        """The kubelet's restartPolicy Always: an exited engine starts again after its backoff."""
        while not self._done.wait(0.1):
            now = time.monotonic()
            with self._lock:
                for engine in self.engines.values():
                    if engine.stopped or engine.proc is None:
                        continue
                    code = engine.proc.poll()
                    if code is not None and engine.next_start == 0.0:
                        engine.exit_codes.append(code)
                        ran = now - engine.started_at
                        engine.failures = 1 if ran > BACKOFF_RESET_S else engine.failures + 1
                        delay = min(self.backoff_s * 2 ** (engine.failures - 1), self.max_backoff_s)
                        engine.next_start = now + delay
                    elif code is not None and now >= engine.next_start:
                        engine.next_start = 0.0
                        engine.restarts += 1
                        engine.start()

    # ---- what the kubelet would do for the engine containers ---------------------------------------
    def _start(self, pod: dict[str, Any], peers: dict[str, int]) -> AgentProcess:
        name = pod["metadata"]["name"]
        with self._lock:
            for key, engine in list(self.engines.items()):  # a replaced pod's engines go first
                if engine.pod == name:
                    engine.stop()
                    del self.engines[key]
        containers = pod["spec"]["containers"]
        agent_pod = copy.deepcopy(pod)
        (agent_c,) = [c for c in agent_pod["spec"]["containers"] if c["name"] == AGENT_CONTAINER]
        if any(m["mountPath"] == SHM_PATH for m in agent_c.get("volumeMounts", [])):
            # In its container the agent's default shm dir is the pod's /dev/shm volume.
            agent_c.setdefault("env", []).append({"name": "PDFABRIC_SHM_DIR", "value": SHM_PATH})
        agent_pod["spec"]["containers"] = [agent_c]
        agent = super()._start(agent_pod, peers)
        with self._lock:
            for c in containers:
                if c["name"] != AGENT_CONTAINER:
                    self.engines[(name, c["name"])] = self._start_engine(pod, c, agent).start()
        return agent

    def _materialise_volumes(
        self, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], root: Path
    ) -> dict[str, Path]:
        by_name = {v["name"]: v for v in volumes}
        empty = [m for m in mounts if "emptyDir" in by_name[m["name"]]]
        out = super()._materialise_volumes(volumes, [m for m in mounts if m not in empty], root)
        pod_key = root.relative_to(self.workdir).parts[:2]  # <pod>/<uid>: one volume per pod
        for mount in empty:
            key = (*pod_key, mount["name"])
            if key not in self._empty_dirs:
                memory = by_name[mount["name"]]["emptyDir"].get("medium") == "Memory"
                if memory and os.path.isdir(SHM_PATH):
                    path = Path(tempfile.mkdtemp(prefix=f"pdfabric-{pod_key[0]}-{mount['name']}-", dir=SHM_PATH))
                else:
                    path = root / "volumes" / mount["name"]
                    path.mkdir(parents=True, exist_ok=True)
                self._empty_dirs[key] = path
            out[mount["mountPath"]] = self._empty_dirs[key]
        return out

    def _start_engine(self, pod: dict[str, Any], container: dict[str, Any], agent: AgentProcess) -> EngineProcess:
        meta, spec = pod["metadata"], pod["spec"]
        root = self.workdir / meta["name"] / meta["uid"][:8]
        mounts = self._materialise_volumes(
            spec.get("volumes", []), container.get("volumeMounts", []), root / "containers" / container["name"]
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDFABRIC_")}
        for var in container.get("env", []):
            env[var["name"]] = self._resolve(var, pod)
        for key, value in list(env.items()):  # paths inside mounts move to where the files really are
            for mount_path, local_dir in mounts.items():
                if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                    env[key] = str(local_dir) + value[len(mount_path.rstrip("/")) :]
        # The pod's network on a shared loopback: each container port is a free port here.
        planned = self._planned_ports[meta["name"]]
        local = {str(p["containerPort"]): planned[p["name"]] for p in container.get("ports", [])}
        for key in ("PDFABRIC_PORT", "PDFABRIC_BOOTSTRAP_PORT"):
            if env.get(key) in local:
                env[key] = str(local[env[key]])
        if "PDFABRIC_AGENT_ADDRESS" in env:
            env["PDFABRIC_AGENT_ADDRESS"] = agent.address  # the pod's loopback: its agent's engine door
        own = [str(REPO_ROOT / p) for p in ENGINE_PACKAGES]
        env["PYTHONPATH"] = os.pathsep.join([*own, *self.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        command = [expand(x, env) for x in [*container.get("command", []), *container.get("args", [])]]
        ports = container.get("ports", [])
        return EngineProcess(
            meta["name"], meta["uid"], container["name"], self._engine_argv(container["name"], command), env,
            root / f"{container['name']}.log",
            port=planned[ports[0]["name"]] if ports else 0,
            bootstrap_port=planned[ports[1]["name"]] if len(ports) > 1 else 0,
        )  # fmt: skip

    @staticmethod
    def _engine_argv(name: str, command: list[str]) -> list[str]:
        if not command:
            raise ClusterError(f"container {name} has no command to run locally")
        if command[0] in ("python", "python3"):
            return [sys.executable, *command[1:]]
        if command[0] in console_scripts():
            return console_argv(command)
        raise ClusterError(f"container {name}: {command[0]!r} is neither python nor one of this project's scripts")
