"""Placement of a PDCluster's ranks on GPU nodes: pure, deterministic, sticky.

plan_placement(spec, nodes, placed pods, previous placement) returns a Placement or a
PlacementFailure whose reason and message say exactly what is missing. The algorithm:

1. Eligible nodes: Ready, schedulable (not cordoned), not being deleted, without a NoSchedule or
   NoExecute taint the node pods do not tolerate, admitted by the required node affinity of
   spec.agent.pod (the scheduler's own filters, scheduling.py), matching
   spec.placement.nodeSelector, with allocatable GPUs of spec.placement.gpuResource (and of the
   RDMA resource for rdma). The kube-scheduler binds the pods (scheduling.py says how they are
   pinned); these filters keep the planner from choosing a node it would refuse.
2. Free GPUs per node = allocatable - requests of every pod already on it that is not ours
   (all PDClusters and anything else requesting the resource). Our own pods are ignored so a
   re-plan may reuse their GPUs.
3. Units: what must stay on one node. intra-node NVLink: one prefill replica plus the decode
   replicas it feeds (decode.replicas / prefill.replicas of them). Other transports: one replica;
   a replica larger than any node's free GPUs is spread rank by rank (tcp, rdma, nvlink only).
4. Sticky first: a unit whose ranks all sat on one node that is still eligible and has room stays
   there, so node loss, scale changes and other clusters' churn move only what must move.
5. The rest goes best-fit (the node with the least free GPUs that still fits), which keeps whole
   nodes free for large units; ties go to nodes without RDMA devices or an NVLink domain (kept for
   the clusters that need them), then by name. nvlink tries each NVLink domain (current one first,
   then the largest) and needs every unit inside that one domain.
6. No fit: a PlacementFailure, or with placement.fallback TCP a tcp placement flagged as fallback.
7. Pods: one per (node, unit), its ranks' GPUs numbered from 0 within the pod. A scale step adds
   or removes whole units, so it adds or removes pods and leaves the others as they were.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdfabric_core.policy.transports import FALLBACK_TRANSPORT, Locality, tcp_fallback_allowed, transport_traits
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import Rank, replica_ranks
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.scheduling import Taint, affinity_allows, node_pod_tolerations, untolerated


class PlacementReason(enum.StrEnum):
    """Why no placement fits: the Placed condition's reason and the failure metric's label."""

    NO_GPU_NODES = "NoGPUNodes"
    INSUFFICIENT_GPUS = "InsufficientGPUs"
    NO_RDMA_NODES = "NoRDMANodes"
    NO_NVLINK_DOMAIN = "NoNVLinkDomain"
    NVLINK_DOMAIN_TOO_SMALL = "NVLinkDomainTooSmall"
    NO_NODE_FOR_INTRA_NODE_GROUP = "NoNodeForIntraNodeGroup"


@dataclass(frozen=True)
class GpuNode:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, int] = field(default_factory=dict)  # extended resources only
    ready: bool = True
    schedulable: bool = True  # False when cordoned or being deleted
    taints: tuple[Taint, ...] = ()


@dataclass(frozen=True)
class PlacedPod:
    """A pod already bound to a node, holding extended resources (GPUs, RDMA)."""

    node: str
    requests: Mapping[str, int]
    owner_uid: str | None = None  # PDCluster uid for our agents, else None


@dataclass(frozen=True)
class AgentPlacement:
    """One node pod: the ranks of one placement unit (a replica, or an intra-node NVLink group)
    on one node. A pod per unit, not per node, so that scaling a role adds and removes pods and
    leaves every other pod, its engines and its rooms alone (a pod cannot gain GPUs in place)."""

    node: str
    ranks: tuple[Rank, ...]  # sorted; rank.gpu is the device index among the pod's own GPUs
    domain: str | None = None
    unit: str = ""  # the placement unit: prefill-<r>, decode-<r> or group-<p>

    @property
    def gpus(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Placement:
    transport: Transport  # what the agents run
    requested_transport: Transport
    agents: tuple[AgentPlacement, ...]  # sorted by node name, then unit
    feeds: Mapping[int, tuple[int, ...]]
    domain: str | None = None
    fallback_reason: str | None = None  # why the requested transport was not placed

    @property
    def is_fallback(self) -> bool:
        return self.transport != self.requested_transport

    def ranks_by_node(self) -> dict[str, tuple[Rank, ...]]:
        """Every rank on each node, whichever pod holds it (what stickiness compares)."""
        by_node: dict[str, tuple[Rank, ...]] = {}
        for a in self.agents:
            by_node[a.node] = by_node.get(a.node, ()) + a.ranks
        return by_node


@dataclass(frozen=True)
class PlacementFailure:
    reason: PlacementReason
    message: str  # says what is missing and what to change
    requested_transport: Transport


def usable_nodes(spec: PDClusterSpec, nodes: Iterable[GpuNode]) -> set[str]:
    """Nodes a node pod of `spec` may run on now: Ready, not cordoned, no taint it does not
    tolerate, admitted by the user's required node affinity (spec.agent.pod.affinity)."""
    tolerations = node_pod_tolerations(spec)
    affinity = spec.agent.pod.affinity
    return {
        n.name
        for n in nodes
        if n.ready
        and n.schedulable
        and not untolerated(n.taints, tolerations)
        and affinity_allows(n.name, n.labels, affinity)
    }


# --- units -------------------------------------------------------------------------------------


def plan_feeds(spec: PDClusterSpec, transport: Transport) -> dict[int, tuple[int, ...]]:
    """prefill replica -> decode replicas it may feed; intra-node NVLink confines them to its node."""
    if transport_traits(transport).locality is Locality.NODE:
        k = spec.decode_per_prefill
        return {p: tuple(range(p * k, p * k + k)) for p in range(spec.prefill.replicas)}
    every = tuple(range(spec.decode.replicas))
    return {p: every for p in range(spec.prefill.replicas)}


@dataclass(frozen=True)
class _Unit:
    key: str
    ranks: tuple[Rank, ...]
    splittable: bool


def _units(spec: PDClusterSpec, transport: Transport) -> list[_Unit]:
    if transport_traits(transport).locality is Locality.NODE:
        units = []
        for p, decodes in plan_feeds(spec, transport).items():
            ranks = replica_ranks(spec, Role.PREFILL, p)
            for d in decodes:
                ranks += replica_ranks(spec, Role.DECODE, d)
            units.append(_Unit(f"group-{p}", tuple(ranks), splittable=False))
        return units
    # An engine the operator runs (spec.engine) is one process on one node: its replica stays whole.
    split = spec.engine is None
    units = [
        _Unit(f"prefill-{r}", tuple(replica_ranks(spec, Role.PREFILL, r)), split) for r in range(spec.prefill.replicas)
    ]
    units += [
        _Unit(f"decode-{r}", tuple(replica_ranks(spec, Role.DECODE, r)), split) for r in range(spec.decode.replicas)
    ]
    return units


# --- capacity ----------------------------------------------------------------------------------


def _matches(node: GpuNode, selector: Mapping[str, str]) -> bool:
    return all(node.labels.get(k) == v for k, v in selector.items())


def _free(nodes: Iterable[GpuNode], placed: Iterable[PlacedPod], resource: str, own_uid: str) -> dict[str, int]:
    free = {n.name: int(n.allocatable.get(resource, 0)) for n in nodes}
    for pod in placed:
        if pod.owner_uid == own_uid or pod.node not in free:
            continue
        free[pod.node] -= int(pod.requests.get(resource, 0))
    return free


def _describe(free: Mapping[str, int], limit: int = 3) -> str:
    top = sorted(free.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return ", ".join(f"{n}: {max(0, f)}" for n, f in top) or "none"


def _taint_list(tainted: Mapping[str, Sequence[Taint]], limit: int = 3) -> str:
    named = sorted((n, t) for n, t in tainted.items() if t)[:limit]
    if not named:
        return ""
    return ": " + "; ".join(f"{n} {', '.join(map(str, t))}" for n, t in named)


class _NoFit(Exception):
    def __init__(self, reason: PlacementReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _pack(
    units: Sequence[_Unit],
    free: dict[str, int],
    previous: Mapping[str, Sequence[Rank]],
    *,
    what: str,
    scarcity: Mapping[str, int] | None = None,
    pod_slots: Mapping[str, int] | None = None,
) -> dict[str, dict[str, list[Rank]]]:
    """Assign units to nodes (sticky, then best-fit): node -> unit key -> its ranks there; raises
    _NoFit naming the first unit left over.

    Among equally good fits, nodes with fewer scarce features (RDMA devices, an NVLink domain) go
    first, so a tcp cluster does not take the nodes an rdma or nvlink cluster will need.
    `pod_slots`: how many more pods each node takes (its free RDMA devices, one per pod, for a
    transport that needs one); None: no such bound.
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
    pending: list[_Unit] = []
    for unit in units:
        nodes_before = [where_before.get(_key(r)) for r in unit.ranks]
        before = Counter(n for n in nodes_before if n is not None)
        sticky = None not in nodes_before and (unit.splittable or len(before) == 1)
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
    for unit in sorted(pending, key=lambda u: (-len(u.ranks), u.key)):
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
            raise _NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"{unit.key} needs a node with a free RDMA device (each pod holds one) and {need} GPUs; every "
                f"node of {what} with free GPUs has its RDMA devices taken; add RDMA devices or nodes",
            )
        if unit.splittable:
            raise _NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} needs {need} GPUs but {what} have {total} free in all "
                f"(most free: {_describe(free)}); add GPU nodes, free GPUs or lower replicas/TP/CP/PP",
            )
        if not unit.key.startswith("group-"):
            raise _NoFit(
                PlacementReason.INSUFFICIENT_GPUS,
                f"{unit.key} needs {need} free GPUs on one node (spec.engine runs each replica as one "
                f"process on one node); {what} offer at most {max([0, *free.values()])} (most free: {_describe(free)}); "
                f"free GPUs, lower TP/CP/PP, or run the engines yourself (leave spec.engine out)",
            )
        raise _NoFit(
            PlacementReason.NO_NODE_FOR_INTRA_NODE_GROUP,
            f"intra-node NVLink needs {need} free GPUs on one node for {unit.key} "
            f"(a prefill replica and the decode replicas it feeds); {what} offer at most "
            f"{max([0, *free.values()])} (most free: {_describe(free)}); free GPUs, lower TP/CP/PP "
            f"or use transport nvlink/rdma",
        )
    return out


def _key(rank: Rank) -> Rank:
    """A rank without its GPU index: the identity stickiness compares."""
    return Rank(rank.role, rank.replica, rank.tp_rank, rank.cp_rank, rank.pp_rank)


def _agents(
    assigned: Mapping[str, Mapping[str, list[Rank]]], domain_of: Mapping[str, str | None]
) -> tuple[AgentPlacement, ...]:
    """One pod per (node, unit); its ranks number their GPUs from 0 in rank order, as the
    container sees the GPUs the device plugin gives it: another pod coming or going on the node
    never renumbers them."""
    agents = []
    for node in sorted(assigned):
        for unit in sorted(assigned[node], key=_unit_order):
            ranks = sorted(assigned[node][unit], key=_rank_order)
            with_gpu = tuple(
                Rank(r.role, r.replica, r.tp_rank, r.cp_rank, r.pp_rank, gpu) for gpu, r in enumerate(ranks)
            )
            agents.append(AgentPlacement(node, with_gpu, domain_of.get(node), unit))
    return tuple(agents)


def _unit_order(key: str) -> tuple[str, int]:
    kind, _, number = key.rpartition("-")
    return (kind, int(number))


def _rank_order(r: Rank) -> tuple[int, int, int, int, int]:
    return (0 if r.role is Role.PREFILL else 1, r.replica, r.pp_rank, r.cp_rank, r.tp_rank)


# --- the planner -------------------------------------------------------------------------------


def plan_placement(
    spec: PDClusterSpec,
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    *,
    cluster_uid: str,
    previous: Mapping[str, Sequence[Rank]] | None = None,
) -> Placement | PlacementFailure:
    """Place every rank of `spec` (see the module doc for the algorithm)."""
    requested = spec.transfer.effective_transport
    previous = previous or {}
    try:
        return _plan(spec, requested, requested, nodes, placed, cluster_uid, previous)
    except _NoFit as nofit:
        if not tcp_fallback_allowed(spec.placement.fallback, requested):
            return PlacementFailure(nofit.reason, nofit.message, requested)
        try:
            fallback = _plan(spec, FALLBACK_TRANSPORT, requested, nodes, placed, cluster_uid, previous)
        except _NoFit as tcp_nofit:
            return PlacementFailure(
                nofit.reason,
                f"{nofit.message}; the declared TCP fallback does not fit either: {tcp_nofit.message}",
                requested,
            )
        return Placement(
            fallback.transport,
            requested,
            fallback.agents,
            fallback.feeds,
            None,
            f"{nofit.reason}: {nofit.message}",
        )


def _plan(
    spec: PDClusterSpec,
    transport: Transport,
    requested: Transport,
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    uid: str,
    previous: Mapping[str, Sequence[Rank]],
) -> Placement:
    pl = spec.placement
    gpu = pl.gpu_resource
    ready = [n for n in nodes if n.ready and n.schedulable]
    affinity = spec.agent.pod.affinity
    matching = [n for n in ready if _matches(n, pl.node_selector) and affinity_allows(n.name, n.labels, affinity)]
    tolerations = node_pod_tolerations(spec)
    tainted = {n.name: untolerated(n.taints, tolerations) for n in matching}
    selected = [n for n in matching if not tainted[n.name]]
    eligible = [n for n in selected if n.allocatable.get(gpu, 0) > 0]
    where = f"ready nodes matching nodeSelector {dict(pl.node_selector)}" if pl.node_selector else "ready nodes"
    if affinity.get("nodeAffinity"):
        where += " and agent.pod.affinity"
    left_out = len(matching) - len(selected)
    if left_out:  # every message below then says which nodes the taints kept out
        where += f" (leaving out {left_out} with a taint the node pods do not tolerate{_taint_list(tainted)})"
    if not eligible:
        raise _NoFit(
            PlacementReason.NO_GPU_NODES,
            f"no {where} have allocatable {gpu} ({len(nodes)} nodes seen, {len(ready)} ready, "
            f"{len(matching)} matching, {len(selected)} tolerated); add GPU nodes, relax placement.nodeSelector "
            f"or tolerate the taints",
        )
    traits = transport_traits(transport)
    rdma_free: dict[str, int] = {}
    if traits.device_resource:
        rdma_free = _free(eligible, placed, pl.rdma_resource, uid)
        with_rdma = [n for n in eligible if n.allocatable.get(pl.rdma_resource, 0) > 0]
        if not with_rdma:
            raise _NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"transport {transport.value} needs nodes with allocatable {pl.rdma_resource}; none of the {len(eligible)} "
                f"{where} with {gpu} has it; set placement.rdmaResource to your cluster's RDMA resource, "
                f"add RDMA nodes, or declare placement.fallback TCP",
            )
        eligible = [n for n in with_rdma if rdma_free[n.name] >= 1]
        if not eligible:
            raise _NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"every node with {pl.rdma_resource} has it fully requested by other pods; free some or add RDMA nodes",
            )
    free = _free(eligible, placed, gpu, uid)
    units = _units(spec, transport)
    scarcity = {
        n.name: int(n.allocatable.get(pl.rdma_resource, 0) > 0) + int(bool(n.labels.get(pl.nvlink_domain_key)))
        for n in eligible
    }
    # A transport with a device per pod (rdma): a node takes as many pods as it has devices free.
    pod_slots = rdma_free if traits.device_resource else None
    if traits.locality is not Locality.DOMAIN:
        assigned = _pack(units, free, previous, what=where, scarcity=scarcity, pod_slots=pod_slots)
        return Placement(transport, requested, _agents(assigned, {}), plan_feeds(spec, transport))

    key = pl.nvlink_domain_key
    domains: dict[str, list[str]] = {}
    for n in eligible:
        if n.labels.get(key):
            domains.setdefault(n.labels[key], []).append(n.name)
    if not domains:
        raise _NoFit(
            PlacementReason.NO_NVLINK_DOMAIN,
            f"transport {transport.value} needs nodes labelled {key} (the NVLink domain); none of the {len(eligible)} "
            f"{where} with {gpu} has it; set placement.nvlinkDomainKey, use another transport or declare fallback TCP",
        )
    need = sum(len(u.ranks) for u in units)
    before = {n for n in previous}
    size = {d: sum(max(0, free[n]) for n in members) for d, members in domains.items()}
    # The domain we already use first (stickiness), then the roomiest.
    order = sorted(domains, key=lambda d: (not (before & set(domains[d])), -size[d], d))
    for d in order:
        members = set(domains[d])
        try:
            assigned = _pack(
                units,
                {n: f for n, f in free.items() if n in members},
                {n: r for n, r in previous.items() if n in members},
                what=f"nodes of NVLink domain {d}",
                scarcity=scarcity,
                pod_slots=pod_slots,
            )
        except _NoFit:
            continue
        return Placement(
            transport, requested, _agents(assigned, dict.fromkeys(members, d)), plan_feeds(spec, transport), domain=d
        )
    largest = max(order, key=lambda d: (size[d], d))
    raise _NoFit(
        PlacementReason.NVLINK_DOMAIN_TOO_SMALL,
        f"transport {transport.value} needs all {need} GPUs inside one NVLink domain ({key}); the largest, {largest}, "
        f"has {size[largest]} free across {len(domains[largest])} nodes ({len(domains)} domains); "
        f"lower replicas/TP/CP/PP, free GPUs in one domain or declare fallback TCP",
    )
