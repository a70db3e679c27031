"""The one status writer's pure half: observed state -> PDCluster status, and the patch (if any).

compute_status() derives every field the operator owns from what the reconcile saw; status_patch()
compares it with the stored status and returns None when nothing changed, so a steady cluster
costs no writes. A condition's lastTransitionTime moves only when its status flips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_core.traffic import estimate_traffic
from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import agent_name
from pdfabric_operator.conditions import (
    agent_fallbacks,
    condition,
    not_ready_words,
    pods_refused,
    pods_unschedulable,
    rankmap_condition,
    stamp_conditions,
)
from pdfabric_operator.engine_status import engine_status, no_engines, router_status
from pdfabric_operator.observed import Observed
from pdfabric_operator.placement import AgentPlacement, PlacementFailure, Shortfall
from pdfabric_operator.planner import placed_spec

# Keys of .status this writer owns; anything else there (kopf's own bookkeeping) is left alone.
OWNED_KEYS = (
    "observedGeneration",
    "transport",
    "requestedTransport",
    "prefill",
    "decode",
    "prefillReady",
    "decodeReady",
    "agents",
    "unplaced",
    "placement",
    "nvlinkDomain",
    "expectedBytesPerRequest",
    "engines",
    "prefillEnginesReady",
    "decodeEnginesReady",
    "endpoints",
    "services",
    "router",
    "conditions",
)


def _ready_replicas(role: Role, replicas: int, pods: Mapping[str, AgentPlacement], ready: set[str]) -> int:
    """Replicas of `role` whose every rank sits in a pod whose agent is Ready (`pods`: by name)."""
    pods_of: dict[int, set[str]] = {}
    for name, a in pods.items():
        for r in a.ranks:
            if r.role == role:
                pods_of.setdefault(r.replica, set()).add(name)
    return sum(1 for rep in range(replicas) if rep in pods_of and pods_of[rep] <= ready)


def _rank_ids(ranks: Sequence[Rank]) -> list[str]:
    return [r.rank_id for r in ranks]


def compute_status(obs: Observed, cluster: str) -> dict[str, Any]:
    status = _status(obs, cluster)
    if obs.unschedulable_pods:  # placed by the planner, refused by the scheduler: say why
        message = pods_unschedulable(obs.unschedulable_pods)
        override = {
            c.COND_READY: condition(c.COND_READY, False, "PodUnschedulable", message),
            c.COND_PLACED: condition(c.COND_PLACED, False, "PodUnschedulable", message),
        }
        status["conditions"] = [override.get(x["type"], x) for x in status["conditions"]]
    if obs.refused_pods:  # whatever else holds, the cluster is not Ready while a pod is refused
        refused = pods_refused(obs.refused_pods)
        status["conditions"] = [refused if x["type"] == c.COND_READY else x for x in status["conditions"]]
    return status


def _status(obs: Observed, cluster: str) -> dict[str, Any]:
    spec = obs.spec
    p_desired, d_desired = spec.prefill.replicas, spec.decode.replicas
    status: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "requestedTransport": spec.transfer.effective_transport.value,
        "expectedBytesPerRequest": estimate_traffic(spec).to_status() if obs.spec_error is None else None,
    }
    outcome = obs.outcome
    if obs.spec_error is not None or outcome is None:
        msg = obs.spec_error or "spec not parsed"
        status.update(_unplaced(p_desired, d_desired))
        status["conditions"] = [
            condition(c.COND_READY, False, "InvalidSpec", msg),
            condition(c.COND_PLACED, False, "InvalidSpec", msg),
            condition(c.COND_TRANSPORT_READY, False, "InvalidSpec", msg),
            condition(c.COND_DEGRADED, False, "InvalidSpec", msg),
        ]
        return status
    if isinstance(outcome, PlacementFailure):
        status.update(_unplaced(p_desired, d_desired))
        status["unplaced"] = {
            "prefill": p_desired,
            "decode": d_desired,
            "reason": str(outcome.reason),
            "message": outcome.message,
        }
        status["conditions"] = [
            condition(c.COND_READY, False, "NotPlaced", outcome.message),
            condition(c.COND_PLACED, False, outcome.reason, outcome.message),
            condition(c.COND_TRANSPORT_READY, False, "NotPlaced", f"{outcome.requested_transport.value} not placed"),
            condition(c.COND_DEGRADED, False, "NotPlaced", "nothing runs, so nothing is degraded"),
        ]
        return status

    placement = outcome
    short = placement.shortfall
    # A scale step the nodes could not take: the replicas placed are the ones to be ready.
    p_placed = short.prefill_placed if short else p_desired
    d_placed = short.decode_placed if short else d_desired
    pods = {agent_name(cluster, a.unit, a.node): a for a in placement.agents}
    wanted = {name: a.node for name, a in pods.items()}
    # An agent awaiting its turn in a rolling update still serves its ranks: Ready stays True
    # while old pods serve, and drops only for the pod being replaced.
    ready_names = {v.name for v in obs.agents if v.ready and (v.current or v.serving) and wanted.get(v.name) == v.node}
    updated = sum(1 for v in obs.agents if v.current and wanted.get(v.name) == v.node)
    ready_agents = len(ready_names)
    p_ready = _ready_replicas(Role.PREFILL, p_placed, pods, ready_names)
    d_ready = _ready_replicas(Role.DECODE, d_placed, pods, ready_names)
    all_ready = ready_agents == len(wanted) and p_ready == p_placed and d_ready == d_placed
    status.update(
        {
            "transport": placement.transport.value,
            "prefill": {"desired": p_desired, "placed": p_placed, "ready": p_ready},
            "decode": {"desired": d_desired, "placed": d_placed, "ready": d_ready},
            "prefillReady": f"{p_ready}/{p_desired}",
            "decodeReady": f"{d_ready}/{d_desired}",
            "agents": {"desired": len(wanted), "ready": ready_agents},
            "unplaced": _unplaced_replicas(short),
            "placement": [
                {
                    "node": a.node,
                    "agent": name,
                    "gpus": a.gpus,
                    "ranks": _rank_ids(a.ranks),
                    **({"domain": a.domain} if a.domain else {}),
                }
                for name, a in pods.items()
            ],
            "nvlinkDomain": placement.domain,
        }
    )
    agents_msg = f"{ready_agents}/{len(wanted)} agents ready on {placement.transport.value}"
    if not all_ready:
        agents_msg += not_ready_words(obs.agents, wanted)
    if placement.is_fallback:
        placed = condition(
            c.COND_PLACED, True, "FallbackTCP", f"placed on tcp by the declared fallback; {placement.fallback_reason}"
        )
        transport_ready = condition(
            c.COND_TRANSPORT_READY,
            False,
            "FallbackTCP",
            f"requested {placement.requested_transport.value} could not be placed; running tcp",
        )
        degraded = condition(c.COND_DEGRADED, True, "TransportFallback", placement.fallback_reason or "fallback")
    else:
        placed = condition(
            c.COND_PLACED,
            True,
            "Placed",
            f"{sum(a.gpus for a in placement.agents)} ranks in {len(wanted)} pods on {len(set(wanted.values()))} nodes",
        )
        transport_ready = (
            condition(c.COND_TRANSPORT_READY, True, "AgentsReady", agents_msg)
            if all_ready
            else condition(c.COND_TRANSPORT_READY, False, "AgentsNotReady", agents_msg)
        )
        fell_back = agent_fallbacks(obs.agents)
        if fell_back:
            # The agents' own fallback (their node lacked what the labels promised): running, degraded.
            transport_ready = condition(c.COND_TRANSPORT_READY, False, "AgentFallback", fell_back)
        if obs.lost_nodes and not all_ready:
            degraded = condition(
                c.COND_DEGRADED,
                True,
                "NodeLost",
                # Lost: gone, NotReady, cordoned, or tainted against the pods (planner.usable_nodes).
                f"re-placing ranks from lost nodes: {', '.join(sorted(obs.lost_nodes))}",
            )
        elif fell_back:
            degraded = condition(c.COND_DEGRADED, True, "AgentTransportFallback", fell_back)
        else:
            degraded = condition(
                c.COND_DEGRADED, False, "AsRequested", f"running {placement.transport.value} as requested"
            )
    if short is not None:
        # Running what fits of a scale step: Placed stays True (every placed replica runs), the
        # shortfall is its reason and Degraded's, as a Deployment keeps Available with a Pending pod.
        placed = condition(c.COND_PLACED, True, "PartiallyPlaced", short.words)
        degraded = condition(c.COND_DEGRADED, True, short.reason, short.words)
    rolling = f"; rolling update: {updated}/{len(wanted)} agents updated" if updated < len(wanted) else ""
    if short is not None:
        rolling += f"; {short.words}"
    ready_reason = (
        "PartiallyPlaced" if short is not None else "RollingUpdate" if updated < len(wanted) else "AgentsReady"
    )
    ready = (
        condition(c.COND_READY, True, ready_reason, agents_msg + rolling)
        if all_ready
        else condition(c.COND_READY, False, "AgentsNotReady", agents_msg + rolling)
    )
    members = [rankmap_condition(obs.agents, obs.rankmap)] if obs.rankmap else []
    if spec.engine is None:
        status.update(no_engines())
        status["conditions"] = [ready, placed, transport_ready, degraded, *members]
        return status
    # The engines of the replicas placed are the ones wanted.
    engines = engine_status(dataclasses.replace(obs, spec=placed_spec(spec, placement)), cluster, placement)
    status.update(engines)
    counts = engines["engines"]
    engines_ok = all(counts[r]["ready"] == counts[r]["desired"] for r in ("prefill", "decode"))
    engines_msg = (
        f"prefill engines {engines['prefillEnginesReady']}, decode engines {engines['decodeEnginesReady']} ready"
    )
    engines_ready = condition(
        c.COND_ENGINES_READY, engines_ok, "EnginesReady" if engines_ok else "EnginesNotReady", engines_msg
    )
    router = router_status(obs, cluster)
    status["router"] = router
    router_ok = router is None or router["readyReplicas"] > 0
    router_msg = "" if router is None else f"; router {router['ready']} ready"
    if all_ready and not engines_ok:
        ready = condition(c.COND_READY, False, "EnginesNotReady", f"{agents_msg}; {engines_msg}{router_msg}{rolling}")
    elif all_ready and not router_ok:
        ready = condition(c.COND_READY, False, "RouterNotReady", f"{agents_msg}; {engines_msg}{router_msg}{rolling}")
    elif all_ready:
        ready = condition(c.COND_READY, True, ready_reason, f"{agents_msg}; {engines_msg}{router_msg}{rolling}")
    status["conditions"] = [ready, placed, transport_ready, degraded, engines_ready, *members]
    return status


def _unplaced_replicas(short: Shortfall | None) -> dict[str, Any] | None:
    """Replicas asked and not placed, per role, and the planner's reason: None when all are placed."""
    if short is None:
        return None
    return {**short.unplaced, "reason": str(short.reason), "message": short.message}


def _unplaced(p_desired: int, d_desired: int) -> dict[str, Any]:
    return {
        "transport": None,
        "prefill": {"desired": p_desired, "placed": 0, "ready": 0},
        "decode": {"desired": d_desired, "placed": 0, "ready": 0},
        "prefillReady": f"0/{p_desired}",
        "decodeReady": f"0/{d_desired}",
        "agents": {"desired": 0, "ready": 0},
        "unplaced": None,
        "placement": [],
        "nvlinkDomain": None,
        **no_engines(),
    }


def status_patch(desired: Mapping[str, Any], stored: Mapping[str, Any] | None, now: str) -> dict[str, Any] | None:
    """Merge patch for .status, or None when the stored status already says all of `desired`."""
    stored = stored or {}
    full = dict(desired)
    full["conditions"] = stamp_conditions(list(desired.get("conditions", [])), stored.get("conditions") or [], now)
    patch = {}
    for key in OWNED_KEYS:
        want = full.get(key)
        have = stored.get(key)
        if want != have:
            patch[key] = want  # None deletes the key in a merge patch
    return patch or None
