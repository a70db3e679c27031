"""The serving engines of a node pod (spec.engine), as plain dicts: pure functions of (spec, placement).

One container per engine group: the ranks of one replica of one role placed on the node (with
spec.engine a replica is never split across nodes, the planner keeps its ranks together). The
container requests exactly its ranks' GPUs from the device plugin, so it sees those GPUs and no
others, as indices 0..n-1 in the group's rank order (pp, cp, tp); the agent container then holds
none. Engine and agent share the pod's IPC namespace (containers of one pod always do) and a
memory-backed /dev/shm, and the engine reaches the agent's engine door on the pod's loopback.
docs/engines.md says why this shape and what it costs.

The k-th engine of a role in the pod serves on `port + k` (prefill's bootstrap server on
`bootstrapPort + k`): engines of one pod share its network namespace. The container's environment
tells the engine's command its port, GPU count and parallel sizes, so args can say
`--port $(PDFABRIC_PORT)` (the kubelet expands $(VAR) in command and args).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import EngineRoleSpec, EngineSpec, PDClusterSpec
from pdfabric_operator import constants as c
from pdfabric_operator.planner import AgentPlacement

SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
PROBE_PERIOD_S = 10


@dataclass(frozen=True)
class EngineGroup:
    """One engine container: the ranks of one replica of one role on this node."""

    role: Role
    replica: int
    index: int  # the k-th engine of its role in this pod: its ports are base + k
    ranks: tuple[Rank, ...]

    @property
    def name(self) -> str:
        """Container name, unique in the pod: prefill-0, decode-3."""
        return f"{self.role.value}-{self.replica}"

    @property
    def port_name(self) -> str:
        """Serving port's name (<= 15 characters): p-http-0, d-http-2 (k = index)."""
        return f"{self.role.value[0]}-http-{self.index}"

    @property
    def bootstrap_port_name(self) -> str:
        return f"p-boot-{self.index}"


def engine_groups(agent: AgentPlacement) -> list[EngineGroup]:
    """The engine groups of one node, in the agent's rank order (prefill first, then by replica)."""
    by_key: dict[tuple[Role, int], list[Rank]] = {}
    for r in agent.ranks:
        by_key.setdefault((Role(r.role), r.replica), []).append(r)
    out: list[EngineGroup] = []
    seen: dict[Role, int] = {}
    for (role, replica), ranks in by_key.items():
        k = seen.get(role, 0)
        seen[role] = k + 1
        out.append(EngineGroup(role, replica, k, tuple(ranks)))
    return out


def serving_port(engine: EngineSpec, group: EngineGroup) -> int:
    return engine.role(group.role.value).port + group.index


def bootstrap_port(engine: EngineSpec, group: EngineGroup) -> int | None:
    """Prefill engines' bootstrap port; None for decode."""
    return engine.prefill.bootstrap_port + group.index if group.role is Role.PREFILL else None


def _env(spec: PDClusterSpec, engine: EngineSpec, group: EngineGroup) -> list[dict[str, Any]]:
    role = engine.role(group.role.value)
    par = spec.prefill if group.role is Role.PREFILL else spec.decode
    env: list[dict[str, Any]] = [dict(e) for e in role.env]
    ours = {
        # The SGLang plugin's contract (docs/sglang.md): the token, the agent's engine door, who it is.
        "PDFABRIC_ENGINE_TOKEN_FILE": c.ENGINE_TOKEN_PATH,
        "PDFABRIC_AGENT_ADDRESS": f"127.0.0.1:{spec.agent.api_port}",
        "PDFABRIC_REPLICA": str(group.replica),
        "PDFABRIC_SHM_DIR": SHM_PATH,
        # For the command line ($(VAR) in args): what this engine serves on and with.
        "PDFABRIC_ROLE": group.role.value,
        "PDFABRIC_PORT": str(serving_port(engine, group)),
        "PDFABRIC_GPUS": str(len(group.ranks)),
        "PDFABRIC_TP": str(par.tp),
        "PDFABRIC_PP": str(par.pp),
    }
    boot = bootstrap_port(engine, group)
    if boot is not None:
        ours["PDFABRIC_BOOTSTRAP_PORT"] = str(boot)
        ours["PDFABRIC_CP"] = str(spec.prefill.cp)
    cp_ranks = {r.cp_rank for r in group.ranks}
    if len(cp_ranks) == 1:
        # One CP rank in the group (always for decode and for prefill cp 1): say it. A CP > 1
        # server's scheduler processes each know their own CP rank; one variable cannot.
        ours["PDFABRIC_CP_RANK"] = str(next(iter(cp_ranks)))
    if len(group.ranks) == 1:
        ours["PDFABRIC_RANK"] = group.ranks[0].rank_id
    env += [{"name": k, "value": v} for k, v in ours.items()]
    return env


def _resources(spec: PDClusterSpec, role: EngineRoleSpec, group: EngineGroup) -> dict[str, Any]:
    user = role.resources or {}
    requests = dict(user.get("requests") or {})
    limits = dict(user.get("limits") or {})
    # This group's GPUs, and only them: the device plugin's grant (request == limit, extended).
    gpus = {spec.placement.gpu_resource: str(len(group.ranks))}
    requests.update(gpus)
    limits.update(gpus)
    return {"requests": requests, "limits": limits}


def _ports(engine: EngineSpec, group: EngineGroup) -> list[dict[str, Any]]:
    ports = [{"name": group.port_name, "containerPort": serving_port(engine, group), "protocol": "TCP"}]
    boot = bootstrap_port(engine, group)
    if boot is not None:
        ports.append({"name": group.bootstrap_port_name, "containerPort": boot, "protocol": "TCP"})
    return ports


def _probes(role: EngineRoleSpec, group: EngineGroup) -> dict[str, Any]:
    http = {"path": role.health_path, "port": group.port_name}
    return {
        # Loading a model takes minutes: the startup probe holds the other two off until it serves.
        "startupProbe": {
            "httpGet": http,
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, -(-role.startup_seconds // PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "failureThreshold": 3},
        # A busy engine may answer its health path slowly; liveness asks only that the port is open.
        "livenessProbe": {"tcpSocket": {"port": group.port_name}, "periodSeconds": 10, "failureThreshold": 6},
    }


def build_engine_container(spec: PDClusterSpec, engine: EngineSpec, group: EngineGroup) -> dict[str, Any]:
    role = engine.role(group.role.value)
    container: dict[str, Any] = {"name": group.name, "image": engine.image}
    if role.command:
        container["command"] = list(role.command)
    if role.args:
        container["args"] = list(role.args)
    container.update(
        {
            "env": _env(spec, engine, group),
            "ports": _ports(engine, group),
            "resources": _resources(spec, role, group),
            **_probes(role, group),
            "volumeMounts": [
                {"name": "engine-token", "mountPath": c.ENGINE_TOKEN_DIR, "readOnly": True},
                {"name": SHM_VOLUME, "mountPath": SHM_PATH},
            ],
        }
    )
    return container


def build_engine_containers(spec: PDClusterSpec, agent: AgentPlacement) -> list[dict[str, Any]]:
    """The engine containers of one node pod; [] without spec.engine (fabric-only)."""
    if spec.engine is None:
        return []
    return [build_engine_container(spec, spec.engine, g) for g in engine_groups(agent)]


def shm_volume(engine: EngineSpec) -> dict[str, Any]:
    """The pod's /dev/shm: memory-backed, shared by the agent and the engines (CPU buffers)."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if engine.shared_memory:
        empty_dir["sizeLimit"] = engine.shared_memory
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def groups_of(agents: Sequence[AgentPlacement]) -> list[tuple[AgentPlacement, EngineGroup]]:
    """Every engine group of a placement with the node it runs on."""
    return [(a, g) for a in agents for g in engine_groups(a)]
