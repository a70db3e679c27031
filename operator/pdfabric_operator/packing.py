"""Packing placement units onto nodes: what must stay together (units), the GPUs each node has
free, and the sticky best-fit assignment of units to nodes (steps 2 to 5 and 7 of the planner's
algorithm, planner.py). Pure; a unit that fits nowhere raises NoFit with the reason and message."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdfabric_core.policy.transports import Locality, transport_traits
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import Rank, replica_ranks
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.placement import AgentPlacement, GpuNode, PlacedPod, PlacementReason


def plan_feeds(spec: PDClusterSpec, transport: Transport) -> dict[int, tuple[int, ...]]:
    """prefill replica -> decode replicas it may feed, where the transport confines them (intra-node
    NVLink: those on its node). Elsewhere every prefill replica feeds every decode replica, which is
    what the rank map's readers take a replica missing here to mean: spelled out, it would grow as
    prefill x decode replicas (a million numbers at 1,000 of each, past a ConfigMap's size)."""
    if transport_traits(transport).locality is Locality.NODE:
        k = spec.decode_per_prefill
        return {p: tuple(range(p * k, p * k + k)) for p in range(spec.prefill.replicas)}
    return {}


@dataclass(frozen=True)
class Unit:
    key: str
    ranks: tuple[Rank, ...]
    splittable: bool
    nodes: int = 1  # > 1: a replica over that many nodes, an equal block of its ranks on each

    @property
    def parts(self) -> list[tuple[Rank, ...]]:
        """The node blocks in node-rank order (the ranks are in replica order: rankmap.replica_parts)."""
        size = len(self.ranks) // self.nodes
        return [self.ranks[k * size : (k + 1) * size] for k in range(self.nodes)]


def plan_units(spec: PDClusterSpec, transport: Transport) -> list[Unit]:
    if transport_traits(transport).locality is Locality.NODE:
        units = []
        for p, decodes in plan_feeds(spec, transport).items():
            ranks = replica_ranks(spec, Role.PREFILL, p)
            for d in decodes:
                ranks += replica_ranks(spec, Role.DECODE, d)
            units.append(Unit(f"group-{p}", tuple(ranks), splittable=False))
        return units
    # An engine the operator runs (spec.engine) is one process per node: its replica stays whole,
    # or with nodesPerReplica one block per node, as a group placed all or none.
    units = []
    for role in (Role.PREFILL, Role.DECODE):
        nodes = spec.role(role).nodes_per_replica
        split = spec.engine is None and nodes == 1
        for r in range(spec.role(role).replicas):
            units.append(Unit(f"{role.value}-{r}", tuple(replica_ranks(spec, role, r)), split, nodes))
    return units


def free_capacity(nodes: Iterable[GpuNode], placed: Iterable[PlacedPod], resource: str, own_uid: str) -> dict[str, int]:
    """Free `resource` per node: allocatable less what every pod not ours requests there."""
    free = {n.name: int(n.allocatable.get(resource, 0)) for n in nodes}
    for pod in placed:
        if pod.owner_uid == own_uid or pod.node not in free:
            continue
        free[pod.node] -= int(pod.requests.get(resource, 0))
    return free


def _describe(free: Mapping[str, int], limit: int = 3) -> str:
    top = sorted(free.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return ", ".join(f"{n}: {max(0, f)}" for n, f in top) or "none"


@dataclass(frozen=True)
class GroupTopology:
    """placement.groupTopologyKey: every node of one replica over several nodes carries the same
    value of this node label (an RDMA rail or network block, a rack); `of`: node -> its value ("":
    none, so it takes no group)."""

    key: str
    of: Mapping[str, str]


class NoFit(Exception):
    def __init__(self, reason: PlacementReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def pack(
    units: Sequence[Unit],
    free: dict[str, int],
    previous: Mapping[str, Sequence[Rank]],
    *,
    what: str,
    scarcity: Mapping[str, int] | None = None,
    pod_slots: Mapping[str, int] | None = None,
    topology: GroupTopology | None = None,
) -> dict[str, dict[str, list[Rank]]]:
    """Assign units to nodes (sticky, then best-fit): node -> unit key -> its ranks there; raises
    NoFit naming the first unit left over.

    Among equally good fits, nodes with fewer scarce features (RDMA devices, an NVLink domain) go
    first, so a tcp cluster does not take the nodes an rdma or nvlink cluster will need.
    `pod_slots`: how many more pods each node takes (its free RDMA devices, one per pod, for a
    transport that needs one); None: no such bound. `topology`: where a group's nodes must share a
    label value (placement.groupTopologyKey); None: anywhere.
    """
    free = dict(free)
    slots = dict(pod_slots) if pod_slots is not None else None

    def has_slot(node: str) -> bool:
        return slots is None or slots.get(node, 0) >= 1

    def take_slot(node: str) -> None:
        if slots is not None:
            slots[node] -= 1

    scarcity = scarcity or {}
    where_before: dict[Rank, str] = {}
    for node, ranks in previous.items():
        for r in ranks:
            where_before[_key(r)] = node
    out: dict[str, dict[str, list[Rank]]] = {}
    pending: list[Unit] = []
    for unit in units:
        nodes_before = [where_before.get(_key(r)) for r in unit.ranks]
        before = Counter(n for n in nodes_before if n is not None)
        sticky = None not in nodes_before and (
            unit.splittable
            or (len(before) == unit.nodes == _part_nodes(unit, where_before) and _together(before, topology))
        )
        if sticky and all(free.get(n, 0) >= c and has_slot(n) for n, c in before.items()):
            for node in before:
                take_slot(node)
            for r in unit.ranks:
                node = where_before[_key(r)]
                out.setdefault(node, {}).setdefault(unit.key, []).append(r)
                free[node] -= 1
        else:
            pending.append(unit)
    # Largest units first: best-fit decreasing wastes the fewest GPUs.
    for unit in sorted(pending, key=lambda u: (-len(u.ranks) // u.nodes, u.key)):
        if unit.nodes > 1:
            _pack_group(unit, free, out, has_slot, take_slot, scarcity, what, topology)
            continue
        need = len(unit.ranks)
        fits = sorted((f, scarcity.get(n, 0), n) for n, f in free.items() if f >= need and has_slot(n))
        if fits:
            node = fits[0][2]
            out.setdefault(node, {}).setdefault(unit.key, []).extend(unit.ranks)
            free[node] -= need
            take_slot(node)
            continue
        total = sum(max(0, f) for n, f in free.items() if has_slot(n))
        if unit.splittable and total >= need:
            rest = list(unit.ranks)
            open_nodes = ((f, n) for n, f in free.items() if f > 0 and has_slot(n))
            for f, n in sorted(open_nodes, key=lambda t: (-t[0], t[1])):
                take, rest = rest[:f], rest[f:]
                out.setdefault(n, {}).setdefault(unit.key, []).extend(take)
                free[n] -= len(take)
                take_slot(n)
                if not rest:
                    break
            continue
        if slots is not None and not any(has_slot(n) for n, f in free.items() if f > 0):
            raise NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"{unit.key} needs a node with a free RDMA device (each pod holds one) and {need} GPUs; every "
                f"node of {what} with free GPUs has its RDMA devices taken; add RDMA devices or nodes",
            )
        if unit.splittable:
            raise NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} needs {need} GPUs but {what} have {total} free in all "
                f"(most free: {_describe(free)}); add GPU nodes, free GPUs or lower replicas/TP/CP/PP",
            )
        if not unit.key.startswith("group-"):
            raise NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} needs {need} free GPUs on one node (spec.engine runs each replica as one "
                f"process on one node); {what} offer at most {max([0, *free.values()])} (most free: {_describe(free)}); "
                f"free GPUs, lower TP/CP/PP, or run the engines yourself (leave spec.engine out)",
            )
        raise NoFit(
            PlacementReason.NO_NODE_FOR_INTRA_NODE_GROUP,
            f"intra-node NVLink needs {need} free GPUs on one node for {unit.key} "
            f"(a prefill replica and the decode replicas it feeds); {what} offer at most "
            f"{max([0, *free.values()])} (most free: {_describe(free)}); free GPUs, lower TP/CP/PP "
            f"or use transport nvlink/rdma",
        )
    return out


def _part_nodes(unit: Unit, where_before: Mapping[Rank, str]) -> int:
    """How many distinct nodes held a group's node blocks, each block on one node (else 0)."""
    homes = []
    for part in unit.parts:
        nodes = {where_before.get(_key(r)) for r in part}
        if len(nodes) != 1 or None in nodes:
            return 0
        homes.append(nodes.pop())
    return len(set(homes))


def _together(nodes: Iterable[str], topology: GroupTopology | None) -> bool:
    """Whether a group's nodes share one value of the topology label (always, without one)."""
    if topology is None:
        return True
    values = {topology.of.get(n, "") for n in nodes}
    return len(values) == 1 and "" not in values


def _pack_group(
    unit: Unit,
    free: dict[str, int],
    out: dict[str, dict[str, list[Rank]]],
    has_slot: Callable[[str], bool],
    take_slot: Callable[[str], None],
    scarcity: Mapping[str, int],
    what: str,
    topology: GroupTopology | None,
) -> None:
    """A replica over several nodes: each node block best-fit on a node of its own, all or none
    (NoFit before anything is taken), with a topology key all inside the value of it whose nodes
    fit most tightly. Gang placement: a group with a block short of a node would run nothing and
    hold GPUs that others could use."""
    need = len(unit.ranks) // unit.nodes
    fits = sorted((f, scarcity.get(n, 0), n) for n, f in free.items() if f >= need and has_slot(n))
    if topology is None:
        if len(fits) < unit.nodes:
            raise NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} spans {unit.nodes} nodes with {need} free GPUs each (nodesPerReplica); {what} offer "
                f"{len(fits)} such node(s) (most free: {_describe(free)}); add GPU nodes, free GPUs, or change "
                f"nodesPerReplica or TP/PP",
            )
        chosen = fits[: unit.nodes]
    else:
        by_value: dict[str, list[tuple[int, int, str]]] = {}
        for fit in fits:
            if topology.of.get(fit[2]):
                by_value.setdefault(topology.of[fit[2]], []).append(fit)
        tight = [(sum(f for f, _, _ in v[: unit.nodes]), k) for k, v in by_value.items() if len(v) >= unit.nodes]
        if not tight:
            most = max(((len(v), k) for k, v in by_value.items()), default=(0, ""))
            best = f"{most[1]} offers {most[0]}" if most[1] else "none offers any"
            raise NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} spans {unit.nodes} nodes with {need} free GPUs each, all with one value of node label "
                f"{topology.key} (placement.groupTopologyKey); of {what}, {best} such node(s) "
                f"({len(by_value)} value(s) in all); add or free nodes in one {topology.key}, or change "
                f"nodesPerReplica or TP/PP",
            )
        chosen = by_value[min(tight)[1]][: unit.nodes]
    for part, (_, _, node) in zip(unit.parts, chosen, strict=True):
        out.setdefault(node, {}).setdefault(unit.key, []).extend(part)
        free[node] -= need
        take_slot(node)


def _key(rank: Rank) -> Rank:
    """A rank without its GPU index: the identity stickiness compares."""
    return dataclasses.replace(rank, gpu=0)


def agent_placements(
    assigned: Mapping[str, Mapping[str, list[Rank]]], domain_of: Mapping[str, str | None]
) -> tuple[AgentPlacement, ...]:
    """One pod per (node, unit); its ranks number their GPUs from 0 in rank order, as the
    container sees the GPUs the device plugin gives it: another pod coming or going on the node
    never renumbers them."""
    agents = []
    for node in sorted(assigned):
        for unit in sorted(assigned[node], key=_unit_order):
            ranks = sorted(assigned[node][unit], key=_rank_order)
            with_gpu = tuple(dataclasses.replace(r, gpu=gpu) for gpu, r in enumerate(ranks))
            agents.append(AgentPlacement(node, with_gpu, domain_of.get(node), unit))
    return tuple(agents)


def _unit_order(key: str) -> tuple[str, int]:
    kind, _, number = key.rpartition("-")
    return (kind, int(number))


def _rank_order(r: Rank) -> tuple[int, int, int, int, int, int]:
    return (0 if r.role is Role.PREFILL else 1, r.replica, r.pp_rank, r.dp_rank, r.cp_rank, r.tp_rank)
