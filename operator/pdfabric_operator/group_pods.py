"""Replicas over several nodes kept whole: the pod deletions, incarnation annotations and releases
that group_restarts.py decides, applied."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pdfabric_operator import constants as c
from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.group_restarts import (
    GroupHolds,
    MemberPod,
    Unbound,
    group_restarts,
    held_pods,
    release_stalled,
    summed_engine_restarts,
)
from pdfabric_operator.kube import Kube
from pdfabric_operator.snapshot import OwnPod


@dataclass
class GroupUpkeep:
    actions: list[str] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # pod name -> why it is not created now


def keep_groups_whole(
    kube: Kube,
    groups: Mapping[str, Sequence[str]],
    own: Sequence[OwnPod],
    reports: Mapping[str, AgentReport],
    holds: GroupHolds,
    now: datetime,
    bind_timeout_s: float,
) -> GroupUpkeep:
    """Release a group the scheduler cannot bind whole and delete the members of a group whose
    incarnation broke (an Event each); write a complete group's incarnation on its pods."""
    out = GroupUpkeep()
    if not groups and not holds.until:
        return out
    present = {p.name: p for p in own if not p.deleting}
    unbound = {
        name: Unbound(datetime.fromisoformat(p.unschedulable_since), p.unschedulable)
        for name, p in present.items()
        if p.unschedulable and p.unschedulable_since
    }
    for unit, why in release_stalled(holds, groups, list(present), unbound, now, bind_timeout_s).items():
        out.events.append(("GroupReleased", why))
        for name in groups[unit]:
            pod = present.pop(name, None)
            if pod is not None and kube.delete("Pod", pod.namespace, name, uid=pod.uid):
                out.actions.append(f"delete pod {name} (its group is released)")
    out.held = held_pods(holds, groups, now)
    running = {name: p for name, p in present.items() if not p.failed}
    members = {
        name: MemberPod(p.uid, p.group_incarnation, summed_engine_restarts(reports.get(p.uid)), p.container_restarts)
        for name, p in running.items()
    }
    decided = group_restarts(groups, members)
    for name, why in decided.delete.items():
        pod = running[name]
        if kube.delete("Pod", pod.namespace, name, uid=pod.uid):
            out.actions.append(f"delete pod {name} (its group restarts)")
            out.events.append(("GroupRestart", f"pod {name} deleted: {why}"))
    for name, word in decided.record.items():
        pod = running[name]
        if kube.annotate("Pod", pod.namespace, name, pod.uid, {c.ANN_GROUP_INCARNATION: word}):
            out.actions.append(f"annotate pod {name} with its group's incarnation")
    return out
