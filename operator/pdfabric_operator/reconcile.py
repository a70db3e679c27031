"""One level-based reconcile of one PDCluster, as numbered steps.

It runs in a worker thread on a snapshot of the watch caches (kopf indices) taken on the event
loop, so it never iterates a dict the loop is mutating. Steps:

1. Parse the spec (an invalid spec: status says why, children untouched).
2. Plan against the snapshot plus the in-memory ledger of placements this operator just made
   (the watch cache lags our own creates; without the ledger two clusters planned in the same
   second would both take the same GPUs).
3. No fit: delete every child, publish the reason (a cluster that runs never gets here for want of
   room: the planner then places what fits of a scale step and reports the rest, see planner.py).
   Fit: build every child from the spec clipped to the replicas placed (planner.placed_spec), so
   a step the nodes cannot take leaves the rank map and the pods exactly as they were; ensure the engine-token and peer-CA
   Secrets, Service, NetworkPolicy, rank-map ConfigMap, then agent pods (replace a pod whose build hash differs,
   delete pods no longer wanted with their certificates, create missing ones, each after issuing
   its own peer certificate: a new pod is a new key; deterministic names make an interrupted run
   safe to repeat).
4. Compute status from what was seen and patch it only if it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from pdfabric_core.rankmap import RANKMAP_KEY, Rank, RankMap
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_operator import constants as c
from pdfabric_operator import pki
from pdfabric_operator.bookkeeping import ClusterMemory, Result
from pdfabric_operator.builders.agent_pod import agent_device_requests, build_agent_pods
from pdfabric_operator.builders.names import (
    ClusterRef,
    rankmap_name,
)
from pdfabric_operator.builders.rankmap import build_rankmap, decode_ranks
from pdfabric_operator.builders.services import build_network_policy
from pdfabric_operator.children import (
    delete_owned_children,
    ensure_budget_labels,
    ensure_disruption_budgets,
    ensure_engine_services,
    ensure_router,
    ensure_shared_children,
)
from pdfabric_operator.conditions import agent_fallbacks, ready_condition
from pdfabric_operator.engine_restarts import engine_restarts
from pdfabric_operator.group_pods import keep_groups_whole
from pdfabric_operator.group_restarts import group_members
from pdfabric_operator.kube import Kube, Refused
from pdfabric_operator.ledger import LEDGER, Ledger
from pdfabric_operator.metrics import FALLBACKS, PLACEMENT_FAILURES, PLACEMENT_SHORTFALLS, ReconcileResult
from pdfabric_operator.observed import AgentView, Observed
from pdfabric_operator.peer_certs import cluster_ca, issue_peer_tls, renew_peer_tls
from pdfabric_operator.placement import Placement, PlacementFailure
from pdfabric_operator.planner import placed_spec, plan_placement, usable_nodes
from pdfabric_operator.snapshot import OwnPod, Snapshot
from pdfabric_operator.status import compute_status, status_patch


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _usage(spec: PDClusterSpec, placement: Placement) -> dict[str, dict[str, int]]:
    """Extended resources per node, summed over the node's pods."""
    usage: dict[str, dict[str, int]] = {}
    for a in placement.agents:
        node = usage.setdefault(a.node, {})
        for resource, count in agent_device_requests(spec, a, placement.transport).items():
            node[resource] = node.get(resource, 0) + count
    return usage


def _is_current(pod: OwnPod, want: Mapping[str, Any] | None) -> bool:
    """The pod is the one the builders want now: same build hash, not failed, not on its way out."""
    return (
        want is not None
        and not pod.deleting
        and not pod.failed
        and want["metadata"]["annotations"][c.ANN_POD_HASH] == pod.pod_hash
    )


def _serves_meanwhile(pod: OwnPod, want: Mapping[str, Any] | None) -> bool:
    """Not current, but it keeps serving until a rolling update replaces it: the same ranks and
    agent settings (only the image, resources or pod overrides changed), not failed or leaving."""
    if want is None or pod.deleting or pod.failed or pod.unschedulable:
        return False
    ann = want["metadata"]["annotations"]
    return bool(ann[c.ANN_RANKS] == pod.ranks and ann[c.ANN_CONFIG_HASH] == pod.config_hash)


def reconcile_once(
    kube: Kube,
    ref: ClusterRef,
    raw_spec: Mapping[str, Any],
    generation: int,
    stored_status: Mapping[str, Any] | None,
    snap: Snapshot,
    memory: ClusterMemory,
    *,
    recheck_children_after: float,
    stored_rv: str | None = None,
    ledger: Ledger = LEDGER,
    network_policy: bool = True,
    monitoring_namespace: str = "",
    operator_namespace: str = "",
    cert_valid_for: timedelta = pki.AGENT_VALID_FOR,
    group_bind_timeout: float = 300.0,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> Result:
    out = Result(ReconcileResult.PROGRESSING)
    own = list(snap.own)

    # 1. Spec.
    try:
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        status = compute_status(Observed(generation, PDClusterSpec(), None, spec_error=str(exc)), ref.name)
        out.result = ReconcileResult.INVALID
        out.patched = _write_status(kube, ref, status, stored_status, stored_rv, memory)
        return out

    # 2. Plan, sticky to the last plan (not to the pods: a pod being replaced would make the plan
    # flip between two nodes). After a restart the rank map is the durable record of that plan.
    usable = usable_nodes(spec, snap.nodes)
    # Never reconciled (no status written by any operator, none by this one): nothing of it can
    # exist yet but what a run cut short made, so its children are created without reading
    # each first (one there all the same answers 409 and is read then).
    new = memory.last_status is None and not (stored_status or {}).get("observedGeneration")
    if memory.last_plan is None:
        memory.last_plan = _plan_on_record(kube, ref, own, new)
    previous = memory.last_plan
    lost = sorted({p.node for p in own if p.node and p.node not in usable})
    with ledger.lock:
        placed = ledger.merged(snap.placed, ref.uid)
        outcome = plan_placement(spec, snap.nodes, placed, cluster_uid=ref.uid, previous=previous)
        if isinstance(outcome, Placement):
            ledger.record(ref.uid, _usage(placed_spec(spec, outcome), outcome))
            memory.last_plan = outcome.ranks_by_node()
        else:
            ledger.forget(ref.uid)
            memory.last_plan = {}

    # 3. Children.
    views: list[AgentView] = []
    router: Mapping[str, Any] | None = None
    refused: dict[str, str] = {}  # agent pods the API server would not create, with its message
    unschedulable: dict[str, str] = {}  # current agent pods the scheduler has not bound, with its word
    if isinstance(outcome, PlacementFailure):
        PLACEMENT_FAILURES.labels(outcome.reason.value).inc()
        out.result = ReconcileResult.UNPLACED
        out.problem = (outcome.reason, outcome.message)
        out.unplaced = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas}
        for p in own:
            if not p.deleting and kube.delete("Pod", p.namespace, p.name, uid=p.uid):
                out.actions.append(f"delete pod {p.name}")
        if not memory.children_absent:
            out.actions += delete_owned_children(kube, ref, [p.name for p in own])
            memory.children_absent = True
            memory.children_checked_at = 0.0
    else:
        if outcome.is_fallback:
            FALLBACKS.inc()
            out.problem = (
                "FallbackTCP",
                f"running tcp instead of {outcome.requested_transport.value}: {outcome.fallback_reason}",
            )
        if outcome.shortfall is not None:  # the step's rest waits for room, as Pending pods do
            short = outcome.shortfall
            PLACEMENT_SHORTFALLS.labels(short.reason.value).inc()
            out.problem = (short.reason.value, short.words)
            out.unplaced = short.unplaced
        # Every child is built for the replicas placed: a step that could not be placed changes
        # none of the hashes (rank map, pods, services, router) of what runs.
        built = placed_spec(spec, outcome)
        memory.children_absent = False
        rankmap = build_rankmap(ref, _placed_raw_spec(raw_spec, outcome), outcome)
        policy = build_network_policy(ref, built, monitoring_namespace, operator_namespace) if network_policy else None
        ensure_shared_children(kube, ref, built, rankmap, policy, memory, recheck_children_after, out, new=new)
        if not memory.children_checked_at or memory.engine_services_hash != memory.last_rankmap_hash:
            ensure_engine_services(kube, ref, built, outcome, out, new=new)
            ensure_disruption_budgets(kube, ref, built, outcome, out, new=new)
            memory.engine_services_hash = memory.last_rankmap_hash
        router = ensure_router(kube, ref, built, outcome, memory, out, new=new)
        desired = {pod["metadata"]["name"]: pod for pod in build_agent_pods(ref, built, outcome)}
        existing = {p.name: p for p in own}
        # Pods whose ranks moved (or that failed, or are no longer wanted) go at once: the plan
        # needs them elsewhere. Pods that only drifted (image, resources, ports) roll one at a
        # time, and only while every other agent is Ready, so the fabric keeps moving KV.
        rolling: list[OwnPod] = []
        for p in own:
            want = desired.get(p.name)
            if p.deleting or _is_current(p, want):
                continue
            # An unbound pod serves nothing: replaced at once (the new spec may let it fit).
            unbound = bool(p.unschedulable)
            if (
                want is not None
                and not p.failed
                and not unbound
                and want["metadata"]["annotations"][c.ANN_RANKS] == p.ranks
            ):
                rolling.append(p)
            elif kube.delete("Pod", p.namespace, p.name, uid=p.uid):
                out.actions.append(f"delete pod {p.name}")
            if want is None:  # the agent is gone: its certificate goes too (ours only)
                out.actions += delete_owned_children(kube, ref, [p.name], shared=False)
        groups = group_members(ref.name, built, outcome)
        kept = keep_groups_whole(kube, groups, own, snap.reports, memory.group_holds, now(), group_bind_timeout)
        out.actions += kept.actions
        out.events += kept.events
        settled = all(existing.get(n) is not None and existing[n].ready and not existing[n].deleting for n in desired)
        if rolling and settled:
            p = min(rolling, key=lambda x: x.name)
            if kube.delete("Pod", p.namespace, p.name, uid=p.uid):
                out.actions.append(f"delete pod {p.name} (rolling)")
        missing = [(name, pod) for name, pod in desired.items() if name not in existing and name not in kept.held]
        if missing:
            ca = cluster_ca(kube, ref, memory)
            for name, renew_at, created, refusal in _create_agent_pods(
                kube, ref, missing, ca, rankmap.digest, cert_valid_for, now
            ):
                memory.cert_renew_at[name] = renew_at
                if created:
                    out.actions.append(f"create pod {name}")
                if refusal:  # admission said no: reported, tried again next reconcile
                    refused[name] = refusal
        renew_peer_tls(kube, ref, [p for p in own if p.name in desired and not p.deleting], memory, cert_valid_for,
                        now(), out)  # fmt: skip
        out.actions += _tell_pods_of_rankmap(kube, [p for p in own if p.name in desired], rankmap.digest)
        out.actions += ensure_budget_labels(kube, own, desired)
        for gone in set(memory.cert_renew_at) - set(desired):
            del memory.cert_renew_at[gone]
        unschedulable = {
            p.name: f"node {p.node}: {p.unschedulable}"
            for p in own
            if p.unschedulable and _is_current(p, desired.get(p.name))
        } | kept.held
        for p in own:
            requested, transport = snap.transports.get(p.uid, ("", ""))
            said = snap.reports.get(p.uid)
            report = said if spec.engine is not None else None
            # With engines in the pod, pod Ready is also theirs: the agent's /readyz says its own.
            agent_ready = report.ready if report is not None and report.ready is not None else p.ready
            views.append(
                AgentView(
                    p.name,
                    p.node,
                    agent_ready,
                    _is_current(p, desired.get(p.name)),
                    requested,
                    transport,
                    dict(report.engines or {}) if report is not None else {},
                    serving=_serves_meanwhile(p, desired.get(p.name)),
                    rankmap=said.rankmap if said is not None else "",
                    rankmap_refused=said.rankmap_refused if said is not None else "",
                    reason=said.reason if said is not None else "",
                    message=said.message if said is not None else "",
                )
            )
        out.events += engine_restarts(memory, built, own, snap.reports)

    # 4. Status.
    status = compute_status(
        Observed(
            generation, spec, outcome, views, lost_nodes=lost, namespace=ref.namespace, router=router,
            refused_pods=refused, unschedulable_pods=unschedulable,
            rankmap=memory.last_rankmap_hash or "" if isinstance(outcome, Placement) else "",
        ),
        ref.name,
    )  # fmt: skip
    if refused:  # the Event says what the Ready condition says
        out.problem = ("PodRejected", ready_condition(status)["message"])
    elif unschedulable:
        out.problem = ("PodUnschedulable", ready_condition(status)["message"])
    fell_back = agent_fallbacks(views)
    if fell_back and out.problem is None:
        out.problem = ("AgentTransportFallback", fell_back)
    if isinstance(outcome, Placement) and ready_condition(status)["status"] == "True":
        out.result = ReconcileResult.READY
    out.ready = ready_condition(status)["status"] == "True"
    out.placed = any(x["type"] == c.COND_PLACED and x["status"] == "True" for x in status["conditions"])
    # Unsettled while an agent that answered is behind; one that never answered (not reachable, not
    # started) is read again at the usual pace, not every UNSETTLED_RECHECK_S.
    members = [x for x in status["conditions"] if x["type"] == c.COND_RANKMAP_CURRENT]
    memory.membership_settled = all(x["status"] == "True" for x in members)
    out.patched = _write_status(kube, ref, status, stored_status, stored_rv, memory)
    return out


def _placed_raw_spec(raw_spec: Mapping[str, Any], placement: Placement) -> Mapping[str, Any]:
    """The spec as written, with the replica counts placed: what the rank map embeds, so an
    overshoot's rank map is byte for byte the one before it."""
    short = placement.shortfall
    if short is None:
        return raw_spec
    clipped = dict(raw_spec)
    for role in ("prefill", "decode"):
        asked, placed = short.asked_placed(role)
        if placed < asked:  # a role placed in full stays as written (replicas may be left out)
            clipped[role] = {**(raw_spec.get(role) or {}), "replicas": placed}
    return clipped


# New agent pods of one cluster created this many at a time: the largest PDCluster's 1,024 pods
# and their 1,024 certificates were 2,048 round trips one after another (most of its minute to Ready).
CREATE_CONCURRENCY = 8


def _create_agent_pods(
    kube: Kube,
    ref: ClusterRef,
    missing: Sequence[tuple[str, dict[str, Any]]],
    ca: pki.KeyPair,
    digest: str,
    valid_for: timedelta,
    now: Callable[[], datetime],
) -> list[tuple[str, datetime, bool, str]]:
    """Each new pod with a new key and certificate (rotation: a replaced agent's old key no longer
    matches what its name's Secret holds), stamped with the rank map it starts on. Per pod, in
    order: its name, when its certificate is due, whether it was created, admission's refusal."""

    def one(item: tuple[str, dict[str, Any]]) -> tuple[str, datetime, bool, str]:
        name, pod = item
        renew_at = issue_peer_tls(kube, ref, name, ca, valid_for, now())
        pod["metadata"]["annotations"][c.ANN_RANKMAP_HASH] = digest
        try:
            return name, renew_at, kube.create(pod), ""
        except Refused as exc:
            return name, renew_at, False, exc.message

    if len(missing) < 2:
        return [one(item) for item in missing]
    with ThreadPoolExecutor(min(CREATE_CONCURRENCY, len(missing)), thread_name_prefix="pdfabric-create") as pool:
        return list(pool.map(one, missing))


def _tell_pods_of_rankmap(kube: Kube, pods: Sequence[OwnPod], digest: str) -> list[str]:
    """Annotate the pods with the rank map just written: an update of the pod makes its kubelet
    sync it now, which rewrites the mounted map (else only its next periodic sync does, up to
    a minute or more), and the agent adopts it within a second of that (live membership)."""
    actions = []
    for p in pods:
        told = not p.deleting and p.rankmap_hash != digest
        if told and kube.annotate("Pod", p.namespace, p.name, p.uid, {c.ANN_RANKMAP_HASH: digest}):
            actions.append(f"annotate pod {p.name} with rank map {digest}")
    return actions


def _plan_on_record(kube: Kube, ref: ClusterRef, own: Sequence[OwnPod], new: bool) -> dict[str, tuple[Rank, ...]]:
    """The last placement: the rank map if it is this cluster's, else the live agent pods' ranks
    (a `new` cluster's rank map is not read: none was written by a run that finished)."""
    cm = None if new else kube.get("ConfigMap", ref.namespace, rankmap_name(ref.name))
    text = ((cm or {}).get("data") or {}).get(RANKMAP_KEY)
    if isinstance(text, str):
        try:
            rankmap = RankMap.from_json(text)
        except ValueError:  # RankMapError: not a rank map (written over), the pods say then
            rankmap = None
        if rankmap is not None and rankmap.cluster_uid == ref.uid:
            return _by_node((a.node, a.ranks) for a in rankmap.agents)
    return _by_node((p.node, decode_ranks(p.ranks)) for p in own if not p.deleting)


def _by_node(pods: Iterable[tuple[str, tuple[Rank, ...]]]) -> dict[str, tuple[Rank, ...]]:
    """Every rank on each node, from its pods."""
    out: dict[str, tuple[Rank, ...]] = {}
    for node, ranks in pods:
        out[node] = out.get(node, ()) + ranks
    return out


def _write_status(
    kube: Kube,
    ref: ClusterRef,
    status: dict[str, Any],
    stored: Mapping[str, Any] | None,
    stored_rv: str | None,
    memory: ClusterMemory,
) -> bool:
    # Compare with what we last wrote while the stored object is still the one our write made
    # (the watch may lag behind it); once anything else changed the object, compare with what is
    # stored, so a status written by someone else (a replica on its way out) is corrected.
    if memory.last_status is not None and (stored_rv is None or stored_rv == memory.last_status_rv):
        base: Mapping[str, Any] = memory.last_status
    else:
        base = stored or {}
    patch = status_patch(status, base, _now())
    if patch is None:
        return False
    written = kube.patch_status(ref.namespace, ref.name, patch)
    memory.last_status = {**dict(base), **patch}
    memory.last_status_rv = (written or {}).get("metadata", {}).get("resourceVersion")
    return True
