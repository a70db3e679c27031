"""The node pod's pieces for spec.engine, as plain dicts: pure functions of (spec, placement).

Which engines run where, their ports and their launch message are pdfabric_core.engines'; this
module turns them into what the pod's one container adds with engines (docs/engines.md): the
engine image (it holds the agent, the container's entrypoint), ``PDFABRIC_ENGINES`` (the node's
engine launches, kubelet-escaped) and the user's valueFrom variables hoisted for the kubelet to
resolve, each engine's serving and bootstrap ports, the memory-backed /dev/shm, and resources:
the agent's plus every engine's role resources, summed exactly. The container holds every GPU of
the node's ranks (as a fabric-only pod does); the agent starts each engine with
CUDA_VISIBLE_DEVICES naming its group's GPUs, so the pod spec names no devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdfabric_core.engines.groups import (
    EngineGroup,
    bootstrap_port,
    dist_init_port,
    engine_groups,
    engine_launches,
    hoisted_env,
    is_group_leader,
    serving_port,
)
from pdfabric_core.engines.launch import ENGINES_ENV, encode_launches
from pdfabric_core.policy.types import Role
from pdfabric_core.quantity import QuantityError, add_quantities
from pdfabric_core.spec import EngineSpec, PDClusterSpec, SpecError
from pdfabric_operator.placement import AgentPlacement

SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
TERMINATION_GRACE_S = 60  # engines load models for minutes and drain requests on SIGTERM


def groups(agent: AgentPlacement) -> list[EngineGroup]:
    """The engine groups of one node (its ranks, grouped by replica)."""
    return engine_groups(agent.ranks)


def groups_of(agents: Sequence[AgentPlacement]) -> list[tuple[AgentPlacement, EngineGroup]]:
    """Every engine group of a placement with the node it runs on."""
    return [(a, g) for a in agents for g in groups(a)]


def engine_env(
    spec: PDClusterSpec, agent: AgentPlacement, leaders: Mapping[tuple[Role, int], str] | None = None
) -> list[dict[str, Any]]:
    """The container variables the engines need: the user's valueFrom variables (resolved by the
    kubelet under PDFABRIC_ENV_<ROLE>_<NAME>) and the node's engine launches (`leaders`: the
    rendezvous of each replica over several nodes)."""
    launches = engine_launches(spec, agent.ranks, leaders)
    roles = {g.role for g in groups(agent)}
    return [*hoisted_env(spec, roles), {"name": ENGINES_ENV, "value": encode_launches(launches)}]


def engine_ports(spec: PDClusterSpec, agent: AgentPlacement) -> list[dict[str, Any]]:
    """Each engine's serving port (and prefill's bootstrap port), named for the per-role Services;
    a group leader's rendezvous port too (node rank 0 of a replica over several nodes)."""
    assert spec.engine is not None
    engine = spec.engine
    ports: list[dict[str, Any]] = []
    for g in groups(agent):
        ports.append({"name": g.port_name, "containerPort": serving_port(engine, g), "protocol": "TCP"})
        boot = bootstrap_port(engine, g)
        if boot is not None:
            ports.append({"name": g.bootstrap_port_name, "containerPort": boot, "protocol": "TCP"})
        if is_group_leader(spec, g):
            ports.append({"name": g.dist_port_name, "containerPort": dist_init_port(engine, g), "protocol": "TCP"})
    return ports


def shm_volume(engine: EngineSpec) -> dict[str, Any]:
    """The pod's /dev/shm: memory-backed, shared by the agent and its engine processes (CPU buffers)."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if engine.shared_memory:
        empty_dir["sizeLimit"] = engine.shared_memory
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def shm_mount() -> dict[str, Any]:
    return {"name": SHM_VOLUME, "mountPath": SHM_PATH}


def _effective(resources: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(requests, limits) of one part as Kubernetes reads a container's: a request left out is
    its limit; a limit left out is no limit (None)."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    for name, limit in limits.items():
        requests.setdefault(name, limit)
    return requests, limits


def sum_resources(parts: Sequence[Mapping[str, Any]], where: str = "resources") -> dict[str, Any]:
    """The resources of one container running every part (the agent, each engine): per resource,
    the exact sum of the parts' requests (a part's limit where it states no request, as Kubernetes
    defaults it); a limit where any part limits the resource, the sum of the parts' limits with
    their requests standing in for a part that states none (so limits never fall below requests).
    A part that names a resource in neither adds nothing to it. SpecError for a bad quantity
    (parse_spec refuses those first, and a request above its part's limit)."""
    effective = [_effective(p) for p in parts]
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    names = list(dict.fromkeys(n for req, _ in effective for n in req))
    try:
        for name in names:
            requests[name] = add_quantities(req[name] for req, _ in effective if name in req)
            if any(name in lim for _, lim in effective):
                limits[name] = add_quantities(
                    lim[name] if name in lim else req[name] for req, lim in effective if name in req
                )
    except QuantityError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return {"requests": requests, "limits": limits}


def container_resources(spec: PDClusterSpec, agent: AgentPlacement) -> dict[str, Any]:
    """The agent's resources plus, with spec.engine, each of the node's engines' role resources
    (devices are the caller's: they are set, not added)."""
    parts: list[Mapping[str, Any]] = [spec.agent.resources or {}]
    if spec.engine is not None:
        parts += [spec.engine.role(g.role.value).resources or {} for g in groups(agent)]
    return sum_resources(parts, "agent.resources + engine resources")
