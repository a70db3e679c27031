"""Run the real command of agent pods bound to fake nodes as local processes.

kwok marks pods Running but runs nothing. For end-to-end tests and the demo, PodRunner reads the
agent pods the operator made, materialises what the kubelet would (downward-API env, ConfigMap and
Secret volumes: the rank map, the engine token, the pod's own peer certificate), and starts each
container command on this machine as an AgentProcess, with the loopback ports and peer addresses
of fabric.loopback_env (the engine door, which has no containerPort, gets a port of its own too).
LocalFabric.from_cluster drives them. ``addresses_file`` maps each pod to its agent's metrics
address (the operator's PDFABRIC_AGENT_ADDRESSES, in place of pod IP and metrics port).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from pdfabric_devcluster.cluster import ClusterError, LocalCluster
from pdfabric_devcluster.fabric import AgentProcess, loopback_env, stop_all
from pdfabric_devcluster.procs import console_argv, console_scripts, free_port


class PodRunner:
    def __init__(self, cluster: LocalCluster, namespace: str, selector: str, workdir: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = selector
        self.workdir = workdir
        self.pods: dict[str, AgentProcess] = {}  # by pod name
        self._planned_ports: dict[str, dict[str, int]] = {}
        # {pod name: "127.0.0.1:<metrics port>"}, rewritten by sync(): the operator's
        # PDFABRIC_AGENT_ADDRESSES, so it reads these processes' /readyz (agentstate.py).
        self.addresses_file = workdir / "agent-addresses.json"

    def list_pods(self) -> list[dict[str, Any]]:
        out = self.cluster.get_json("pods", "-n", self.namespace, "-l", self.selector)
        return [p for p in out["items"] if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]

    def sync(self) -> dict[str, AgentProcess]:
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
            # The engine door listens on the pod's loopback (no containerPort); here all agents
            # share one loopback, so each gets its own port.
            self._planned_ports[name].setdefault("api", free_port())
        peers = {name: ports["peer"] for name, ports in self._planned_ports.items() if "peer" in ports}
        for name, pod in pods.items():
            if name not in self.pods:
                self.pods[name] = self._start(pod, peers)
        self._write_addresses()
        return self.pods

    def _write_addresses(self) -> None:
        addresses = {name: f"127.0.0.1:{p.metrics_port}" for name, p in self.pods.items()}
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.addresses_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(addresses))
        tmp.replace(self.addresses_file)  # the operator re-reads it: never a half-written file

    def stop(self) -> None:
        stop_all(self.pods.values(), timeout=15)
        self.pods.clear()

    # ---- what the kubelet would do ------------------------------------------------------------
    def _start(self, pod: dict[str, Any], peers: dict[str, int]) -> AgentProcess:
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
        env.update(loopback_env(peers, ports["api"], ports["peer"], ports["metrics"], env))
        agent = AgentProcess(
            meta["name"], spec["nodeName"], self._command(container), env, ports["api"], ports["metrics"],
            root / "container.log", uid=meta["uid"], peer_port=ports["peer"],
        )  # fmt: skip
        return agent.start()

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
