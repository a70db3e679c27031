"""Run the real command of pods bound to fake nodes as local processes.

kwok marks pods Running but runs nothing. For end-to-end tests and the demo, PodRunner reads the
pods the operator made, materialises what the kubelet would (downward-API env, ConfigMap and
Secret volumes), and starts each container command on this machine. Every pod gets its own free
loopback ports in place of its container ports, and learns its peers' addresses through
PDFABRIC_PEERS, standing in for the headless Service's DNS names.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfabric_devcluster.cluster import REPO_ROOT, ClusterError, LocalCluster, free_port

PYTHONPATH = os.pathsep.join(str(REPO_ROOT / p) for p in ("core", "operator", "agent"))


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: container commands and the entry points they name."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["project"]["scripts"])


def console_argv(command: list[str]) -> list[str]:
    """argv running one of this project's console scripts from the repository sources, as the
    script pip generates would (the container's entry point, without an install)."""
    scripts = console_scripts()
    if command[0] not in scripts:
        raise ClusterError(f"command {command[0]!r} is not one of this project's scripts {sorted(scripts)}")
    module, func = scripts[command[0]].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *command[1:]]


@dataclass
class LocalPod:
    name: str
    uid: str
    node: str
    ports: dict[str, int]  # container port name -> local port
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class PodRunner:
    def __init__(self, cluster: LocalCluster, namespace: str, selector: str, workdir: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = selector
        self.workdir = workdir
        self.pods: dict[str, LocalPod] = {}  # by pod name
        self._planned_ports: dict[str, dict[str, int]] = {}

    def list_pods(self) -> list[dict[str, Any]]:
        out = self.cluster.get_json("pods", "-n", self.namespace, "-l", self.selector)
        return [p for p in out["items"] if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]

    def sync(self) -> dict[str, LocalPod]:
        """Start processes for new pods, stop those whose pod is gone or was replaced."""
        pods = {p["metadata"]["name"]: p for p in self.list_pods()}
        for name, local in list(self.pods.items()):
            if name not in pods or pods[name]["metadata"]["uid"] != local.uid:
                local.stop()
                del self.pods[name]
        for name, pod in pods.items():
            self._planned_ports.setdefault(name, {})
            for c in pod["spec"]["containers"]:
                for port in c.get("ports", []):
                    self._planned_ports[name].setdefault(port["name"], free_port())
        peers = {name: f"127.0.0.1:{ports['api']}" for name, ports in self._planned_ports.items() if "api" in ports}
        for name, pod in pods.items():
            if name not in self.pods:
                self.pods[name] = self._start(pod, peers)
        return self.pods

    def restart(self, name: str) -> LocalPod:
        """Start a pod's process again (after a test killed it), on the same ports."""
        pod = self.cluster.get_json("pod", name, "-n", self.namespace)
        old = self.pods.pop(name, None)
        if old:
            old.stop()
        peers = {n: f"127.0.0.1:{p['api']}" for n, p in self._planned_ports.items() if "api" in p}
        self.pods[name] = self._start(pod, peers)
        return self.pods[name]

    def stop(self) -> None:
        for local in self.pods.values():
            local.stop()
        self.pods.clear()

    # ---- what the kubelet would do ------------------------------------------------------------
    def _start(self, pod: dict[str, Any], peers: dict[str, str]) -> LocalPod:
        meta, spec = pod["metadata"], pod["spec"]
        (container,) = spec["containers"]  # agent pods have exactly one container
        root = self.workdir / meta["name"] / meta["uid"][:8]
        mounts = self._materialise_volumes(spec.get("volumes", []), container.get("volumeMounts", []), root)
        ports = self._planned_ports[meta["name"]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDFABRIC_")}
        for var in container.get("env", []):
            env[var["name"]] = self._resolve(var, pod)
        for key, value in list(env.items()):  # paths inside mounts move to where the files really are
            for mount_path, local_dir in mounts.items():
                if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                    env[key] = str(local_dir) + value[len(mount_path.rstrip("/")) :]
        env.update(
            {
                "PDFABRIC_BIND_ADDRESS": "127.0.0.1",
                "PDFABRIC_PEERS": json.dumps(peers),
                "PDFABRIC_ENGINE_HOST": "127.0.0.1",
                "PYTHONPATH": PYTHONPATH + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if "api" in ports:
            env["PDFABRIC_API_PORT"] = str(ports["api"])
        if "metrics" in ports:
            env["PDFABRIC_METRICS_PORT"] = str(ports["metrics"])
        argv = self._command(container)
        log = root / "container.log"
        root.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        return LocalPod(meta["name"], meta["uid"], spec["nodeName"], dict(ports), root, proc, log)

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
        module, func = scripts[command[0]].split(":")
        # The console script pip would generate, run from the repository sources.
        return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *command[1:]]

    def _resolve(self, var: dict[str, Any], pod: dict[str, Any]) -> str:
        if "value" in var:
            return str(var["value"])
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
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
        self, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], root: Path
    ) -> dict[str, Path]:
        by_name = {v["name"]: v for v in volumes}
        out: dict[str, Path] = {}
        for mount in mounts:
            volume = by_name[mount["name"]]
            target = root / "volumes" / mount["name"]
            target.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self.cluster.get_json("configmap", volume["configMap"]["name"], "-n", self.namespace)
                data = {k: v.encode() for k, v in cm.get("data", {}).items()}
                items = volume["configMap"].get("items")
            elif "secret" in volume:
                secret = self.cluster.get_json("secret", volume["secret"]["secretName"], "-n", self.namespace)
                data = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
                items = volume["secret"].get("items")
            else:
                raise ClusterError(f"volume {mount['name']}: only configMap and secret volumes run locally")
            for key, value in data.items():
                paths = [i["path"] for i in items if i["key"] == key] if items else [key]
                for rel in paths:
                    path = target / rel
                    path.write_bytes(value)
                    path.chmod(0o400 if "secret" in volume else 0o444)
            out[mount["mountPath"]] = target
        return out
