"""The per-role scaling adapter: a PDRole per (PDCluster, role) behind the Kubernetes scale API.

A CRD's scale subresource carries one replicas path, and a PDCluster has two (prefill and decode),
so each role gets its own small object, `<cluster>-prefill` and `<cluster>-decode`, that
`kubectl scale`, an HPA or KEDA drive (docs/scaling.md). The PDCluster stays the one truth: the
PDRole's spec.replicas is carried into the PDCluster's spec.<role>.replicas, and a direct edit of
the PDCluster is carried back. `decide` says which way from three numbers: the two replicas and
the value both last agreed on (an annotation on the PDRole). Whichever moved since is the last
writer; when both moved between two looks, the PDCluster wins (an HPA asks again at its next sync).

Every write is decided again on freshly read objects and carries their resourceVersion, so a
decision made on a lagging watch cache never overwrites a newer value: the write fails with 409
and the next reconcile looks again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import ClusterRef, labels_for
from pdfabric_operator.kube import Kube, Refused, server_message
from pdfabric_operator.role_status import Refusal, role_status, status_patch

ROLES = ("prefill", "decode")
_MERGE = "application/merge-patch+json"
_FIELD_MANAGER = [("fieldManager", "pdfabric-operator")]

# --- pure: names, the sync decision, the desired objects ----------------------------------------


def role_name(cluster: str, role: str) -> str:
    return f"{cluster}-{role}"


@dataclass(frozen=True)
class SyncDecision:
    """What one sync of a role writes; None: leave it."""

    to_cluster: int | None = None  # the PDCluster's spec.<role>.replicas
    to_role: int | None = None  # the PDRole's spec.replicas
    record: int | None = None  # the PDRole's synced-replicas annotation

    @property
    def writes(self) -> bool:
        return self.to_cluster is not None or self.to_role is not None or self.record is not None


def decide(
    cluster: int, role: int, synced: int | None, refused: Refusal | None, cluster_generation: int
) -> SyncDecision:
    """Which way to carry the replicas of one role.

    `cluster`: the PDCluster's spec.<role>.replicas; `role`: the PDRole's spec.replicas; `synced`:
    the value both last agreed on (None: never recorded, e.g. a PDRole just made or its annotation
    removed); `refused`: the PDCluster's last refusal of a scale of this role.
    """
    if role == cluster:
        return SyncDecision(record=None if synced == cluster else cluster)
    role_moved = synced is None or role != synced
    cluster_moved = synced is None or cluster != synced
    if role_moved and not cluster_moved:
        # Scaled through the PDRole (kubectl scale, an HPA, KEDA): into the PDCluster, unless the
        # PDCluster refused exactly this and has not changed since (no request per reconcile).
        if refused == Refusal(role, cluster_generation):
            return SyncDecision()
        return SyncDecision(to_cluster=role, record=role)
    # The PDCluster was edited (or both moved, or nothing was recorded): the PDCluster wins.
    return SyncDecision(to_role=cluster, record=cluster)


def role_selector(cluster_uid: str, role: str, engines: bool) -> str:
    """The node pods that serve `role`, as the label selector string of the scale subresource.

    With spec.engine, the pods running engines of the role (builders/agent_pod.py labels them). Without it
    the node pods carry no role label (and an intra-node NVLink group's pod holds ranks of both
    roles): the truthful answer is every agent pod of the PDCluster, a superset of the role's.
    """
    base = f"{c.LABEL_CLUSTER_UID}={cluster_uid}"
    if engines:
        return f"{base},{c.LABEL_SERVES[role]}=true"
    return f"{base},{c.LABEL_COMPONENT}={c.COMPONENT_AGENT}"


def cluster_replicas(spec: Mapping[str, Any], role: str) -> int:
    """spec.<role>.replicas as stored (the API server defaults it to 1)."""
    return int((spec.get(role) or {}).get("replicas", 1))


def build_role(ref: ClusterRef, role: str, replicas: int) -> dict[str, Any]:
    """A new PDRole: the PDCluster's replicas, recorded as synced, owned by the PDCluster."""
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.ROLE_KIND,
        "metadata": {
            "name": role_name(ref.name, role),
            "namespace": ref.namespace,
            "labels": labels_for(ref, **{c.LABEL_ROLE: role}),
            "annotations": {c.ANN_SYNCED_REPLICAS: str(replicas)},
            "ownerReferences": [ref.owner_reference()],
        },
        "spec": {"cluster": ref.name, "role": role, "replicas": replicas},
    }


# --- what the watch cache holds of a PDRole ------------------------------------------------------


@dataclass(frozen=True)
class RoleView:
    """A PDRole as the index holds it."""

    namespace: str
    name: str
    uid: str
    owner_uid: str | None  # its controller's uid (ours: the PDCluster's)
    replicas: int
    synced: int | None
    generation: int
    deleting: bool
    status: Mapping[str, Any] = field(default_factory=dict)

    @property
    def refused(self) -> Refusal | None:
        got = self.status.get("refused") or {}
        if "replicas" not in got or "clusterGeneration" not in got:
            return None
        return Refusal(int(got["replicas"]), int(got["clusterGeneration"]))


def made_as_is(view: RoleView) -> bool:
    """The PDRole as its cluster's reconcile made it: never scaled (generation 1), its replicas
    the ones recorded as synced, no status written yet."""
    return view.generation == 1 and view.replicas == view.synced and not view.status


def _int_or_none(text: Any) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def role_view(obj: Mapping[str, Any]) -> RoleView:
    meta = obj.get("metadata") or {}
    controller = [o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("controller")]
    return RoleView(
        namespace=meta.get("namespace") or "",
        name=meta.get("name") or "",
        uid=meta.get("uid") or "",
        owner_uid=controller[0] if controller else None,
        replicas=int((obj.get("spec") or {}).get("replicas") or 0),
        synced=_int_or_none((meta.get("annotations") or {}).get(c.ANN_SYNCED_REPLICAS)),
        generation=int(meta.get("generation") or 0),
        deleting=bool(meta.get("deletionTimestamp")),
        status=dict(obj.get("status") or {}),
    )


# --- I/O: one sync of both roles of one PDCluster -------------------------------------------------


@dataclass
class RolesMemory:
    """What one PDCluster's role syncs remember between runs (lost on restart, by design)."""

    reported: set[str] = field(default_factory=set)  # PDRole names we may not make, reported once


@dataclass
class RolesResult:
    actions: list[str] = field(default_factory=list)
    # Warning Events on a PDRole: (its apiVersion/kind/metadata, reason, message).
    role_events: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)
    # Warning Events on the PDCluster: (reason, message).
    cluster_events: list[tuple[str, str]] = field(default_factory=list)
    # A write met a newer object (409): look again soon. A status write to the PDCluster changes its
    # resourceVersion and wakes nobody, so waiting for an event could mean a full interval.
    again: bool = False


def _patch(kube: Kube, kind: str, namespace: str, name: str, body: dict[str, Any], *, sub: str = "") -> dict[str, Any]:
    path = Kube.path(kind, namespace, name) + sub
    return kube.request("patch", path, body, content_type=_MERGE, query=_FIELD_MANAGER) or {}


def _event_target(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.ROLE_KIND,
        "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid")},
    }


def sync_roles(
    kube: Kube,
    ref: ClusterRef,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int,
    roles: Mapping[str, RoleView],
    memory: RolesMemory,
) -> RolesResult:
    """Make both PDRoles exist and agree with the PDCluster (`spec`, `status`, `generation` as the
    watch cache holds them; `roles`: PDRole name -> view, from the index)."""
    out = RolesResult()
    for role in ROLES:
        name = role_name(ref.name, role)
        view = roles.get(name)
        if view is None:
            try:
                if kube.create(build_role(ref, role, cluster_replicas(spec, role))):
                    out.actions.append(f"create pdrole {name}")
                    memory.reported.discard(name)
            except Refused as exc:  # e.g. a name too long for the API server
                if name not in memory.reported:
                    memory.reported.add(name)
                    out.cluster_events.append(("PDRoleRefused", f"PDRole {name} cannot be made: {exc.message}"))
            continue  # made now (its status follows), or someone's namesake the cache lacks yet
        if view.owner_uid != ref.uid:
            if name not in memory.reported:  # a user's own: never taken over, reported once
                memory.reported.add(name)
                out.cluster_events.append(
                    (
                        "PDRoleNotOwned",
                        f"PDRole {name} exists and is not this PDCluster's: the {role} role cannot be "
                        "scaled through it; delete it and the operator makes its own",
                    )
                )
            continue
        memory.reported.discard(name)
        if not view.deleting:  # else made anew once it is gone
            _sync_one(kube, ref, role, spec, status, generation, view, out)
    return out


def _sync_one(
    kube: Kube,
    ref: ClusterRef,
    role: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int,
    view: RoleView,
    out: RolesResult,
) -> None:
    decision = decide(cluster_replicas(spec, role), view.replicas, view.synced, view.refused, generation)
    if decision.writes:
        # Decide again on what the API server holds now, and write only over that.
        fresh_cluster = kube.get("PDCluster", ref.namespace, ref.name)
        fresh_role = kube.get("PDRole", ref.namespace, view.name)
        if fresh_cluster is None or fresh_role is None or fresh_cluster["metadata"].get("uid") != ref.uid:
            return
        view = role_view(fresh_role)
        if view.owner_uid != ref.uid or view.deleting:
            return
        spec, generation = fresh_cluster.get("spec") or {}, int(fresh_cluster["metadata"].get("generation") or 0)
        try:
            view, spec = _write(kube, ref, role, fresh_cluster, fresh_role, view, generation, out)
        except ApiException as exc:
            if exc.status != 409:
                raise
            out.again = True  # changed meanwhile: decide again on the newer object
            return
    desired = role_status(
        role=role,
        cluster=ref.name,
        cluster_replicas=cluster_replicas(spec, role),
        role_replicas=view.replicas,
        ready=int((status.get(role) or {}).get("ready") or 0),
        selector=role_selector(ref.uid, role, spec.get("engine") is not None),
        generation=view.generation,
        refused=view.refused,
        refused_message=str((view.status.get("refused") or {}).get("message") or ""),
        placed=_int_or_none((status.get(role) or {}).get("placed")),
        unplaced=status.get("unplaced"),
    )
    patch = status_patch(desired, view.status, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if patch is not None:
        _patch(kube, "PDRole", ref.namespace, view.name, {"status": patch}, sub="/status")


def _write(
    kube: Kube,
    ref: ClusterRef,
    role: str,
    cluster: dict[str, Any],
    role_obj: dict[str, Any],
    view: RoleView,
    generation: int,
    out: RolesResult,
) -> tuple[RoleView, Mapping[str, Any]]:
    """Carry the replicas the way `decide` says on freshly read objects, each write conditional on
    the resourceVersion read; returns the PDRole and the PDCluster's spec as they stand after."""
    spec: Mapping[str, Any] = cluster.get("spec") or {}
    decision = decide(cluster_replicas(spec, role), view.replicas, view.synced, view.refused, generation)
    if decision.to_cluster is not None:
        body = {
            "metadata": {"resourceVersion": cluster["metadata"]["resourceVersion"]},
            "spec": {role: {"replicas": decision.to_cluster}},
        }
        try:
            written = _patch(kube, "PDCluster", ref.namespace, ref.name, body)
        except ApiException as exc:
            if exc.status not in (400, 403, 422):  # validation, admission: the server's no
                raise
            message = f"PDCluster {ref.name} refused {role} replicas {view.replicas}: {server_message(exc)}"
            out.role_events.append((_event_target(role_obj), "ScaleRefused", message))
            out.actions.append(f"pdcluster {ref.name} refused {role} replicas {view.replicas}")
            refusal = {"replicas": view.replicas, "clusterGeneration": generation, "message": message}
            return dataclasses.replace(view, status={**view.status, "refused": refusal}), spec
        out.actions.append(f"scale {role} of pdcluster {ref.name} to {decision.to_cluster} (pdrole {view.name})")
        spec = written.get("spec") or {}
    if decision.to_role is None and decision.record is None:
        return view, spec
    meta: dict[str, Any] = {"resourceVersion": role_obj["metadata"]["resourceVersion"]}
    if decision.record is not None:
        meta["annotations"] = {c.ANN_SYNCED_REPLICAS: str(decision.record)}
    role_body: dict[str, Any] = {"metadata": meta}
    if decision.to_role is not None:
        role_body["spec"] = {"replicas": decision.to_role}
        out.actions.append(f"set pdrole {view.name} to {decision.to_role} (the pdcluster's {role} replicas)")
    return role_view(_patch(kube, "PDRole", ref.namespace, view.name, role_body)), spec


def delete_owned_roles(kube: Kube, ref: ClusterRef) -> list[str]:
    """Delete the PDCluster's PDRoles, each only if this PDCluster owns it (a user's own object of
    that name stays); the uid precondition keeps a namesake made between the read and the delete."""
    actions = []
    for role in ROLES:
        name = role_name(ref.name, role)
        have = kube.get("PDRole", ref.namespace, name)
        if have is None or role_view(have).owner_uid != ref.uid:
            continue
        if kube.delete("PDRole", ref.namespace, name, uid=have["metadata"].get("uid")):
            actions.append(f"delete pdrole {name}")
    return actions
