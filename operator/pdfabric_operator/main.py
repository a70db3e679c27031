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

import time
from typing import Any

import kopf

from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.cleanup import clean_up
from pdfabric_operator.indices import node_from_body, own_pod_from_body, placed_pod_from_body
from pdfabric_operator.metrics import WakeCause
from pdfabric_operator.operator_state import STATE
from pdfabric_operator.placement import GpuNode, PlacedPod
from pdfabric_operator.reconcile_loop import AgentPodIndex, GpuPodIndex, reconcile_loop
from pdfabric_operator.roles import RoleView, made_as_is, role_view
from pdfabric_operator.snapshot import OwnPod
from pdfabric_operator.startup import configure_operator, connection_info

# --- startup, login, probes --------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    configure_operator(settings, logger)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf and the reconciler use the same credentials (in-cluster, else $KUBECONFIG)."""
    return connection_info()


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


@kopf.index("nodes")
def gpu_nodes(name: str, labels: Any, spec: Any, status: Any, meta: Any, **_: Any) -> dict[str, GpuNode]:
    return {name: node_from_body(name, labels, spec, status, meta)}


@kopf.index("pods")
def gpu_pods(spec: Any, status: Any, labels: Any, annotations: Any, **_: Any) -> dict[str, PlacedPod] | None:
    pod = placed_pod_from_body(spec, status, labels, annotations)
    return None if pod is None else {pod.node: pod}


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
    return {
        labels[c.LABEL_CLUSTER_UID]: own_pod_from_body(
            name, _namespaced(namespace), uid, spec, status, meta, annotations
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
        STATE.wake(uid, WakeCause.SPEC)


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
        if made_as_is(view) and view.owner_uid not in STATE.satisfied:
            # Just made by its cluster's reconcile, nothing to carry back; the cluster is still
            # coming up (its pods' events wake it, its timer is the short one), and that
            # reconcile writes the PDRole's status. A satisfied cluster's (a PDRole deleted and
            # made again) is woken: nothing else would write its status before the resync.
            return
    STATE.wake(view.owner_uid, WakeCause.PDROLE)


@kopf.on.event("pods", labels={c.LABEL_CLUSTER_UID: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY})
def agent_pod_changed(
    type: str | None,
    name: str,
    namespace: str | None,
    uid: str,
    spec: Any,
    status: Any,
    labels: Any,
    meta: Any,
    annotations: Any,
    **_: Any,
) -> None:
    # An agent pod wakes its cluster when what the reconcile reads of it changed (its OwnPod), or
    # it went; the router's pods on every event (the reconcile reads their Deployment's readiness).
    if labels.get(c.LABEL_COMPONENT) == c.COMPONENT_AGENT:
        gone = type == "DELETED"
        view = None if gone else own_pod_from_body(name, _namespaced(namespace), uid, spec, status, meta, annotations)
        if not STATE.agent_pod_changed(uid, view):
            return
    STATE.wake(labels.get(c.LABEL_CLUSTER_UID), WakeCause.POD)


@kopf.on.event("nodes")
def node_changed(name: str, type: str | None, body: Any, **kwargs: Any) -> None:
    gpu_pods: GpuPodIndex = kwargs["gpu_pods"]  # an index, passed by name (see reconcile_daemon)
    users = {p.owner_uid for p in gpu_pods.get(name, []) if p.owner_uid}
    if type == "DELETED":
        STATE.node_prints.pop(name, None)
        STATE.wake_for_node(users)
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
        STATE.wake_for_node(users)


# --- the reconcile loop ------------------------------------------------------------------------


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
    await reconcile_loop(
        body,
        ClusterRef(_namespaced(namespace), name, uid),
        stopped,
        logger,
        gpu_nodes=kwargs["gpu_nodes"],
        gpu_pods=kwargs["gpu_pods"],
        agent_pods=kwargs["agent_pods"],
        pd_roles=kwargs["pd_roles"],
    )


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, id="cleanup")
async def cleanup(name: str, namespace: str | None, uid: str, logger: kopf.Logger, **kwargs: Any) -> None:
    """Delete the children now (the garbage collector would too, later) and free the ledger."""
    agent_pods: AgentPodIndex = kwargs["agent_pods"]  # an index, passed by name (see reconcile_daemon)
    ref = ClusterRef(_namespaced(namespace), name, uid)
    await clean_up(ref, list(agent_pods.get(uid, [])), logger)


def run() -> None:
    """Console entry point `pdfabric-operator`: all namespaces, liveness on :8081/healthz."""
    import os

    kopf.configure(verbose=bool(os.environ.get("PDFABRIC_VERBOSE")))
    kopf.run(
        clusterwide=True,
        liveness_endpoint=os.environ.get("PDFABRIC_LIVENESS", "http://0.0.0.0:8081/healthz"),
    )
