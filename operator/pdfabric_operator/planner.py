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
6. No fit: with placement.fallback TCP a tcp placement flagged as fallback; else, for a cluster
   that runs (a previous placement: the last plan, or after a restart the rank map on record),
   step 8; for one that does not run yet, a PlacementFailure (a cluster missing a role serves
   nothing, so a new one is placed whole or not at all).
7. Pods: one per (node, unit), its ranks' GPUs numbered from 0 within the pod. A scale step adds
   or removes whole units, so it adds or removes pods and leaves the others as they were.
8. What fits of a step (an HPA's overshoot, a lost node): the most replicas, prefill <= spec and
   decode <= spec, that steps 3 to 5 place, as a Placement whose `shortfall` says asked vs placed
   and carries the step-6 reason and message. From the replicas that run (capped by the spec):
   if those no longer fit (nodes lost), both roles shrink in proportion, by bisection; then decode
   grows towards the spec, then prefill, each by bisection (fit is monotone for identical units).
   A few dozen packs, whatever the counts: 1,024 replicas plan in tens of milliseconds. Intra-node
   NVLink groups grow and shrink whole. Each transport of step 6 is searched; the one placing
   more replicas wins, the requested on a tie. Stickiness keeps every running unit on its node,
   and the caller builds every child from the spec clipped to the placed counts (placed_spec), so
   an overshoot changes no pod and not the rank map. Not even one replica of each role: step 6's
   failure.

Steps 1, 6 and 8 are here; units, free capacity and the packing (2 to 5, 7) are packing.py; the
inputs and the answer (GpuNode, PlacedPod, Placement, PlacementFailure) are placement.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdfabric_core.policy.transports import FALLBACK_TRANSPORT, Locality, tcp_fallback_allowed, transport_traits
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.packing import (
    GroupTopology,
    NoFit,
    agent_placements,
    free_capacity,
    pack,
    plan_feeds,
    plan_units,
)
from pdfabric_operator.placement import GpuNode, PlacedPod, Placement, PlacementFailure, PlacementReason, Shortfall
from pdfabric_operator.scheduling import Taint, affinity_allows, node_pod_tolerations, untolerated


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


def _matches(node: GpuNode, selector: Mapping[str, str]) -> bool:
    return all(node.labels.get(k) == v for k, v in selector.items())


def _taint_list(tainted: Mapping[str, Sequence[Taint]], limit: int = 3) -> str:
    named = sorted((n, t) for n, t in tainted.items() if t)[:limit]
    if not named:
        return ""
    return ": " + "; ".join(f"{n} {', '.join(map(str, t))}" for n, t in named)


# --- the planner -------------------------------------------------------------------------------


def plan_placement(
    spec: PDClusterSpec,
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    *,
    cluster_uid: str,
    previous: Mapping[str, Sequence[Rank]] | None = None,
) -> Placement | PlacementFailure:
    """Place every rank of `spec`, or for a running cluster as many replicas as fit (see the
    module doc for the algorithm)."""
    previous = previous or {}
    outcome = _plan_all(spec, nodes, placed, cluster_uid, previous)
    if isinstance(outcome, Placement) or not previous:
        return outcome
    return _plan_partial(spec, nodes, placed, cluster_uid, previous, outcome) or outcome


def placed_spec(spec: PDClusterSpec, placement: Placement) -> PDClusterSpec:
    """`spec` with the replica counts the placement holds: what every child is built from, so a
    scale step that could not be placed leaves the rank map, pods and services as they were."""
    if placement.shortfall is None:
        return spec
    return with_replicas(spec, placement.shortfall.prefill_placed, placement.shortfall.decode_placed)


def with_replicas(spec: PDClusterSpec, prefill: int, decode: int) -> PDClusterSpec:
    return dataclasses.replace(
        spec,
        prefill=dataclasses.replace(spec.prefill, replicas=prefill),
        decode=dataclasses.replace(spec.decode, replicas=decode),
    )


def _plan_all(
    spec: PDClusterSpec,
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    uid: str,
    previous: Mapping[str, Sequence[Rank]],
) -> Placement | PlacementFailure:
    """Every replica of `spec` on the requested transport, else on the declared TCP fallback."""
    requested = spec.transfer.effective_transport
    try:
        return _plan(spec, requested, requested, nodes, placed, uid, previous)
    except NoFit as nofit:
        if not tcp_fallback_allowed(spec.placement.fallback, requested):
            return PlacementFailure(nofit.reason, nofit.message, requested)
        try:
            fallback = _plan(spec, FALLBACK_TRANSPORT, requested, nodes, placed, uid, previous)
        except NoFit as tcp_nofit:
            return PlacementFailure(
                nofit.reason,
                f"{nofit.message}; the declared TCP fallback does not fit either: {tcp_nofit.message}",
                requested,
            )
        return dataclasses.replace(fallback, fallback_reason=f"{nofit.reason}: {nofit.message}")


def _placed_replicas(previous: Mapping[str, Sequence[Rank]], role: Role) -> int:
    return len({r.replica for ranks in previous.values() for r in ranks if r.role == role})


def _plan_partial(
    spec: PDClusterSpec,
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    uid: str,
    previous: Mapping[str, Sequence[Rank]],
    failure: PlacementFailure,
) -> Placement | None:
    """The most replicas of a running cluster that fit, each transport in the fallback order (the
    one placing more wins, the requested on a tie); None when not even one of each role fits.

    Starts from what runs (capped by the spec), shrinks if that no longer fits (nodes lost), then
    grows decode and then prefill towards the spec, each by bisection: a few dozen pack() calls
    whatever the replica counts. Intra-node NVLink groups count as one prefill replica and the
    decode replicas it feeds, so they grow and shrink whole."""
    requested = spec.transfer.effective_transport
    transports = [requested]
    if requested is not FALLBACK_TRANSPORT and tcp_fallback_allowed(spec.placement.fallback, requested):
        transports.append(FALLBACK_TRANSPORT)
    start = (
        max(1, min(spec.prefill.replicas, _placed_replicas(previous, Role.PREFILL))),
        max(1, min(spec.decode.replicas, _placed_replicas(previous, Role.DECODE))),
    )
    best: Placement | None = None
    for transport in transports:
        found = _most_that_fit(spec, transport, start, nodes, placed, uid, previous)
        if found is not None and (best is None or sum(_replicas(found)) > sum(_replicas(best))):
            best = found
    if best is None:
        return None
    p, d = _replicas(best)
    fallback_reason = f"{failure.reason}: {failure.message}" if best.is_fallback else None
    shortfall = Shortfall(spec.prefill.replicas, spec.decode.replicas, p, d, failure.reason, failure.message)
    return dataclasses.replace(best, fallback_reason=fallback_reason, shortfall=shortfall)


def _most_that_fit(
    spec: PDClusterSpec,
    transport: Transport,
    start: tuple[int, int],
    nodes: Sequence[GpuNode],
    placed: Sequence[PlacedPod],
    uid: str,
    previous: Mapping[str, Sequence[Rank]],
) -> Placement | None:
    requested = spec.transfer.effective_transport
    tried: dict[tuple[int, int], Placement | None] = {}

    def fits(counts: tuple[int, int]) -> Placement | None:
        if counts not in tried:
            try:
                clipped = with_replicas(spec, *counts)
                tried[counts] = _plan(clipped, transport, requested, nodes, placed, uid, previous)
            except NoFit:
                tried[counts] = None
        return tried[counts]

    counts: tuple[int, int] | None
    if transport_traits(transport).locality is Locality.NODE:
        k = spec.decode_per_prefill
        groups = _largest_fit(lambda g: fits((g, g * k)) is not None, start[0], spec.prefill.replicas)
        counts = (groups, groups * k) if groups else None
    else:
        asked = (spec.prefill.replicas, spec.decode.replicas)
        counts = _largest_pair(lambda pd: fits(pd) is not None, start, asked)
    return fits(counts) if counts is not None else None


def _replicas(placement: Placement) -> tuple[int, int]:
    ranks = [r for a in placement.agents for r in a.ranks]
    return (
        len({r.replica for r in ranks if r.role == Role.PREFILL}),
        len({r.replica for r in ranks if r.role == Role.DECODE}),
    )


def _largest_fit(fits: Callable[[int], bool], start: int, most: int) -> int:
    """The largest n in [1, most] with fits(n), bisecting down from `start` if it does not fit
    and up from it if it does (fit is taken as monotone: fewer identical units fit where more do);
    0 when not even 1 fits."""
    if not fits(start):
        if start <= 1 or not fits(1):
            return 0
        most, start = start - 1, 1
    lo, hi = start, most  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _largest_pair(
    fits: Callable[[tuple[int, int]], bool], start: tuple[int, int], asked: tuple[int, int]
) -> tuple[int, int] | None:
    """Replica counts (prefill, decode) that fit: `start` or, if it no longer fits, both shrunk
    in proportion as little as needed; then decode grown towards asked, then prefill."""
    p0, d0 = start
    if not fits(start):
        steps = max(p0, d0)

        def scaled(s: int) -> tuple[int, int]:
            return (max(1, -(-p0 * s // steps)), max(1, -(-d0 * s // steps)))

        s = _largest_fit(lambda s: fits(scaled(s)), 1, steps - 1) if steps > 1 else 0
        if s == 0:
            return None
        p0, d0 = scaled(s)
    d = _largest_fit(lambda d: fits((p0, d)), d0, asked[1])
    p = _largest_fit(lambda p: fits((p, d)), p0, asked[0])
    return (p, d)


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
        raise NoFit(
            PlacementReason.NO_GPU_NODES,
            f"no {where} have allocatable {gpu} ({len(nodes)} nodes seen, {len(ready)} ready, "
            f"{len(matching)} matching, {len(selected)} tolerated); add GPU nodes, relax placement.nodeSelector "
            f"or tolerate the taints",
        )
    traits = transport_traits(transport)
    rdma_free: dict[str, int] = {}
    if traits.device_resource:
        rdma_free = free_capacity(eligible, placed, pl.rdma_resource, uid)
        with_rdma = [n for n in eligible if n.allocatable.get(pl.rdma_resource, 0) > 0]
        if not with_rdma:
            raise NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"transport {transport.value} needs nodes with allocatable {pl.rdma_resource}; none of the {len(eligible)} "
                f"{where} with {gpu} has it; set placement.rdmaResource to your cluster's RDMA resource, "
                f"add RDMA nodes, or declare placement.fallback TCP",
            )
        eligible = [n for n in with_rdma if rdma_free[n.name] >= 1]
        if not eligible:
            raise NoFit(
                PlacementReason.NO_RDMA_NODES,
                f"every node with {pl.rdma_resource} has it fully requested by other pods; free some or add RDMA nodes",
            )
    free = free_capacity(eligible, placed, gpu, uid)
    units = plan_units(spec, transport)
    scarcity = {
        n.name: int(n.allocatable.get(pl.rdma_resource, 0) > 0) + int(bool(n.labels.get(pl.nvlink_domain_key)))
        for n in eligible
    }
    # A transport with a device per pod (rdma): a node takes as many pods as it has devices free.
    pod_slots = rdma_free if traits.device_resource else None
    group_key = pl.group_topology_key
    topology = GroupTopology(group_key, {n.name: n.labels.get(group_key, "") for n in eligible}) if group_key else None
    if traits.locality is not Locality.DOMAIN:
        assigned = pack(units, free, previous, what=where, scarcity=scarcity, pod_slots=pod_slots, topology=topology)
        return Placement(transport, requested, agent_placements(assigned, {}), plan_feeds(spec, transport))

    key = pl.nvlink_domain_key
    domains: dict[str, list[str]] = {}
    for n in eligible:
        if n.labels.get(key):
            domains.setdefault(n.labels[key], []).append(n.name)
    if not domains:
        raise NoFit(
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
            assigned = pack(
                units,
                {n: f for n, f in free.items() if n in members},
                {n: r for n, r in previous.items() if n in members},
                what=f"nodes of NVLink domain {d}",
                scarcity=scarcity,
                pod_slots=pod_slots,
                topology=topology,
            )
        except NoFit:
            continue
        return Placement(
            transport,
            requested,
            agent_placements(assigned, dict.fromkeys(members, d)),
            plan_feeds(spec, transport),
            domain=d,
        )
    largest = max(order, key=lambda d: (size[d], d))
    raise NoFit(
        PlacementReason.NVLINK_DOMAIN_TOO_SMALL,
        f"transport {transport.value} needs all {need} GPUs inside one NVLink domain ({key}); the largest, {largest}, "
        f"has {size[largest]} free across {len(domains[largest])} nodes ({len(domains)} domains); "
        f"lower replicas/TP/CP/PP, free GPUs in one domain or declare fallback TCP",
    )
