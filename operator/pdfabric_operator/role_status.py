"""A PDRole's status, pure: the replicas in effect, placed and ready, and its Synced and Placed
conditions (roles.py syncs the PDRole and writes it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdfabric_operator import constants as c


@dataclass(frozen=True)
class Refusal:
    """A scale the PDCluster's validation refused: tried again only once the PDCluster changes."""

    replicas: int
    cluster_generation: int


def role_status(
    *,
    role: str,
    cluster: str,
    cluster_replicas: int,
    role_replicas: int,
    ready: int,
    selector: str,
    generation: int,
    refused: Refusal | None,
    refused_message: str,
    placed: int | None = None,
    unplaced: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The PDRole's status (conditions without lastTransitionTime; `status_patch` stamps it).

    `placed`: the PDCluster's status.<role>.placed (None: not said yet, taken as all of them);
    `unplaced`: its status.unplaced, the planner's word on replicas that found no room."""
    if role_replicas == cluster_replicas:
        cond = ("True", "InSync", f"PDCluster {cluster} has spec.{role}.replicas {cluster_replicas}")
    elif refused is not None and refused.replicas == role_replicas:
        cond = ("False", "ScaleRefused", refused_message)
    else:
        cond = (
            "False",
            "Pending",
            f"PDCluster {cluster} has spec.{role}.replicas {cluster_replicas}, not yet {role_replicas}",
        )
    in_effect = cluster_replicas if placed is None else placed
    words = f"{in_effect} of {cluster_replicas} {role} replicas placed"
    if int((unplaced or {}).get(role) or 0):
        # A scale step the nodes could not take: what runs, and the planner's word on the rest.
        why = str((unplaced or {}).get("message") or "")
        placed_cond = ("False", str((unplaced or {}).get("reason") or "NotPlaced"), f"{words}: {why}")
    elif in_effect < cluster_replicas:  # the PDCluster's status has not caught up with a scale yet
        placed_cond = ("False", "Pending", words)
    else:
        placed_cond = ("True", "Placed", f"all {cluster_replicas} {role} replicas placed")
    status: dict[str, Any] = {
        "replicas": cluster_replicas,
        "placedReplicas": in_effect,
        "readyReplicas": ready,
        "selector": selector,
        "observedGeneration": generation,
        "refused": None,
        "conditions": [
            {"type": c.COND_SYNCED, "status": cond[0], "reason": cond[1], "message": cond[2]},
            {"type": c.COND_PLACED, "status": placed_cond[0], "reason": placed_cond[1], "message": placed_cond[2]},
        ],
    }
    if refused is not None and cond[1] == "ScaleRefused":
        status["refused"] = {
            "replicas": refused.replicas,
            "clusterGeneration": refused.cluster_generation,
            "message": refused_message,
        }
    return status


def status_patch(desired: Mapping[str, Any], stored: Mapping[str, Any], now: str) -> dict[str, Any] | None:
    """Merge patch for the PDRole's .status, or None when the stored one says the same already."""
    old = {x.get("type"): x for x in stored.get("conditions") or []}
    conditions = []
    for cond in desired["conditions"]:
        prev = old.get(cond["type"]) or {}
        since = prev.get("lastTransitionTime") if prev.get("status") == cond["status"] else None
        conditions.append({**cond, "lastTransitionTime": since or now})
    full = {**desired, "conditions": conditions}
    same = (
        all(stored.get(k) == v for k, v in full.items() if k != "conditions")
        and [{k: v for k, v in x.items() if k != "lastTransitionTime"} for x in stored.get("conditions") or []]
        == desired["conditions"]
    )
    return None if same else full
