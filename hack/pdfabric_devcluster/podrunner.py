"""Run the real command of agent pods bound to fake nodes as local processes.

kwok marks pods Running but runs nothing. For end-to-end tests and the demo, PodRunner reads the
agent pods the operator made, materialises what the kubelet would (downward-API, Secret and
ConfigMap env, ``$(VAR)`` expansion of env values; ConfigMap and Secret volumes: the rank map, the
engine token, the pod's own peer certificate; a memory-backed ``emptyDir`` as a directory under
this machine's /dev/shm), and starts the container's command on this machine as an AgentProcess,
with the loopback ports and peer addresses of agents.loopback_env (the engine door, which has no
containerPort, gets a port of its own too). Fabric.from_cluster drives them.
``addresses_file`` maps each pod to its agent's metrics address (the operator's
PDFABRIC_AGENT_ADDRESSES, in place of pod IP and metrics port); ``peers_file`` maps each to its
peer door (PDFABRIC_PEERS_FILE: the cluster DNS for agents of pods that come later).

As the kubelet does, ``refresh_volumes`` rewrites a running pod's ConfigMap volumes when the
ConfigMap changed (an atomic swap, so a reader sees the old file or the new one), and ``kubelet()``
runs ``sync`` and ``refresh_volumes`` every second in the background: pods the operator adds
start, pods it deletes stop, a new rank map reaches the running agents (live membership).

With spec.engine the container's agent runs the engines itself (PDFABRIC_ENGINES). The image is
this machine's environment then: ``python``/``python3`` on PATH is this interpreter (or, for an
image ``images`` names, that image's own environment's, e.g. vLLM's, its scripts on PATH too), the
repository's packages (and ``pythonpath``, e.g. an installed distribution's entry points) are on
PYTHONPATH, and each engine port of the launch message becomes the loopback port its container
port got (the pod network on one shared loopback). ``engine(pod, name)`` finds an engine.
``start_routers`` runs spec.router's pods' command too (SGLang's or vLLM's router), their engine
URLs resolved to those loopback ports (``local_url``), as the cluster DNS would resolve them.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdfabric_core.engines.launch import ENGINES_ENV, expand
from pdfabric_devcluster.agents import (
    AgentProcess,
    LocalEngine,
    LocalImage,
    engine_image_env,
    loopback_env,
    stop_all,
)
from pdfabric_devcluster.binaries import ClusterError
from pdfabric_devcluster.cluster import LocalCluster
from pdfabric_devcluster.procs import console_argv, console_scripts, free_port
from pdfabric_devcluster.sglang_router import SGLangRouter

SHM_PATH = "/dev/shm"


class PodRunner:
    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        selector: str,
        workdir: Path,
        *,
        pythonpath: Sequence[str] = (),
        images: Mapping[str, LocalImage] | None = None,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = selector
        self.workdir = workdir
        self.pythonpath = list(pythonpath)
        # Images whose Python is not this interpreter (vLLM's environment), by image name.
        self.images = dict(images or {})
        self.pods: dict[str, AgentProcess] = {}  # by pod name
        self.engines: dict[tuple[str, str], LocalEngine] = {}  # (pod, engine name)
        self._empty_dirs: dict[tuple[str, ...], Path] = {}
        self._planned_ports: dict[str, dict[str, int]] = {}
        self._container_ports: dict[str, dict[int, int]] = {}  # pod -> container port -> loopback port
        self.routers: dict[str, SGLangRouter] = {}  # spec.router's pods, by pod name (start_routers)
        # {pod name: "127.0.0.1:<metrics port>"}, rewritten by sync(): the operator's
        # PDFABRIC_AGENT_ADDRESSES, so it reads these processes' /readyz (agentstate.py).
        self.addresses_file = workdir / "agent-addresses.json"
        self.peers_file = workdir / "agent-peers.json"  # {pod name: "127.0.0.1:<peer port>"}
        # pod name -> (ConfigMap name, its items or None for every key, the volume's directory)
        self._config_volumes: dict[str, list[tuple[str, list[dict[str, Any]] | None, Path]]] = {}
        self._lock = threading.RLock()  # sync and refresh_volumes, from a test and from kubelet()

    def list_pods(self) -> list[dict[str, Any]]:
        out = self.cluster.get_json("pods", "-n", self.namespace, "-l", self.selector)
        return [p for p in out["items"] if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]

    def sync(self) -> dict[str, AgentProcess]:
        """Start processes for new pods, stop those whose pod is gone or was replaced."""
        with self._lock:
            return self._sync()

    def _sync(self) -> dict[str, AgentProcess]:
        pods = {p["metadata"]["name"]: p for p in self.list_pods()}
        for name, local in list(self.pods.items()):
            if name not in pods or pods[name]["metadata"]["uid"] != local.uid:
                local.stop()
                del self.pods[name]
                self._config_volumes.pop(name, None)
                self.engines = {k: v for k, v in self.engines.items() if k[0] != name}
        for name, pod in pods.items():
            self._planned_ports.setdefault(name, {})
            for c in pod["spec"]["containers"]:
                for port in c.get("ports", []):
                    self._planned_ports[name].setdefault(port["name"], free_port())
            # The engine door listens on the pod's loopback (no containerPort); here all agents
            # share one loopback, so each gets its own port.
            self._planned_ports[name].setdefault("api", free_port())
            self._container_ports[name] = {
                port["containerPort"]: self._planned_ports[name][port["name"]]
                for c in pod["spec"]["containers"]
                for port in c.get("ports", [])
            }
        peers = {name: ports["peer"] for name, ports in self._planned_ports.items() if "peer" in ports}
        self._write_json(self.peers_file, {name: f"127.0.0.1:{port}" for name, port in peers.items()})
        for name, pod in pods.items():
            if name not in self.pods:
                self.pods[name] = self._start(pod, peers)
        self._write_addresses()
        return self.pods

    def _write_addresses(self) -> None:
        self._write_json(self.addresses_file, {name: f"127.0.0.1:{p.metrics_port}" for name, p in self.pods.items()})

    def _write_json(self, path: Path, data: dict[str, str]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)  # read again by others: never a half-written file

    def refresh_volumes(self) -> int:
        """Rewrite the ConfigMap volumes of running pods whose ConfigMap changed, as the kubelet
        does on its sync of the pod; returns the files rewritten."""
        with self._lock:
            wanted = {cm for mounts in self._config_volumes.values() for cm, _, _ in mounts}
            data = {}
            for cm in sorted(wanted):
                obj = self.cluster.get_json("configmap", cm, "-n", self.namespace)
                data[cm] = {k: v.encode() for k, v in obj.get("data", {}).items()}
            written = 0
            for mounts in self._config_volumes.values():
                for cm, items, target in mounts:
                    written += _write_items(target, data[cm], items, 0o444)
            return written

    @contextmanager
    def kubelet(self, every_s: float = 1.0) -> Iterator[PodRunner]:
        """``sync`` and ``refresh_volumes`` every `every_s` in a thread, until the block ends."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.sync()
                    self.refresh_volumes()
                except ClusterError as exc:  # the API server busy for a moment: try again
                    errors.append(exc)
                except BaseException as exc:
                    errors.append(exc)
                    raise

        thread = threading.Thread(target=loop, name="podrunner-kubelet", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=60)
        fatal = [e for e in errors if not isinstance(e, ClusterError)]
        if fatal:
            raise RuntimeError(f"the kubelet loop failed: {fatal[0]!r}") from fatal[0]

    def stop(self) -> None:
        for router in self.routers.values():
            router.stop()
        self.routers.clear()
        stop_all(self.pods.values(), timeout=45)  # an agent stops its engines first
        self.pods.clear()
        self.engines.clear()
        for path in self._empty_dirs.values():
            shutil.rmtree(path, ignore_errors=True)
        self._empty_dirs.clear()

    def engine(self, pod: str, name: str) -> LocalEngine:
        return self.engines[(pod, name)]

    def local_url(self, url: str) -> str:
        """An engine URL as the cluster's DNS gives it (``http://<agent pod>.<service>.<ns>.svc:<port>``)
        as this machine reaches it: the loopback port that pod's container port got."""
        parsed = urllib.parse.urlsplit(url)
        host, port = parsed.hostname or "", parsed.port
        pod = host.split(".")[0]
        if pod not in self._container_ports or port is None or not host.endswith(f".{self.namespace}.svc"):
            raise ClusterError(f"{url} names no running agent pod of namespace {self.namespace}")
        by_container_port = self._container_ports.get(pod, {})
        if port not in by_container_port:
            raise ClusterError(f"{url}: pod {pod} has no container port {port}")
        return urllib.parse.urlunsplit((parsed.scheme, f"127.0.0.1:{by_container_port[port]}", parsed.path, "", ""))

    def start_routers(self, selector: str = "app.kubernetes.io/component=router") -> list[SGLangRouter]:
        """Run spec.router's pods (its Deployment's, scheduled, run by nothing under KWOK) as the
        kubelet would run their container: its command and args as written, except that each
        engine URL goes to its loopback port (``local_url``: the cluster DNS here) and the listen
        address to a loopback port of its own. ``python3`` is this interpreter."""
        out = self.cluster.get_json("pods", "-n", self.namespace, "-l", selector)
        pods = [p for p in out["items"] if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
        for pod in pods:
            name = pod["metadata"]["name"]
            if name in self.routers:
                continue
            (container,) = pod["spec"]["containers"]
            argv = [*container.get("command", []), *container.get("args", [])]
            port, metrics = free_port(), free_port()
            argv_in = list(argv)
            for i, arg in enumerate(argv_in):
                if arg.startswith("http://"):
                    argv[i] = self.local_url(arg)
                elif i > 1 and argv_in[i - 2] == "--prefill" and arg.isdigit():
                    # The prefill engine's bootstrap port: a container port of the same pod, moved.
                    host = urllib.parse.urlsplit(argv_in[i - 1]).hostname
                    argv[i] = str(urllib.parse.urlsplit(self.local_url(f"http://{host}:{arg}")).port)
                elif i and argv_in[i - 1] in ("--host", "--prometheus-host"):
                    argv[i] = "127.0.0.1"  # not every interface of this machine
                elif i and argv_in[i - 1] == "--port":
                    argv[i] = str(port)
                elif i and argv_in[i - 1] == "--prometheus-port":
                    argv[i] = str(metrics)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PDFABRIC_")}
            env.update(self._image_env(container["image"], env))
            log = self.workdir / name / "router.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "wb") as fh:
                proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
            self.routers[name] = SGLangRouter(f"http://127.0.0.1:{port}", proc, log, f"http://127.0.0.1:{metrics}")
        return list(self.routers.values())

    def wait_engines_healthy(self, timeout: float = 120) -> None:
        """Every engine of every running pod answers its health path."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:  # the kubelet loop adds a restarted pod's engines meanwhile
                engines = list(self.engines.values())
            sick = [e for e in engines if not e.healthy()]
            if engines and not sick:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engines not healthy in {timeout:.0f} s: {[(e.pod, e.name, e.state()) for e in sick]}\n"
                    + "\n".join(f"--- {p}:\n{a.log_tail()}" for p, a in self.pods.items())
                )
            time.sleep(0.2)

    # ---- what the kubelet would do ------------------------------------------------------------
    def _start(self, pod: dict[str, Any], peers: dict[str, int]) -> AgentProcess:
        meta, spec = pod["metadata"], pod["spec"]
        (container,) = spec["containers"]  # agent pods have exactly one container
        root = self.workdir / meta["name"] / meta["uid"][:8]
        mounts = self._materialise_volumes(
            spec.get("volumes", []),
            container.get("volumeMounts", []),
            root,
            self._config_volumes.setdefault(meta["name"], []),
        )
        ports = self._planned_ports[meta["name"]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDFABRIC_")}
        defined: dict[str, str] = {}  # the kubelet expands $(VAR) against the container's own variables
        for var in container.get("env", []):
            defined[var["name"]] = self._resolve(var, pod, defined)
        env.update(defined)
        # The container's own /tmp. This machine's /tmp is on the way to the pod's peer-TLS files,
        # which the engines' sandbox hides, so nothing new may be made directly in it (g++, which
        # torch's inductor runs, insists on it); a directory made before the agent starts may. Short:
        # SGLang's IPC sockets live there (a socket path holds at most 107 bytes).
        tmp = Path(tempfile.mkdtemp(prefix="pdfpod-"))
        self._empty_dirs[("tmp", meta["name"], meta["uid"])] = tmp
        env["TMPDIR"] = str(tmp)
        if SHM_PATH in mounts and "PDFABRIC_SHM_DIR" not in env:
            env["PDFABRIC_SHM_DIR"] = SHM_PATH  # the agent's default: in its container, the pod's /dev/shm volume
        for key, value in list(env.items()):  # paths inside mounts move to where the files really are
            for mount_path, local_dir in mounts.items():
                if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                    env[key] = str(local_dir) + value[len(mount_path.rstrip("/")) :]
        env.update(loopback_env(peers, ports["api"], ports["peer"], ports["metrics"], env, self.peers_file))
        local_ports = self._container_ports[meta["name"]]
        launches: list[dict[str, Any]] = []
        if ENGINES_ENV in env:
            launches = self._local_launches(env[ENGINES_ENV], local_ports)
            env[ENGINES_ENV] = json.dumps(launches)
            env.update(self._image_env(container["image"], env))
        agent = AgentProcess(
            meta["name"], spec["nodeName"], self._command(container), env, ports["api"], ports["metrics"],
            root / "container.log", uid=meta["uid"], peer_port=ports["peer"],
        )  # fmt: skip
        for launch in launches:
            self.engines[(meta["name"], launch["name"])] = LocalEngine(
                meta["name"], launch["name"], launch["port"], launch.get("bootstrapPort", 0), agent
            )
        return agent.start()

    def _image_env(self, image: str, base: Mapping[str, str]) -> dict[str, str]:
        """``image``'s environment over ``base``: its own python where ``images`` names one, else
        this interpreter with ``pythonpath``."""
        if image in self.images:
            tag = "".join(ch if ch.isalnum() else "-" for ch in image)
            return engine_image_env(self.workdir / "bin" / tag, base, self.images[image])
        return engine_image_env(self.workdir / "bin", base, LocalImage(pythonpath=tuple(self.pythonpath)))

    def _local_launches(self, text: str, local_ports: dict[int, int]) -> list[dict[str, Any]]:
        """The launch message with each engine's ports moved to their container ports' loopback
        ports, and a group leader's rendezvous (another pod's name under the headless Service) to
        the loopback port that pod's container port got, as the cluster DNS would resolve it."""
        launches = json.loads(text)
        for launch in launches:
            for key in ("port", "bootstrapPort"):
                if key in launch:
                    if launch[key] not in local_ports:
                        raise ClusterError(f"engine {launch['name']}: {key} {launch[key]} is no container port")
                    launch[key] = local_ports[launch[key]]
            if "distInitAddr" in launch:
                url = urllib.parse.urlsplit(self.local_url(f"tcp://{launch['distInitAddr']}"))
                launch["distInitAddr"] = f"127.0.0.1:{url.port}"
        return list(launches)

    @staticmethod
    def _command(container: dict[str, Any]) -> list[str]:
        command = list(container.get("command", [])) + list(container.get("args", []))
        if not command:
            raise ClusterError(f"container {container['name']} has no command to run locally")
        scripts = console_scripts()
        if command[0] not in scripts:
            raise ClusterError(
                f"container command {command[0]!r} is not one of this project's scripts {sorted(scripts)}"
            )
        # The console script pip would generate, run from the repository sources.
        return console_argv(command)

    def _resolve(self, var: dict[str, Any], pod: dict[str, Any], defined: dict[str, str]) -> str:
        if "value" in var:
            return expand(str(var["value"]), defined)
        source = var.get("valueFrom", {})
        for kind, ref_key in (("secret", "secretKeyRef"), ("configmap", "configMapKeyRef")):
            if ref_key in source:
                ref = source[ref_key]
                obj = self.cluster.get_json(kind, ref["name"], "-n", self.namespace)
                data = obj.get("data", {})
                if ref["key"] not in data:
                    raise ClusterError(f"env {var['name']}: {kind} {ref['name']} has no key {ref['key']}")
                raw = data[ref["key"]]
                return base64.b64decode(raw).decode() if kind == "secret" else str(raw)
        field = source.get("fieldRef", {}).get("fieldPath")
        values = {
            "spec.nodeName": pod["spec"]["nodeName"],
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"]["uid"],
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        if field not in values:
            raise ClusterError(f"env {var['name']}: unsupported source {var.get('valueFrom')}")
        return values[field]

    def _materialise_volumes(
        self,
        volumes: list[dict[str, Any]],
        mounts: list[dict[str, Any]],
        root: Path,
        config_volumes: list[tuple[str, list[dict[str, Any]] | None, Path]],
    ) -> dict[str, Path]:
        by_name = {v["name"]: v for v in volumes}
        out: dict[str, Path] = {}
        for mount in mounts:
            volume = by_name[mount["name"]]
            target = root / "volumes" / mount["name"]
            if "emptyDir" in volume:
                out[mount["mountPath"]] = self._empty_dir(root, mount["name"], volume["emptyDir"])
                continue
            target.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self.cluster.get_json("configmap", volume["configMap"]["name"], "-n", self.namespace)
                data = {k: v.encode() for k, v in cm.get("data", {}).items()}
                items = volume["configMap"].get("items")
                config_volumes.append((volume["configMap"]["name"], items, target))
            elif "secret" in volume:
                secret = self.cluster.get_json("secret", volume["secret"]["secretName"], "-n", self.namespace)
                data = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
                items = volume["secret"].get("items")
            else:
                raise ClusterError(f"volume {mount['name']}: only configMap, secret and emptyDir volumes run locally")
            _write_items(
                target, data, items, volume["secret"].get("defaultMode", 0o644) if "secret" in volume else 0o444
            )
            out[mount["mountPath"]] = target
        return out

    def _empty_dir(self, root: Path, name: str, empty_dir: dict[str, Any]) -> Path:
        """One directory per pod and volume; a memory-backed one under this machine's /dev/shm."""
        key = (*root.relative_to(self.workdir).parts[:2], name)
        if key not in self._empty_dirs:
            if empty_dir.get("medium") == "Memory" and os.path.isdir(SHM_PATH):
                path = Path(tempfile.mkdtemp(prefix=f"pdfabric-{key[0]}-{name}-", dir=SHM_PATH))
            else:
                path = root / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
            self._empty_dirs[key] = path
        return self._empty_dirs[key]


def _write_items(target: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int) -> int:
    """A ConfigMap's or Secret's keys as files under `target` (only `items`, at their paths, when
    given), each replaced atomically and only when it differs; returns the files written."""
    written = 0
    for key, value in data.items():
        for rel in [i["path"] for i in items if i["key"] == key] if items else [key]:
            path = target / rel
            if path.exists() and path.read_bytes() == value:
                continue
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(value)
            tmp.chmod(mode)
            tmp.replace(path)
            written += 1
    return written
