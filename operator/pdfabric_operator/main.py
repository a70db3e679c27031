"""kopf registrations only: each handler is glue (read, snapshot, call reconcile, record).

Shape of the control loop:
- indices (watch caches) of GPU nodes, of every pod holding extended resources, and of our agents;
- one daemon per PDCluster that reconciles on wake-up or every PDFABRIC_RECONCILE_INTERVAL
  (level-based: deleted children, lost nodes and drift are repaired even if an event was missed);
- event handlers that only wake daemons (spec change, agent pod change, node readiness change);
- a delete handler under the pdfabric.dev finalizer that removes the children;
- peering (ClusterKopfPeering) so that of several replicas only the highest priority acts.

Handler ids are persisted by kopf in live objects: do not rename them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, cast

import kopf
from prometheus_client import start_http_server

from pdfabric_core.spec import SpecError, parse_spec
from pdfabric_operator import constants as c
from pdfabric_operator.agentstate import AgentAddress, AgentReport, AgentTransport, read_reports
from pdfabric_operator.bookkeeping import ClusterMemory
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.children import delete_owned_children
from pdfabric_operator.config import OperatorConfig
from pdfabric_operator.kube import Kube, error_type, load_configuration
from pdfabric_operator.ledger import LEDGER
from pdfabric_operator.metrics import (
    CLUSTERS,
    ERRORS,
    PDCLUSTER_PLACED,
    PDCLUSTER_READY,
    RECONCILE_DURATION,
    RECONCILES,
    ReconcileResult,
)
from pdfabric_operator.placement import GpuNode, PlacedPod
from pdfabric_operator.reconcile import reconcile_once
from pdfabric_operator.roles import (
    ROLES,
    RolesMemory,
    RoleView,
    delete_owned_roles,
    role_name,
    role_view,
    sync_roles,
)
from pdfabric_operator.scheduling import taints_from, unschedulable_message
from pdfabric_operator.snapshot import OwnPod, Snapshot


class _State:
    """Process-wide state of the operator (one operator per process)."""

    def __init__(self) -> None:
        self.config = OperatorConfig()
        self.kube: Kube | None = None
        self.wakers: dict[str, asyncio.Event] = {}
        self.memory: dict[str, ClusterMemory] = {}
        self.generations: dict[str, int] = {}
        self.transports: dict[str, dict[str, AgentTransport]] = {}  # cluster uid -> pod uid -> the agent's word
        self.reports: dict[str, dict[str, AgentReport]] = {}  # cluster uid -> pod uid -> its /readyz, last read
        self.node_prints: dict[str, tuple[Any, ...]] = {}
        self.roles: dict[str, RolesMemory] = {}  # cluster uid -> its PDRoles' sync memory (roles.py)
        self.role_generations: dict[str, int] = {}  # PDRole uid -> the generation last seen
        self.metrics_started = False
        self.last_reconcile = 0.0

    def get_kube(self) -> Kube:
        if self.kube is None:
            self.kube = Kube.from_configuration(load_configuration())
        return self.kube

    def wake(self, uid: str | None) -> None:
        event = self.wakers.get(uid or "")
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self.wakers.values():
            event.set()


STATE = _State()


# --- startup, login, probes --------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    cfg = OperatorConfig.from_env()
    STATE.config = cfg
    # A fresh start, as a new process would have (tests restart the operator in-process).
    STATE.kube = None
    STATE.memory.clear()
    STATE.generations.clear()
    STATE.node_prints.clear()
    STATE.roles.clear()
    STATE.role_generations.clear()
    LEDGER.clear()
    # Our own prefix for kopf's finalizer and bookkeeping, in annotations, not in status.
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    # A watch without a server-side timeout can hang forever on a silently dropped connection
    # (kopf docs, "Networking"); the client timeout must exceed the server's.
    settings.watching.server_timeout = cfg.watch_timeout
    settings.watching.client_timeout = cfg.watch_timeout + 30
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.WARNING  # k8s Events only for problems, not every handler run
    if cfg.peering:
        settings.peering.name = cfg.peering
        settings.peering.clusterwide = True
        settings.peering.mandatory = True
        settings.peering.standalone = False
        settings.peering.priority = cfg.priority
        settings.peering.lifetime = cfg.peering_lifetime
    else:
        settings.peering.standalone = True
    if cfg.metrics_port and not STATE.metrics_started:
        start_http_server(cfg.metrics_port)
        STATE.metrics_started = True
    logger.info(f"pdfabric operator: peering={cfg.peering or 'standalone'} priority={cfg.priority}")


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf and the reconciler use the same credentials (in-cluster, else $KUBECONFIG)."""
    cfg = load_configuration()
    STATE.kube = Kube.from_configuration(cfg)
    # The client stores "Bearer <token>" under BearerToken (older releases: authorization).
    auth = cfg.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
    scheme, _space, token = auth.partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme.capitalize() if token else None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.probe(id="clusters")
def probe_clusters(**_: Any) -> int:
    return len(STATE.wakers)


@kopf.on.probe(id="last_reconcile_age_s")
def probe_last_reconcile(**_: Any) -> float | None:
    return round(time.monotonic() - STATE.last_reconcile, 1) if STATE.last_reconcile else None


def _namespaced(namespace: str | None) -> str:
    # PDClusters and pods are namespaced; kopf passes None only for cluster-scoped objects.
    if namespace is None:
        raise kopf.PermanentError("expected a namespaced object")
    return namespace


# --- watch caches ------------------------------------------------------------------------------


def _int_quantity(value: Any) -> int:
    # Extended resources are integers ("8"); anything else is not a device count.
    try:
        return int(str(value))
    except ValueError:
        return 0


def _extended(resources: dict[str, Any]) -> dict[str, int]:
    return {k: _int_quantity(v) for k, v in (resources or {}).items() if "/" in k}


def node_from_body(name: str, labels: Any, spec: Any, status: Any, meta: Any) -> GpuNode:
    conditions = {cond.get("type"): cond.get("status") for cond in status.get("conditions") or []}
    return GpuNode(
        name=name,
        labels=dict(labels),
        allocatable=_extended(status.get("allocatable") or {}),
        ready=conditions.get("Ready") == "True",
        schedulable=not spec.get("unschedulable") and not meta.get("deletionTimestamp"),
        taints=taints_from(spec.get("taints")),
    )


@kopf.index("nodes")
def gpu_nodes(name: str, labels: Any, spec: Any, status: Any, meta: Any, **_: Any) -> dict[str, GpuNode]:
    return {name: node_from_body(name, labels, spec, status, meta)}


@kopf.index("pods")
def gpu_pods(spec: Any, status: Any, labels: Any, annotations: Any, **_: Any) -> dict[str, PlacedPod] | None:
    node = spec.get("nodeName")
    if not node and labels.get(c.LABEL_MANAGED_BY) == c.MANAGED_BY:
        # Our agent pod before the scheduler binds it holds its planned node's GPUs already: after
        # a restart (an empty ledger) another PDCluster must not be planned onto them.
        node = annotations.get(c.ANN_NODE)
    if not node or status.get("phase") in ("Succeeded", "Failed"):
        return None
    requests: dict[str, int] = {}
    for container in spec.get("containers") or []:
        res = container.get("resources") or {}
        # Extended resources must be set in limits; requests default to them.
        for k, v in {**_extended(res.get("limits") or {}), **_extended(res.get("requests") or {})}.items():
            requests[k] = requests.get(k, 0) + v
    if not requests:
        return None
    return {node: PlacedPod(node, requests, labels.get(c.LABEL_CLUSTER_UID))}


@kopf.index(
    "pods",
    labels={c.LABEL_CLUSTER_UID: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_COMPONENT: c.COMPONENT_AGENT},
)
def agent_pods(
    name: str,
    namespace: str | None,
    uid: str,
    spec: Any,
    status: Any,
    labels: Any,
    meta: Any,
    annotations: Any,
    **_: Any,
) -> dict[str, OwnPod]:
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True" for cond in status.get("conditions") or [])
    bound = spec.get("nodeName") or ""
    return {
        labels[c.LABEL_CLUSTER_UID]: OwnPod(
            name=name,
            namespace=_namespaced(namespace),
            uid=uid,
            # Until the scheduler binds it, the node the planner chose for it.
            node=bound or annotations.get(c.ANN_NODE, ""),
            ready=ready,
            deleting=bool(meta.get("deletionTimestamp")),
            pod_hash=annotations.get(c.ANN_POD_HASH, ""),
            ranks=annotations.get(c.ANN_RANKS, ""),
            failed=status.get("phase") in ("Failed", "Succeeded"),
            ip=status.get("podIP") or "",
            unschedulable="" if bound else unschedulable_message(status.get("conditions")),
            config_hash=annotations.get(c.ANN_CONFIG_HASH, ""),
            rankmap_hash=annotations.get(c.ANN_RANKMAP_HASH, ""),
        )
    }


@kopf.index(c.GROUP, c.VERSION, c.ROLE_PLURAL)
def pd_roles(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> dict[tuple[str, str], RoleView]:
    # Every PDRole by name, ours or not: a namesake we do not own must be seen to be left alone.
    return {(_namespaced(namespace), name): role_view(body)}


# --- wake-ups ----------------------------------------------------------------------------------


@kopf.on.event(c.GROUP, c.VERSION, c.PLURAL)
def pdcluster_changed(uid: str, meta: Any, **_: Any) -> None:
    # Status writes also produce events; only a spec change (new generation) needs a reconcile now.
    if STATE.generations.get(uid) != meta.get("generation"):
        STATE.wake(uid)


@kopf.on.event(c.GROUP, c.VERSION, c.ROLE_PLURAL)
def pdrole_changed(type: str | None, uid: str, body: kopf.Body, **_: Any) -> None:
    # kubectl scale, an HPA or KEDA changed spec.replicas (a new generation), or it was deleted:
    # its PDCluster syncs now. Our own status writes change no generation and wake nothing.
    view = role_view(body)
    if type == "DELETED":
        STATE.role_generations.pop(uid, None)
    elif STATE.role_generations.get(uid) == view.generation:
        return
    else:
        STATE.role_generations[uid] = view.generation
    STATE.wake(view.owner_uid)


@kopf.on.event("pods", labels={c.LABEL_CLUSTER_UID: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY})
def agent_pod_changed(labels: Any, **_: Any) -> None:
    STATE.wake(labels.get(c.LABEL_CLUSTER_UID))


@kopf.on.event("nodes")
def node_changed(name: str, type: str | None, body: Any, **_: Any) -> None:
    if type == "DELETED":
        STATE.node_prints.pop(name, None)
        STATE.wake_all()
        return
    meta = body.get("metadata") or {}
    node = node_from_body(name, meta.get("labels") or {}, body.get("spec") or {}, body.get("status") or {}, meta)
    # Heartbeats change nothing the planner reads; wake clusters only when placement inputs change.
    fingerprint = (
        node.ready,
        node.schedulable,
        tuple(sorted(node.allocatable.items())),
        tuple(sorted(node.labels.items())),
        node.taints,
    )
    if STATE.node_prints.get(name) != fingerprint:
        STATE.node_prints[name] = fingerprint
        STATE.wake_all()


# --- the reconcile loop ------------------------------------------------------------------------


NodeIndex = kopf.Index[str, GpuNode]
GpuPodIndex = kopf.Index[str, PlacedPod]
AgentPodIndex = kopf.Index[str, OwnPod]
RoleIndex = kopf.Index[tuple[str, str], RoleView]


def _snapshot(gpu_nodes: NodeIndex, gpu_pods: GpuPodIndex, agent_pods: AgentPodIndex, uid: str) -> Snapshot:
    # Runs on the event loop: the indices are only mutated there, so copying here is race-free.
    return Snapshot(
        nodes=[n for store in gpu_nodes.values() for n in store],
        placed=[p for store in gpu_pods.values() for p in store],
        own=list(agent_pods.get(uid, [])),
    )


async def _with_agents(snap: Snapshot, body: kopf.Body, uid: str) -> Snapshot:
    """The snapshot with what the agents said in their /readyz: each Ready agent's transport (read
    once per pod); with spec.engine every pod's whole word (its readiness, its engines), read
    for every reconcile (engines restart and turn healthy or not while the pod stays)."""
    known = STATE.transports.setdefault(uid, {})
    said = STATE.reports.setdefault(uid, {})
    for gone in set(known) - {p.uid for p in snap.own}:
        del known[gone]
    for gone in set(said) - {p.uid for p in snap.own}:
        del said[gone]
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except SpecError:
        return snap
    port = spec.agent.metrics_port
    reports: dict[str, AgentReport] = {}
    try:
        if spec.engine is not None:
            live = [AgentAddress(p.uid, p.name, p.ip) for p in snap.own if not p.deleting and not p.failed]
            reports = await read_reports(live, port, STATE.config.agent_addresses)
            known.update({k: r.transport for k, r in reports.items() if r.transport is not None})
        else:
            # Fabric-only: read an agent again only while its word may change: not Ready (its
            # reason), or not yet on the rank map last written (live membership).
            current = STATE.memory[uid].last_rankmap_hash if uid in STATE.memory else None
            unsettled = [
                AgentAddress(p.uid, p.name, p.ip)
                for p in snap.own
                if not p.deleting
                and not p.failed
                and (p.uid not in said or not p.ready or said[p.uid].rankmap != current)
            ]
            said.update(await read_reports(unsettled, port, STATE.config.agent_addresses))
            known.update({k: r.transport for k, r in said.items() if r.transport is not None})
            reports = dict(said)
    except Exception as exc:  # never in the way of the reconcile: read again next time
        logging.getLogger("pdfabric.operator").warning("reading the agents' /readyz failed: %r", exc)
    return dataclasses.replace(
        snap, transports={k: (t.requested, t.transport) for k, t in known.items()}, reports=reports
    )


UNSETTLED_RECHECK_S = 2.0  # how soon to read the agents again while they move to a new rank map


@kopf.daemon(c.GROUP, c.VERSION, c.PLURAL, id="reconcile", cancellation_timeout=10.0)
async def reconcile_daemon(
    body: kopf.Body,
    name: str,
    namespace: str | None,
    uid: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    # kopf passes every index to every handler as a kwarg named after it; its handler protocols
    # cannot name them, so they are read from kwargs with their types here.
    gpu_nodes: NodeIndex = kwargs["gpu_nodes"]
    gpu_pods: GpuPodIndex = kwargs["gpu_pods"]
    agent_pods: AgentPodIndex = kwargs["agent_pods"]
    pd_roles: RoleIndex = kwargs["pd_roles"]
    ref = ClusterRef(_namespaced(namespace), name, uid)
    wake = STATE.wakers.setdefault(uid, asyncio.Event())
    memory = STATE.memory.setdefault(uid, ClusterMemory())
    roles_memory = STATE.roles.setdefault(uid, RolesMemory())
    CLUSTERS.set(len(STATE.wakers))
    last_problem: tuple[str, str] | None = None
    try:
        while not stopped:
            wake.clear()
            if body.get("metadata", {}).get("deletionTimestamp"):
                return
            generation = body.get("metadata", {}).get("generation", 0)
            STATE.generations[uid] = generation
            roles_again = await _sync_roles(body, ref, generation, pd_roles, roles_memory, logger)
            snap = await _with_agents(_snapshot(gpu_nodes, gpu_pods, agent_pods, uid), body, uid)
            started = time.monotonic()
            try:
                res = await asyncio.to_thread(
                    reconcile_once,
                    STATE.get_kube(),
                    ref,
                    dict(body.get("spec") or {}),
                    generation,
                    body.get("status"),
                    snap,
                    memory,
                    recheck_children_after=STATE.config.reconcile_interval / 2,
                    stored_rv=body.get("metadata", {}).get("resourceVersion"),
                    network_policy=STATE.config.network_policy,
                    monitoring_namespace=STATE.config.monitoring_namespace,
                    operator_namespace=STATE.config.namespace,
                    cert_valid_for=STATE.config.peer_cert_validity,
                )
                RECONCILES.labels(res.result.value).inc()
                PDCLUSTER_READY.labels(ref.namespace, ref.name).set(res.ready)
                PDCLUSTER_PLACED.labels(ref.namespace, ref.name).set(res.placed)
                if res.actions:
                    logger.info(f"reconciled ({res.result.value}): {'; '.join(res.actions)}")
                # One Event per new problem (kubectl describe shows it), not one per reconcile.
                if res.problem != last_problem and res.problem is not None:
                    kopf.warn(body, reason=res.problem[0], message=res.problem[1])
                last_problem = res.problem
                for reason, message in res.events:  # each once, when it happened (engine restarts)
                    kopf.warn(body, reason=reason, message=message)
                for reason, message in res.notices:  # certificates renewed (not under posting.level)
                    kopf.event(body, type="Normal", reason=reason, message=message)
            except Exception as exc:
                RECONCILES.labels(ReconcileResult.ERROR.value).inc()
                ERRORS.labels(error_type(exc).value).inc()
                memory.last_status = None  # re-read the stored status next time
                logger.warning(f"reconcile failed, retrying: {exc!r}")
                wake.set()
                await asyncio.sleep(1.0)
            finally:
                RECONCILE_DURATION.observe(time.monotonic() - started)
                STATE.last_reconcile = time.monotonic()
            # Coalesce bursts of events (a pod creation emits several) into one reconcile.
            await asyncio.sleep(0.05)
            # While agents move to a new rank map, look again soon: their word is the status'.
            interval = STATE.config.reconcile_interval
            if not memory.membership_settled:
                interval = min(interval, UNSETTLED_RECHECK_S)
            if roles_again:  # a second's pause: a persistent failure must not spin the loop
                await asyncio.sleep(1.0)
                wake.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=interval)
    finally:
        STATE.wakers.pop(uid, None)
        STATE.transports.pop(uid, None)
        STATE.reports.pop(uid, None)
        STATE.roles.pop(uid, None)
        CLUSTERS.set(len(STATE.wakers))
        for gauge in (PDCLUSTER_READY, PDCLUSTER_PLACED):  # gone, or reconciled by another replica now
            with contextlib.suppress(KeyError):
                gauge.remove(ref.namespace, ref.name)


async def _sync_roles(
    body: kopf.Body, ref: ClusterRef, generation: int, pd_roles: RoleIndex, memory: RolesMemory, logger: kopf.Logger
) -> bool:
    """The PDCluster's PDRoles (roles.py) made and in agreement with it; never in the way of the
    reconcile that follows. True when it should run again soon (a failure, a write conflict)."""
    # Copied on the event loop, where the index is mutated (see _snapshot).
    names = {role_name(ref.name, role) for role in ROLES}
    views = {n: v for n in names for v in pd_roles.get((ref.namespace, n), [])}
    try:
        res = await asyncio.to_thread(
            sync_roles,
            STATE.get_kube(),
            ref,
            dict(body.get("spec") or {}),
            dict(body.get("status") or {}),
            generation,
            views,
            memory,
        )
    except Exception as exc:
        ERRORS.labels(error_type(exc).value).inc()
        logger.warning(f"syncing the PDRoles failed, retrying: {exc!r}")
        return True
    if res.actions:
        logger.info(f"pdroles: {'; '.join(res.actions)}")
    for target, reason, message in res.role_events:
        # A PDRole as the event API references it (kind, name, namespace, uid).
        kopf.warn(kopf.Body(cast(kopf.RawBody, target)), reason=reason, message=message)
    for reason, message in res.cluster_events:
        kopf.warn(body, reason=reason, message=message)
    return res.again


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, id="cleanup")
async def cleanup(name: str, namespace: str | None, uid: str, logger: kopf.Logger, **kwargs: Any) -> None:
    """Delete the children now (the garbage collector would too, later) and free the ledger."""
    agent_pods: AgentPodIndex = kwargs["agent_pods"]  # an index, passed by name (see reconcile_daemon)
    ref = ClusterRef(_namespaced(namespace), name, uid)
    pods = list(agent_pods.get(uid, []))
    kube = STATE.get_kube()

    def _delete() -> None:
        for p in pods:
            kube.delete("Pod", p.namespace, p.name, uid=p.uid)
        # Ours only: a user's object that happens to carry a child's name stays.
        delete_owned_children(kube, ref, [p.name for p in pods])
        delete_owned_roles(kube, ref)

    await asyncio.to_thread(_delete)
    with LEDGER.lock:  # reconciles of other clusters may be planning in worker threads
        LEDGER.forget(uid)
    STATE.memory.pop(uid, None)
    STATE.generations.pop(uid, None)
    logger.info(f"deleted {len(pods)} agent pods and the shared children")


def run() -> None:
    """Console entry point `pdfabric-operator`: all namespaces, liveness on :8081/healthz."""
    import os

    kopf.configure(verbose=bool(os.environ.get("PDFABRIC_VERBOSE")))
    kopf.run(
        clusterwide=True,
        liveness_endpoint=os.environ.get("PDFABRIC_LIVENESS", "http://0.0.0.0:8081/healthz"),
    )
