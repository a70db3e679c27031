"""One level-based reconcile of one PDCluster, as numbered steps.

It runs in a worker thread on a snapshot of the watch caches (kopf indices) taken on the event
loop, so it never iterates a dict the loop is mutating. Steps:

1. Parse the spec (an invalid spec: status says why, children untouched).
2. Plan against the snapshot plus the in-memory ledger of placements this operator just made
   (the watch cache lags our own creates; without the ledger two clusters planned in the same
   second would both take the same GPUs).
3. No fit: delete every child, publish the reason. Fit: ensure the engine-token and peer-CA
   Secrets, Service, NetworkPolicy, rank-map ConfigMap, then agent pods (replace a pod whose build hash differs,
   delete pods no longer wanted with their certificates, create missing ones, each after issuing
   its own peer certificate: a new pod is a new key; deterministic names make an interrupted run
   safe to repeat).
4. Compute status from what was seen and patch it only if it changed.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RANKMAP_KEY, Rank, RankMap
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_operator import constants as c
from pdfabric_operator import pki
from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.builders.agent_pod import agent_device_requests, build_agent_pods
from pdfabric_operator.builders.credentials import (
    build_ca_secret,
    build_engine_token_secret,
    build_peer_tls_secret,
    keypair_from_secret,
)
from pdfabric_operator.builders.names import (
    ClusterRef,
    ca_secret_name,
    engine_service_name,
    engine_token_secret_name,
    network_policy_name,
    peer_dns_name,
    peer_tls_secret_name,
    rankmap_name,
    router_name,
    service_name,
    shared_children,
)
from pdfabric_operator.builders.rankmap import build_rankmap, build_rankmap_configmap, decode_ranks
from pdfabric_operator.builders.router import build_router_deployment, build_router_service
from pdfabric_operator.builders.services import build_engine_service, build_headless_service, build_network_policy
from pdfabric_operator.conditions import agent_fallbacks, ready_condition
from pdfabric_operator.kube import Kube, Refused
from pdfabric_operator.metrics import FALLBACKS, PLACEMENT_FAILURES, ReconcileResult
from pdfabric_operator.observed import AgentView, Observed
from pdfabric_operator.placement import GpuNode, PlacedPod, Placement, PlacementFailure
from pdfabric_operator.planner import plan_placement, usable_nodes
from pdfabric_operator.status import compute_status, status_patch


@dataclass(frozen=True)
class OwnPod:
    """An agent pod of some PDCluster, as the pod index holds it."""

    name: str
    namespace: str
    uid: str
    node: str
    ready: bool
    deleting: bool
    pod_hash: str
    ranks: str
    failed: bool = False  # phase Failed (e.g. the kubelet refused it): replace it
    ip: str = ""  # status.podIP: where the operator reads the agent's /readyz (agentstate)
    # Not bound yet and the scheduler said why (its PodScheduled=False message); "" otherwise.
    unschedulable: str = ""
    config_hash: str = ""  # the agent settings it was built with (builders.agent_config_hash)
    rankmap_hash: str = ""  # the rank map the operator last told it of (ANN_RANKMAP_HASH)


@dataclass(frozen=True)
class Snapshot:
    nodes: Sequence[GpuNode]
    placed: Sequence[PlacedPod]
    own: Sequence[OwnPod]
    # Pod uid -> (requested, in use) as the agent's /readyz said (agentstate); absent: not read yet.
    transports: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # With spec.engine: pod uid -> the agent's /readyz as read for this reconcile (its own
    # readiness, its engines); absent: it did not answer.
    reports: Mapping[str, AgentReport] = field(default_factory=dict)


class Ledger:
    """GPUs (and RDMA devices) each PDCluster was last given by this operator: node -> requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_uid: dict[str, dict[str, dict[str, int]]] = {}

    def merged(self, cached: Sequence[PlacedPod], exclude_uid: str) -> list[PlacedPod]:
        """What holds GPUs now: the watch cache, raised to the ledger where the ledger knows more.

        Per (cluster, node, resource) the larger of the two counts: the ledger covers pods we just
        created that the cache has not seen; the cache covers pods of an older placement that are
        still terminating (they hold their devices until the kubelet lets go).
        """
        usage: dict[tuple[str | None, str], dict[str, int]] = {}
        out: list[PlacedPod] = []
        for pod in cached:
            if pod.owner_uid is None or pod.owner_uid not in self._by_uid:
                out.append(pod)
                continue
            acc = usage.setdefault((pod.owner_uid, pod.node), {})
            for k, v in pod.requests.items():
                acc[k] = acc.get(k, 0) + v
        for uid, nodes in self._by_uid.items():
            for node, req in nodes.items():
                acc = usage.setdefault((uid, node), {})
                for k, v in req.items():
                    acc[k] = max(acc.get(k, 0), v)
        out += [PlacedPod(node, req, uid) for (uid, node), req in usage.items() if uid != exclude_uid]
        return out

    def record(self, uid: str, usage: dict[str, dict[str, int]]) -> None:
        self._by_uid[uid] = usage

    def forget(self, uid: str) -> None:
        self._by_uid.pop(uid, None)

    def clear(self) -> None:
        with self.lock:
            self._by_uid.clear()


LEDGER = Ledger()


@dataclass
class ClusterMemory:
    """What one PDCluster's reconciles remember between runs (lost on restart, by design)."""

    last_status: dict[str, Any] | None = None
    last_status_rv: str | None = None  # resourceVersion our last status patch produced
    children_checked_at: float = 0.0
    children_absent: bool = False
    last_rankmap_hash: str | None = None
    # Every serving agent said it runs the rank map last written (status RankMapCurrent True).
    membership_settled: bool = True
    last_plan: dict[str, tuple[Rank, ...]] | None = None  # node -> ranks of the last placement
    engine_services_hash: str | None = None  # the rank map the engines' Services were last checked for
    # Engine restarts last seen, pod uid -> engine -> count (an EngineRestarted Event when it grows);
    # pods that ran before this memory began are judged from their first reading on.
    engine_restarts: dict[str, dict[str, int]] = field(default_factory=dict)
    restart_baseline: set[str] | None = None
    # Agent pod name -> when its peer certificate is to be issued anew (read from its Secret the
    # first time, then from each issue).
    cert_renew_at: dict[str, datetime] = field(default_factory=dict)
    router_absent: bool = False  # spec.router is off and its children were checked gone


@dataclass
class Result:
    result: ReconcileResult
    patched: bool = False
    actions: list[str] = field(default_factory=list)
    # Why the cluster cannot run as asked (no fit, or the declared fallback), for a k8s Event.
    problem: tuple[str, str] | None = None
    # Warning Events to emit once each (reason, message): engines that restarted since last seen.
    events: list[tuple[str, str]] = field(default_factory=list)
    # Normal Events to emit once each (reason, message): peer certificates renewed.
    notices: list[tuple[str, str]] = field(default_factory=list)
    # The Ready and Placed conditions as written (the per-PDCluster gauges the alerts read).
    ready: bool = False
    placed: bool = False


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
    if memory.last_plan is None:
        memory.last_plan = _plan_on_record(kube, ref, own)
    previous = memory.last_plan
    lost = sorted({p.node for p in own if p.node and p.node not in usable})
    with ledger.lock:
        placed = ledger.merged(snap.placed, ref.uid)
        outcome = plan_placement(spec, snap.nodes, placed, cluster_uid=ref.uid, previous=previous)
        if isinstance(outcome, Placement):
            ledger.record(ref.uid, _usage(spec, outcome))
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
        memory.children_absent = False
        rankmap = build_rankmap(ref, raw_spec, outcome)
        policy = build_network_policy(ref, spec, monitoring_namespace, operator_namespace) if network_policy else None
        _ensure_shared_children(kube, ref, spec, rankmap, policy, memory, recheck_children_after, out)
        if not memory.children_checked_at or memory.engine_services_hash != memory.last_rankmap_hash:
            _ensure_engine_services(kube, ref, spec, outcome, out)
            memory.engine_services_hash = memory.last_rankmap_hash
        router = _ensure_router(kube, ref, spec, outcome, memory, out)
        desired = {pod["metadata"]["name"]: pod for pod in build_agent_pods(ref, spec, outcome)}
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
        settled = all(existing.get(n) is not None and existing[n].ready and not existing[n].deleting for n in desired)
        if rolling and settled:
            p = min(rolling, key=lambda x: x.name)
            if kube.delete("Pod", p.namespace, p.name, uid=p.uid):
                out.actions.append(f"delete pod {p.name} (rolling)")
        for name, pod in desired.items():
            if name not in existing:
                # Every new pod gets a new key and certificate (rotation: a replaced agent's old
                # key no longer matches what its name's Secret holds).
                memory.cert_renew_at[name] = _issue_peer_tls(kube, ref, name, cert_valid_for, now())
                pod["metadata"]["annotations"][c.ANN_RANKMAP_HASH] = rankmap.digest
                try:
                    if kube.create(pod):
                        out.actions.append(f"create pod {name}")
                except Refused as exc:  # admission said no: reported, tried again next reconcile
                    refused[name] = exc.message
        _renew_peer_tls(kube, ref, [p for p in own if p.name in desired and not p.deleting], memory, cert_valid_for,
                        now(), out)  # fmt: skip
        out.actions += _tell_pods_of_rankmap(kube, [p for p in own if p.name in desired], rankmap.digest)
        for gone in set(memory.cert_renew_at) - set(desired):
            del memory.cert_renew_at[gone]
        unschedulable = {
            p.name: f"node {p.node}: {p.unschedulable}"
            for p in own
            if p.unschedulable and _is_current(p, desired.get(p.name))
        }
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
        out.events += _engine_restarts(memory, spec, own, snap.reports)

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


def _engine_restarts(
    memory: ClusterMemory, spec: PDClusterSpec, own: Sequence[OwnPod], reports: Mapping[str, AgentReport]
) -> list[tuple[str, str]]:
    """EngineRestarted Events for engines whose restart count grew since the last reading (a
    pod first read that ran before this operator's memory of the cluster began is a baseline; a
    pod that started since counts from 0)."""
    if spec.engine is None:
        memory.engine_restarts.clear()
        memory.restart_baseline = None
        return []
    if memory.restart_baseline is None:
        memory.restart_baseline = {p.uid for p in own}
    pods = {p.uid: p for p in own}
    for uid in set(memory.engine_restarts) - set(pods):
        del memory.engine_restarts[uid]
    memory.restart_baseline &= set(pods)
    events: list[tuple[str, str]] = []
    for uid, report in sorted(reports.items()):
        pod = pods.get(uid)
        if pod is None or report.engines is None:
            continue
        seen = memory.engine_restarts.get(uid)
        baseline = seen is None and uid in memory.restart_baseline
        now: dict[str, int] = {}
        for name, state in sorted(report.engines.items()):
            before = (seen or {}).get(name, state.restarts if baseline else 0)
            if state.restarts > before:
                last = f"; last exit: {state.last_exit}" if state.last_exit else ""
                events.append(
                    (
                        "EngineRestarted",
                        f"engine {name} in pod {pod.name} restarted ({state.restarts} restarts{last})",
                    )
                )
            now[name] = state.restarts
        memory.engine_restarts[uid] = now
    return events


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


def _plan_on_record(kube: Kube, ref: ClusterRef, own: Sequence[OwnPod]) -> dict[str, tuple[Rank, ...]]:
    """The last placement: the rank map if it is this cluster's, else the live agent pods' ranks."""
    cm = kube.get("ConfigMap", ref.namespace, rankmap_name(ref.name))
    if cm is not None:
        try:
            rankmap = RankMap.from_json(cm["data"][RANKMAP_KEY])
        except (KeyError, ValueError):
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


def _ensure_shared_children(
    kube: Kube,
    ref: ClusterRef,
    spec: PDClusterSpec,
    rankmap: RankMap,
    policy: dict[str, Any] | None,
    memory: ClusterMemory,
    recheck_after: float,
    out: Result,
) -> None:
    """`policy`: the NetworkPolicy wanted, None when the operator's settings turn it off (one
    built before is deleted then); one that differs (the monitoring namespace changed) is replaced."""
    cm = build_rankmap_configmap(ref, rankmap)
    want_hash = cm["metadata"]["annotations"][c.ANN_RANKMAP_HASH]
    fresh = time.monotonic() - memory.children_checked_at < recheck_after
    if fresh and memory.last_rankmap_hash == want_hash:
        return
    if kube.get("Secret", ref.namespace, engine_token_secret_name(ref.name)) is None:
        kube.create(build_engine_token_secret(ref, secrets.token_urlsafe(32)))
        out.actions.append("create engine-token secret")
    if kube.get("Secret", ref.namespace, ca_secret_name(ref.name)) is None:
        _cluster_ca(kube, ref)
        out.actions.append("create peer CA secret")
    if kube.get("Service", ref.namespace, service_name(ref.name)) is None:
        kube.create(build_headless_service(ref, spec))
        out.actions.append("create service")
    have_policy = kube.get("NetworkPolicy", ref.namespace, network_policy_name(ref.name))
    # Only this cluster's own policy is replaced or deleted, never a namesake someone else made.
    owned = have_policy is not None and _owned(have_policy, ref.uid)
    if policy is None:
        if owned and kube.delete("NetworkPolicy", ref.namespace, network_policy_name(ref.name)):
            out.actions.append("delete networkpolicy (turned off)")
    elif have_policy is None:
        kube.create(policy)
        out.actions.append("create networkpolicy")
    elif owned and have_policy.get("spec") != policy["spec"]:
        kube.replace(policy, have_policy["metadata"]["resourceVersion"])
        out.actions.append("update networkpolicy")
    have = kube.get("ConfigMap", ref.namespace, cm["metadata"]["name"])
    if have is None:
        kube.create(cm)
        out.actions.append("create configmap")
    elif (have["metadata"].get("annotations") or {}).get(c.ANN_RANKMAP_HASH) != want_hash:
        kube.replace(cm, have["metadata"]["resourceVersion"])
        out.actions.append("update configmap")
    memory.children_checked_at = time.monotonic()
    memory.last_rankmap_hash = want_hash


def _service_ports(svc: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    return [(p.get("name", ""), p.get("port", 0), str(p.get("targetPort", ""))) for p in svc["spec"].get("ports") or []]


def _ensure_engine_services(
    kube: Kube, ref: ClusterRef, spec: PDClusterSpec, placement: Placement, out: Result
) -> None:
    """The per-role Services of the engines: created, updated when their ports change (a node
    got a second engine of a role), deleted when spec.engine goes (only ours, never a namesake)."""
    for role in Role:
        want = build_engine_service(ref, spec, placement, role)
        name = engine_service_name(ref.name, role.value)
        have = kube.get("Service", ref.namespace, name)
        owned = have is not None and _owned(have, ref.uid)
        if want is None:
            if owned and kube.delete("Service", ref.namespace, name):
                out.actions.append(f"delete service {name} (no engines)")
        elif have is None:
            if kube.create(want):
                out.actions.append(f"create service {name}")
        elif owned and (
            _service_ports(have) != _service_ports(want) or have["spec"].get("selector") != want["spec"]["selector"]
        ):
            body = dict(
                want, spec={**have["spec"], "ports": want["spec"]["ports"], "selector": want["spec"]["selector"]}
            )
            kube.replace(body, have["metadata"]["resourceVersion"])
            out.actions.append(f"update service {name}")


def _owned(obj: Mapping[str, Any], uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def delete_owned_children(kube: Kube, ref: ClusterRef, agents: Sequence[str], *, shared: bool = True) -> list[str]:
    """Delete the peer-certificate Secrets of `agents` and (with `shared`) every shared child of
    the cluster, each only if this PDCluster owns it: the names are deterministic, so a user's own
    object may carry one, and it is not ours to delete. The uid precondition keeps a namesake
    created between the read and the delete. Returns what was deleted, as actions."""
    children = [("Secret", peer_tls_secret_name(a)) for a in agents]
    if shared:
        children += shared_children(ref.name)
    actions = []
    for kind, name in children:
        have = kube.get(kind, ref.namespace, name)
        if have is None or not _owned(have, ref.uid):
            continue
        if kube.delete(kind, ref.namespace, name, uid=have["metadata"].get("uid")):
            actions.append(f"delete {kind} {name}")
    return actions


def _ensure_router(
    kube: Kube, ref: ClusterRef, spec: PDClusterSpec, placement: Placement, memory: ClusterMemory, out: Result
) -> Mapping[str, Any] | None:
    """spec.router's Deployment and Service: created, the Deployment replaced when what it was
    built from differs (the engines moved, spec.router changed: it rolls with a surge), both
    deleted when spec.router goes (ours only, never a namesake). Returns the Deployment as read,
    for its readiness in the status; read on every reconcile only while spec.router is set."""
    name, ns = router_name(ref.name), ref.namespace
    want = build_router_deployment(ref, spec, placement)
    if want is None:
        if memory.router_absent:
            return None
        for kind in ("Deployment", "Service"):
            have = kube.get(kind, ns, name)
            if have is not None and _owned(have, ref.uid) and kube.delete(kind, ns, name):
                out.actions.append(f"delete {kind.lower()} {name} (no router)")
        memory.router_absent = True
        return None
    memory.router_absent = False
    have = kube.get("Deployment", ns, name)
    if have is None:
        if kube.create(want):
            out.actions.append(f"create deployment {name}")
    elif _owned(have, ref.uid):
        have_hash = (have["metadata"].get("annotations") or {}).get(c.ANN_ROUTER_HASH)
        if have_hash != want["metadata"]["annotations"][c.ANN_ROUTER_HASH]:
            kube.replace(want, have["metadata"]["resourceVersion"])
            out.actions.append(f"update deployment {name}")
    svc = build_router_service(ref, spec)
    assert svc is not None
    have_svc = kube.get("Service", ns, name)
    if have_svc is None:
        if kube.create(svc):
            out.actions.append(f"create service {name}")
    elif _owned(have_svc, ref.uid) and _service_ports(have_svc) != _service_ports(svc):
        kube.replace(
            dict(svc, spec={**have_svc["spec"], "ports": svc["spec"]["ports"]}), have_svc["metadata"]["resourceVersion"]
        )
        out.actions.append(f"update service {name}")
    return have


def _cluster_ca(kube: Kube, ref: ClusterRef) -> pki.KeyPair:
    """The cluster's peer CA from its Secret, created the first time (once per PDCluster)."""
    name = ca_secret_name(ref.name)
    have = kube.get("Secret", ref.namespace, name)
    if have is None:
        ca = pki.new_ca(ref.namespace, ref.name, ref.uid)
        if kube.create(build_ca_secret(ref, ca)):
            return ca
        have = kube.get("Secret", ref.namespace, name)  # another replica made it first
        if have is None:
            raise RuntimeError(f"Secret {ref.namespace}/{name} was created and is gone again")
    return keypair_from_secret(have)


def _issue_peer_tls(kube: Kube, ref: ClusterRef, agent: str, valid_for: timedelta, now: datetime) -> datetime:
    """A fresh key and certificate for agent pod `agent`, in its Secret (created or replaced);
    returns when it is to be renewed."""
    ca = _cluster_ca(kube, ref)
    leaf = pki.issue_agent(
        ca,
        namespace=ref.namespace,
        cluster=ref.name,
        agent=agent,
        dns_name=peer_dns_name(ref, agent),
        valid_for=valid_for,
        now=now,
    )
    secret = build_peer_tls_secret(ref, agent, leaf, ca)
    if not kube.create(secret):
        have = kube.get("Secret", ref.namespace, secret["metadata"]["name"])
        if have is None:
            kube.create(secret)
        else:
            kube.replace(secret, have["metadata"]["resourceVersion"])
    return pki.renewal_time(leaf.cert_pem)


def _renew_peer_tls(
    kube: Kube,
    ref: ClusterRef,
    running: Sequence[OwnPod],
    memory: ClusterMemory,
    valid_for: timedelta,
    now: datetime,
    out: Result,
) -> None:
    """Issue anew the peer certificate of each running agent whose renewal time came (or whose
    Secret is gone), in place: the pod keeps running and its agent loads the new files."""
    for p in running:
        due = memory.cert_renew_at.get(p.name)
        if due is None:  # first seen by this operator (a restart): its Secret says
            have = kube.get("Secret", ref.namespace, peer_tls_secret_name(p.name))
            due = pki.renewal_time(keypair_from_secret(have).cert_pem) if have is not None else now
            memory.cert_renew_at[p.name] = due
        if now < due:
            continue
        memory.cert_renew_at[p.name] = _issue_peer_tls(kube, ref, p.name, valid_for, now)
        out.actions.append(f"renew certificate of {p.name}")
        out.notices.append(
            ("PeerCertificateRenewed", f"issued agent {p.name} a new peer certificate (Secret "
             f"{peer_tls_secret_name(p.name)}); the running agent loads it")
        )  # fmt: skip


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
