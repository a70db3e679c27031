"""One PDCluster's reconcile loop, as its kopf daemon runs it: on each wake-up (or every
PDFABRIC_RECONCILE_INTERVAL) sync its PDRoles, snapshot the watch caches on the event loop, add
what the agents said in their /readyz, run reconcile_once in a worker thread, and record the
outcome (metrics, one Event per new problem). main.py registers the daemon; this is its body."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from datetime import UTC, datetime
from typing import cast

import kopf

from pdfabric_core.spec import SpecError, parse_spec
from pdfabric_operator.agentstate import AgentAddress, AgentReport, heard, read_agents, read_reports
from pdfabric_operator.bookkeeping import ClusterMemory
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.kube import error_type
from pdfabric_operator.metrics import (
    CLUSTERS,
    ERRORS,
    PDCLUSTER_PLACED,
    PDCLUSTER_READY,
    PDCLUSTER_UNPLACED,
    RECONCILE_CAUSES,
    RECONCILE_DURATION,
    RECONCILES,
    ReconcileResult,
    WakeCause,
)
from pdfabric_operator.operator_state import STATE
from pdfabric_operator.placement import GpuNode, PlacedPod
from pdfabric_operator.reconcile import reconcile_once
from pdfabric_operator.roles import ROLES, RolesMemory, RoleView, role_name, sync_roles
from pdfabric_operator.snapshot import OwnPod, Snapshot

NodeIndex = kopf.Index[str, GpuNode]
GpuPodIndex = kopf.Index[str, PlacedPod]
AgentPodIndex = kopf.Index[str, OwnPod]
RoleIndex = kopf.Index[tuple[str, str], RoleView]


def take_snapshot(gpu_nodes: NodeIndex, gpu_pods: GpuPodIndex, agent_pods: AgentPodIndex, uid: str) -> Snapshot:
    # Runs on the event loop: the indices are only mutated there, so copying here is race-free.
    return Snapshot(
        nodes=[n for store in gpu_nodes.values() for n in store],
        placed=[p for store in gpu_pods.values() for p in store],
        own=list(agent_pods.get(uid, [])),
    )


async def with_agents(snap: Snapshot, body: kopf.Body, uid: str) -> Snapshot:
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
            reads = await read_agents(live, port, STATE.config.agent_addresses)
            reports = heard((p.uid for p in live), reads, said, STATE.silences.setdefault(uid, {}))
            said.clear()
            said.update(reports)
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


async def reconcile_loop(
    body: kopf.Body,
    ref: ClusterRef,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    gpu_nodes: NodeIndex,
    gpu_pods: GpuPodIndex,
    agent_pods: AgentPodIndex,
    pd_roles: RoleIndex,
) -> None:
    """Reconcile the PDCluster until its daemon is stopped (deleted, or another replica took over)."""
    uid = ref.uid
    wake = STATE.wakers.setdefault(uid, asyncio.Event())
    memory = STATE.memory.setdefault(uid, ClusterMemory())
    roles_memory = STATE.roles.setdefault(uid, RolesMemory())
    CLUSTERS.set(len(STATE.wakers))
    last_problem: tuple[str, str] | None = None
    causes = {WakeCause.SPEC}  # the first reconcile: the PDCluster is new to this operator
    try:
        while not stopped:
            wake.clear()
            for cause in causes | STATE.take_causes(uid):
                RECONCILE_CAUSES.labels(cause.value).inc()
            if body.get("metadata", {}).get("deletionTimestamp"):
                return
            generation = body.get("metadata", {}).get("generation", 0)
            STATE.generations[uid] = generation
            roles_again = await sync_pdroles(body, ref, generation, pd_roles, roles_memory, logger)
            snap = await with_agents(take_snapshot(gpu_nodes, gpu_pods, agent_pods, uid), body, uid)
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
                    recheck_children_after=_period(uid in STATE.satisfied, body)[0] / 2,
                    stored_rv=body.get("metadata", {}).get("resourceVersion"),
                    network_policy=STATE.config.network_policy,
                    monitoring_namespace=STATE.config.monitoring_namespace,
                    operator_namespace=STATE.config.namespace,
                    cert_valid_for=STATE.config.peer_cert_validity,
                    group_bind_timeout=STATE.config.group_bind_timeout,
                )
                RECONCILES.labels(res.result.value).inc()
                if res.satisfied:
                    STATE.satisfied.add(uid)
                else:
                    STATE.satisfied.discard(uid)
                PDCLUSTER_READY.labels(ref.namespace, ref.name).set(res.ready)
                PDCLUSTER_PLACED.labels(ref.namespace, ref.name).set(res.placed)
                for role in ("prefill", "decode"):
                    PDCLUSTER_UNPLACED.labels(ref.namespace, ref.name, role).set(res.unplaced.get(role, 0))
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
                STATE.satisfied.discard(uid)
                ERRORS.labels(error_type(exc).value).inc()
                memory.last_status = None  # re-read the stored status next time
                logger.warning(f"reconcile failed, retrying: {exc!r}")
                STATE.wake(uid, WakeCause.RETRY)
                await asyncio.sleep(1.0)
            finally:
                RECONCILE_DURATION.observe(time.monotonic() - started)
                STATE.last_reconcile = time.monotonic()
            # Coalesce bursts of events (a pod creation emits several) into one reconcile.
            await asyncio.sleep(0.05)
            # While agents move to a new rank map, look again soon: their word is the status'.
            interval, timer = _period(uid in STATE.satisfied, body, min(memory.cert_renew_at.values(), default=None))
            if not memory.membership_settled and interval > UNSETTLED_RECHECK_S:
                interval, timer = UNSETTLED_RECHECK_S, WakeCause.UNSETTLED
            if roles_again:  # a second's pause: a persistent failure must not spin the loop
                await asyncio.sleep(1.0)
                STATE.wake(uid, WakeCause.RETRY)
            causes = set()
            try:
                await asyncio.wait_for(wake.wait(), timeout=interval)
            except TimeoutError:
                causes = {timer}
    finally:
        STATE.wakers.pop(uid, None)
        STATE.causes.pop(uid, None)
        STATE.satisfied.discard(uid)
        STATE.transports.pop(uid, None)
        STATE.reports.pop(uid, None)
        STATE.silences.pop(uid, None)
        STATE.roles.pop(uid, None)
        CLUSTERS.set(len(STATE.wakers))
        for gauge in (PDCLUSTER_READY, PDCLUSTER_PLACED):  # gone, or reconciled by another replica now
            with contextlib.suppress(KeyError):
                gauge.remove(ref.namespace, ref.name)
        for role in ("prefill", "decode"):
            with contextlib.suppress(KeyError):
                PDCLUSTER_UNPLACED.remove(ref.namespace, ref.name, role)


def _period(satisfied: bool, body: kopf.Body, cert_due: datetime | None = None) -> tuple[float, WakeCause]:
    """How long a PDCluster waits for an event before it reconciles anyway. A satisfied one without
    engines waits PDFABRIC_RESYNC_INTERVAL (every change that matters to it is watched: its spec,
    PDRoles, pods and their nodes), or until its first peer certificate is due; the rest wait
    PDFABRIC_RECONCILE_INTERVAL (engines are read from the agents' /readyz, not watched)."""
    config = STATE.config
    if not satisfied or (body.get("spec") or {}).get("engine") is not None:
        return config.reconcile_interval, WakeCause.INTERVAL
    if cert_due is not None:
        until_due = max(1.0, (cert_due - datetime.now(UTC)).total_seconds())
        if until_due < config.resync_interval:
            return until_due, WakeCause.CERTIFICATE
    return config.resync_interval, WakeCause.RESYNC


async def sync_pdroles(
    body: kopf.Body, ref: ClusterRef, generation: int, pd_roles: RoleIndex, memory: RolesMemory, logger: kopf.Logger
) -> bool:
    """The PDCluster's PDRoles (roles.py) made and in agreement with it; never in the way of the
    reconcile that follows. True when it should run again soon (a failure, a write conflict)."""
    # Copied on the event loop, where the index is mutated (see take_snapshot).
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
