"""Step 3's shared children of a PDCluster, applied: the rank-map ConfigMap, the engine-token and
peer-CA Secrets, the headless Service, the NetworkPolicy, the engines' Services, the node pods'
PodDisruptionBudgets and spec.router's Deployment and Service; each created when missing, replaced when it differs, and deleted only when
this PDCluster owns it (the names are deterministic, so a user's namesake is left alone)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator import constants as c
from pdfabric_operator.bookkeeping import ClusterMemory, Result
from pdfabric_operator.builders.credentials import build_engine_token_secret, keypair_from_secret
from pdfabric_operator.builders.disruption import build_disruption_budgets
from pdfabric_operator.builders.names import (
    DISRUPTION_BUDGETS,
    ClusterRef,
    ca_secret_name,
    disruption_budget_name,
    engine_service_name,
    engine_token_secret_name,
    network_policy_name,
    peer_tls_secret_name,
    router_name,
    service_name,
    shared_children,
)
from pdfabric_operator.builders.rankmap import build_rankmap_configmap
from pdfabric_operator.builders.router import build_router_deployment, build_router_service
from pdfabric_operator.builders.services import build_engine_service, build_headless_service
from pdfabric_operator.kube import Kube
from pdfabric_operator.peer_certs import cluster_ca
from pdfabric_operator.placement import Placement
from pdfabric_operator.snapshot import OwnPod


def ensure_shared_children(
    kube: Kube,
    ref: ClusterRef,
    spec: PDClusterSpec,
    rankmap: RankMap,
    policy: dict[str, Any] | None,
    memory: ClusterMemory,
    recheck_after: float,
    out: Result,
    *,
    new: bool = False,
) -> None:
    """`policy`: the NetworkPolicy wanted, None when the operator's settings turn it off (one
    built before is deleted then); one that differs (the monitoring namespace changed) is replaced.
    `new`: the cluster was never reconciled, so its children are created without reading them
    first; one that is there all the same (409) is read and compared as usual."""
    cm = build_rankmap_configmap(ref, rankmap)
    want_hash = cm["metadata"]["annotations"][c.ANN_RANKMAP_HASH]
    fresh = time.monotonic() - memory.children_checked_at < recheck_after
    if fresh and memory.last_rankmap_hash == want_hash:
        return
    ns = ref.namespace

    def stored(kind: str, name: str) -> dict[str, Any] | None:
        return None if new else kube.get(kind, ns, name)

    token = engine_token_secret_name(ref.name)
    if stored("Secret", token) is None and kube.create(build_engine_token_secret(ref, secrets.token_urlsafe(32))):
        out.actions.append("create engine-token secret")
    ca_secret = stored("Secret", ca_secret_name(ref.name))
    if ca_secret is None:
        memory.ca = None  # gone (or never made): made anew, and remembered
        cluster_ca(kube, ref, memory, new=new)
        out.actions.append("create peer CA secret")
    else:
        memory.ca = keypair_from_secret(ca_secret)
    if stored("Service", service_name(ref.name)) is None and kube.create(build_headless_service(ref, spec)):
        out.actions.append("create service")
    have_policy = stored("NetworkPolicy", network_policy_name(ref.name))
    if policy is not None and have_policy is None:
        if kube.create(policy):
            out.actions.append("create networkpolicy")
        else:  # there already: compared below
            have_policy = kube.get("NetworkPolicy", ns, network_policy_name(ref.name))
    # Only this cluster's own policy is replaced or deleted, never a namesake someone else made.
    owned = have_policy is not None and owned_by(have_policy, ref.uid)
    if policy is None:
        if owned and kube.delete("NetworkPolicy", ns, network_policy_name(ref.name)):
            out.actions.append("delete networkpolicy (turned off)")
    elif owned and have_policy is not None and have_policy.get("spec") != policy["spec"]:
        kube.replace(policy, have_policy["metadata"]["resourceVersion"])
        out.actions.append("update networkpolicy")
    have = stored("ConfigMap", cm["metadata"]["name"])
    if have is None and kube.create(cm):
        out.actions.append("create configmap")
    elif (have := have or kube.get("ConfigMap", ns, cm["metadata"]["name"])) is None:
        pass  # created and deleted again meanwhile: the next reconcile makes it
    elif (have["metadata"].get("annotations") or {}).get(c.ANN_RANKMAP_HASH) != want_hash:
        kube.replace(cm, have["metadata"]["resourceVersion"])
        out.actions.append("update configmap")
    elif have.get("data") != cm["data"]:
        # Written over by someone else (its hash annotation kept): the agents refuse a map that does
        # not parse and keep theirs (runtime/inputs.py), a new pod would start on it; put it back.
        kube.replace(cm, have["metadata"]["resourceVersion"])
        out.actions.append("restore configmap (its data was not the rank map)")
    memory.children_checked_at = time.monotonic()
    memory.last_rankmap_hash = want_hash


def service_ports(svc: Mapping[str, Any]) -> list[tuple[str, int, str]]:
    return [(p.get("name", ""), p.get("port", 0), str(p.get("targetPort", ""))) for p in svc["spec"].get("ports") or []]


def ensure_engine_services(
    kube: Kube, ref: ClusterRef, spec: PDClusterSpec, placement: Placement, out: Result, *, new: bool = False
) -> None:
    """The per-role Services of the engines: created, updated when their ports change (a node
    got a second engine of a role), deleted when spec.engine goes (only ours, never a namesake).
    `new`: never reconciled, so none of ours can exist: created without a read, none looked for."""
    for role in Role:
        _sync_owned(
            kube, ref, "Service", engine_service_name(ref.name, role.value),
            build_engine_service(ref, spec, placement, role), out, new=new, word="service", gone=" (no engines)",
            differs=lambda have, want: service_ports(have) != service_ports(want)
            or have["spec"].get("selector") != want["spec"]["selector"],
            merged=lambda have, want: dict(
                want, spec={**have["spec"], "ports": want["spec"]["ports"], "selector": want["spec"]["selector"]}
            ),
        )  # fmt: skip


def _sync_owned(
    kube: Kube,
    ref: ClusterRef,
    kind: str,
    name: str,
    want: dict[str, Any] | None,
    out: Result,
    *,
    new: bool,
    word: str,
    differs: Callable[[Mapping[str, Any], Mapping[str, Any]], bool],
    merged: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]],
    gone: str = "",
) -> None:
    """One child of a deterministic name: created when wanted and missing, replaced by `merged`
    when it `differs`, deleted when no longer wanted; only ours is replaced or deleted (a user's
    namesake is left alone). `new`: never reconciled, so created without a read first."""
    if new and want is None:
        return
    have = None if new else kube.get(kind, ref.namespace, name)
    if want is not None and have is None:
        if kube.create(want):
            out.actions.append(f"create {word} {name}")
            return
        have = kube.get(kind, ref.namespace, name)  # there already: compared below
    if have is None or not owned_by(have, ref.uid):
        return
    if want is None:
        if kube.delete(kind, ref.namespace, name, uid=have["metadata"].get("uid")):
            out.actions.append(f"delete {word} {name}{gone}")
    elif differs(have, want):
        kube.replace(merged(have, want), have["metadata"]["resourceVersion"])
        out.actions.append(f"update {word} {name}")


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def ensure_disruption_budgets(
    kube: Kube, ref: ClusterRef, spec: PDClusterSpec, placement: Placement, out: Result, *, new: bool = False
) -> None:
    """The node pods' PodDisruptionBudgets (builders/disruption.py): created, updated when the
    spec's maxUnavailable or the pods change, deleted when no pod falls in one any more (only ours)."""
    wanted = build_disruption_budgets(ref, spec, placement)
    for budget in DISRUPTION_BUDGETS:
        name = disruption_budget_name(ref.name, budget)
        _sync_owned(
            kube, ref, "PodDisruptionBudget", name, wanted.get(name), out, new=new, word="pdb",
            differs=lambda have, want: {k: have["spec"].get(k) for k in want["spec"]} != want["spec"],
            merged=lambda have, want: {**want, "spec": {**have["spec"], **want["spec"]}},
        )  # fmt: skip


def ensure_budget_labels(kube: Kube, own: Sequence[OwnPod], desired: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Label each running pod with the budget that counts it, in place (a pod made by an operator
    before budgets, or whose budget changed, is not restarted for it)."""
    actions = []
    for p in own:
        want = desired.get(p.name)
        budget = (want or {}).get("metadata", {}).get("labels", {}).get(c.LABEL_DISRUPTION_BUDGET)
        stale = budget and not p.deleting and p.budget != budget
        if stale and kube.annotate("Pod", p.namespace, p.name, p.uid, {c.LABEL_DISRUPTION_BUDGET: budget}, labels=True):
            actions.append(f"label pod {p.name} for pdb {budget}")
    return actions


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
        if have is None or not owned_by(have, ref.uid):
            continue
        if kube.delete(kind, ref.namespace, name, uid=have["metadata"].get("uid")):
            actions.append(f"delete {kind} {name}")
    return actions


def ensure_router(
    kube: Kube,
    ref: ClusterRef,
    spec: PDClusterSpec,
    placement: Placement,
    memory: ClusterMemory,
    out: Result,
    *,
    new: bool = False,
) -> Mapping[str, Any] | None:
    """spec.router's Deployment and Service: created, the Deployment replaced when what it was
    built from differs (the engines moved, spec.router changed: it rolls with a surge), both
    deleted when spec.router goes (ours only, never a namesake). Returns the Deployment as read,
    for its readiness in the status; read on every reconcile only while spec.router is set.
    `new`: never reconciled, so none of ours can exist: created without a read, none looked for."""
    name, ns = router_name(ref.name), ref.namespace
    want = build_router_deployment(ref, spec, placement)
    if want is None:
        if memory.router_absent or new:
            memory.router_absent = True
            return None
        for kind in ("Deployment", "Service"):
            have = kube.get(kind, ns, name)
            if have is not None and owned_by(have, ref.uid) and kube.delete(kind, ns, name):
                out.actions.append(f"delete {kind.lower()} {name} (no router)")
        memory.router_absent = True
        return None
    memory.router_absent = False
    have = None if new else kube.get("Deployment", ns, name)
    if have is None:
        if kube.create(want):
            out.actions.append(f"create deployment {name}")
        else:
            have = kube.get("Deployment", ns, name)  # there already: compared below
    if have is not None and owned_by(have, ref.uid):
        have_hash = (have["metadata"].get("annotations") or {}).get(c.ANN_ROUTER_HASH)
        if have_hash != want["metadata"]["annotations"][c.ANN_ROUTER_HASH]:
            kube.replace(want, have["metadata"]["resourceVersion"])
            out.actions.append(f"update deployment {name}")
    svc = build_router_service(ref, spec)
    assert svc is not None
    have_svc = None if new else kube.get("Service", ns, name)
    if have_svc is None:
        if kube.create(svc):
            out.actions.append(f"create service {name}")
            return have
        have_svc = kube.get("Service", ns, name)
    if have_svc is not None and owned_by(have_svc, ref.uid) and service_ports(have_svc) != service_ports(svc):
        kube.replace(
            dict(svc, spec={**have_svc["spec"], "ports": svc["spec"]["ports"]}), have_svc["metadata"]["resourceVersion"]
        )
        out.actions.append(f"update service {name}")
    return have
