"""The owning PDCluster (``ClusterRef``) and every child's name, labels and metadata: deterministic
functions of the cluster (and unit and node), so a reconcile run again finds what it made."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_operator import constants as c


@dataclass(frozen=True)
class ClusterRef:
    """Identity of the owning PDCluster."""

    namespace: str
    name: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def short_hash(text: str, n: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def dns_label(text: str, limit: int) -> str:
    text = re.sub(r"[^a-z0-9-]", "-", text.lower())[:limit]
    return text.strip("-") or "x"


def agent_name(cluster: str, unit: str, node: str) -> str:
    """Pod name and hostname of the agent of placement unit `unit` (prefill-0, decode-2, group-1)
    of `cluster` on `node`: a DNS label (<= 63), unique per (unit, node), which a replica spread
    over several nodes needs.

    The hash keeps names distinct when truncation would make two units collide, and gives a unit
    moved to another node a new name (its old pod may still be terminating).
    """
    return f"{dns_label(f'{cluster}-{unit}', 55)}-{short_hash(f'{unit}@{node}')}"


def rankmap_name(cluster: str) -> str:
    return f"{cluster}-rankmap"


def engine_token_secret_name(cluster: str) -> str:
    """The engine door's token: mounted into the agent pods (the agent hands its path to the engines it runs)."""
    return f"{cluster}-engine-token"


def ca_secret_name(cluster: str) -> str:
    """The cluster's peer CA with its key: mounted nowhere, read only by the operator."""
    return f"{cluster}-peer-ca"


def peer_tls_secret_name(agent: str) -> str:
    """One agent pod's peer certificate and key (and the CA certificate): mounted into that pod only."""
    return f"{agent}-peer-tls"


def service_name(cluster: str) -> str:
    """Headless service; also the pods' subdomain, so it must be a DNS label."""
    return dns_label(f"{cluster}-agents", 63)


def network_policy_name(cluster: str) -> str:
    return f"{cluster}-agents"


def engine_service_name(cluster: str, role: str) -> str:
    """The headless Service of one role's engines (spec.engine): <cluster>-prefill, <cluster>-decode."""
    return dns_label(f"{cluster}-{role}", 63)


def engine_service_names(cluster: str) -> list[str]:
    return [engine_service_name(cluster, r.value) for r in Role]


def shared_children(cluster: str) -> list[tuple[str, str]]:
    """(kind, name) of the children every agent of `cluster` shares: rank map, Service, engine
    token, peer CA, NetworkPolicy, the engines' Services, spec.router's Deployment and Service, the
    PodDisruptionBudgets."""
    return [
        ("ConfigMap", rankmap_name(cluster)),
        ("Service", service_name(cluster)),
        ("Secret", engine_token_secret_name(cluster)),
        ("Secret", ca_secret_name(cluster)),
        ("NetworkPolicy", network_policy_name(cluster)),
        *(("Service", s) for s in engine_service_names(cluster)),
        ("Deployment", router_name(cluster)),
        ("Service", router_name(cluster)),
        *(("PodDisruptionBudget", disruption_budget_name(cluster, b)) for b in DISRUPTION_BUDGETS),
    ]


# The node pods' PodDisruptionBudgets (builders/disruption.py): one per role, and "units" for
# intra-node NVLink pods that hold both roles.
DISRUPTION_BUDGETS = ("prefill", "decode", "units")


def disruption_budget_name(cluster: str, budget: str) -> str:
    return dns_label(f"{cluster}-{budget}", 63)


def router_name(cluster: str) -> str:
    return f"{cluster}-router"


def peer_dns_name(ref: ClusterRef, agent: str) -> str:
    """The host name peers dial agent `agent` by (its pod under the headless Service), which its
    certificate carries; the agents' PDFABRIC_PEER_HOST_TEMPLATE spells the same name."""
    return f"{agent}.{service_name(ref.name)}.{ref.namespace}.svc"


def labels_for(ref: ClusterRef, **extra: str) -> dict[str, str]:
    labels = {
        c.LABEL_APP: c.APP_NAME,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_CLUSTER: ref.name,
        c.LABEL_CLUSTER_UID: ref.uid,
    }
    labels.update(extra)
    return labels


def object_meta(ref: ClusterRef, name: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels_for(ref, **extra_labels),
        "ownerReferences": [ref.owner_reference()],
    }
