"""Which engines run where: one engine per group of ranks (one replica of one role placed on a
node), the k-th of its role in the pod serving on ``port + k``, and its launch message built from
the spec. The operator writes the pod with these; the agent's harnesses use the same functions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdfabric_core.engines.launch import EngineLaunch, EnvEntry, hoisted_name
from pdfabric_core.policy.types import MEM_POOL_ENV, MemPool, Role
from pdfabric_core.rankmap import Rank, node_rank

if TYPE_CHECKING:
    from pdfabric_core.spec import EngineSpec, PDClusterSpec


@dataclass(frozen=True)
class EngineGroup:
    """One engine: the ranks of one replica of one role on one node."""

    role: Role
    replica: int
    index: int  # the k-th engine of its role in this pod: its ports are base + k
    ranks: tuple[Rank, ...]

    @property
    def name(self) -> str:
        """Unique in the pod: prefill-0, decode-3."""
        return f"{self.role.value}-{self.replica}"

    @property
    def port_name(self) -> str:
        """Serving port's name (<= 15 characters): p-http-0, d-http-2 (k = index)."""
        return f"{self.role.value[0]}-http-{self.index}"

    @property
    def bootstrap_port_name(self) -> str:
        return f"p-boot-{self.index}"

    @property
    def dist_port_name(self) -> str:
        """The rendezvous port's name on a group leader's pod: p-dist-0, d-dist-1."""
        return f"{self.role.value[0]}-dist-{self.index}"


def engine_groups(ranks: Sequence[Rank]) -> list[EngineGroup]:
    """The engine groups of one node's ranks, in rank order (prefill first, then by replica)."""
    by_key: dict[tuple[Role, int], list[Rank]] = {}
    for r in ranks:
        by_key.setdefault((Role(r.role), r.replica), []).append(r)
    out: list[EngineGroup] = []
    seen: dict[Role, int] = {}
    for (role, replica), group in by_key.items():
        k = seen.get(role, 0)
        seen[role] = k + 1
        out.append(EngineGroup(role, replica, k, tuple(group)))
    return out


def serving_port(engine: EngineSpec, group: EngineGroup) -> int:
    return engine.role(group.role.value).port + group.index


def bootstrap_port(engine: EngineSpec, group: EngineGroup) -> int | None:
    """Prefill engines' bootstrap port; None for decode."""
    return engine.prefill.bootstrap_port + group.index if group.role is Role.PREFILL else None


def dist_init_port(engine: EngineSpec, group: EngineGroup) -> int:
    """Where the leader of a replica over several nodes (node rank 0) holds its rendezvous."""
    return engine.role(group.role.value).dist_init_port + group.index


def group_node_rank(spec: PDClusterSpec, group: EngineGroup) -> int:
    """The node rank of this engine's block of its replica (0 for a replica on one node)."""
    return node_rank(spec, group.ranks[0])


def is_group_leader(spec: PDClusterSpec, group: EngineGroup) -> bool:
    """Node rank 0 of a replica over several nodes: the engine that holds the group's rendezvous."""
    return spec.role(group.role).nodes_per_replica > 1 and group_node_rank(spec, group) == 0


def _launch_env(engine: EngineSpec, role: Role, mem_pool: MemPool) -> tuple[EnvEntry, ...]:
    out = []
    for var in engine.role(role.value).env:
        name = str(var["name"])
        if "valueFrom" in var:
            out.append(EnvEntry(name, from_container=hoisted_name(role, name)))
        else:
            out.append(EnvEntry(name, value=str(var.get("value", ""))))
    if mem_pool is MemPool.INTRA_NODE_NVLINK and all(e.name != MEM_POOL_ENV for e in out):
        # The seed's rule: SGLang keeps its metadata rows on the GPU for this pool, which the
        # agent then maps by CUDA IPC like the KV (a user's own value of the variable stands).
        out.append(EnvEntry(MEM_POOL_ENV, value=mem_pool.value))
    return tuple(out)


def engine_launch(
    spec: PDClusterSpec, group: EngineGroup, leaders: Mapping[tuple[Role, int], str] | None = None
) -> EngineLaunch:
    """`leaders`: (role, replica) -> the rendezvous host:port of each replica over several nodes."""
    assert spec.engine is not None
    engine = spec.engine
    role = engine.role(group.role.value)
    par = spec.role(group.role)
    cp_ranks = {r.cp_rank for r in group.ranks}
    group_fields: dict[str, Any] = {}
    if par.nodes_per_replica > 1:
        leader = (leaders or {}).get((group.role, group.replica))
        if leader is None:
            raise ValueError(f"{group.name} spans {par.nodes_per_replica} nodes and no leader address was given")
        group_fields = {
            "nnodes": par.nodes_per_replica,
            "node_rank": group_node_rank(spec, group),
            "dist_init_addr": leader,
        }
    return EngineLaunch(
        name=group.name,
        role=group.role,
        replica=group.replica,
        rank_ids=tuple(r.rank_id for r in group.ranks),
        gpus=tuple(r.gpu for r in group.ranks),
        argv=(*role.command, *role.args),
        env=_launch_env(engine, group.role, spec.transfer.mem_pool),
        port=serving_port(engine, group),
        bootstrap_port=bootstrap_port(engine, group),
        health_path=role.health_path,
        startup_seconds=role.startup_seconds,
        tp=par.tp,
        pp=par.pp,
        cp=spec.prefill.cp if group.role is Role.PREFILL else 1,
        cp_rank=next(iter(cp_ranks)) if len(cp_ranks) == 1 else None,
        **group_fields,
    )


def engine_launches(
    spec: PDClusterSpec, ranks: Sequence[Rank], leaders: Mapping[tuple[Role, int], str] | None = None
) -> list[EngineLaunch]:
    """The engines of one node's ranks; [] without spec.engine (fabric-only)."""
    if spec.engine is None:
        return []
    return [engine_launch(spec, g, leaders) for g in engine_groups(ranks)]


def hoisted_env(spec: PDClusterSpec, roles: Iterable[Role] = tuple(Role)) -> list[dict[str, Any]]:
    """The container variables the kubelet resolves for the engines of `roles` (valueFrom:
    Secrets, ConfigMaps, fields), one per role and name (so prefill and decode may differ). A pod
    gets only its own engines' roles: a decode pod never holds what only prefill reads."""
    if spec.engine is None:
        return []
    out = []
    for role in sorted(set(roles), key=list(Role).index):
        for var in spec.engine.role(role.value).env:
            if "valueFrom" in var:
                out.append({"name": hoisted_name(role, str(var["name"])), "valueFrom": dict(var["valueFrom"])})
    return out
