"""The one status writer's pure half: observed state -> PDCluster status, and the patch (if any).

compute_status() derives every field the operator owns from what the reconcile saw; status_patch()
compares it with the stored status and returns None when nothing changed, so a steady cluster
costs no writes. A condition's lastTransitionTime moves only when its status flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec
from pdfabric_core.traffic import estimate_traffic
from pdfabric_operator import constants as c
from pdfabric_operator.builders import agent_name, engine_endpoints, engine_service_name, router_name
from pdfabric_operator.placement import AgentPlacement, Placement, PlacementFailure

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


@dataclass(frozen=True)
class AgentView:
    """One existing agent pod as the reconcile saw it."""

    name: str
    node: str
    ready: bool
    current: bool  # built for the current placement (same pod hash) and not being deleted
    # What the agent's /readyz says (operator.agentstate): the rank map's transport and the one
    # it carries KV over; they differ after the agent's own fallback. "": not read (yet).
    requested: str = ""
    transport: str = ""
    # With spec.engine: engine name -> its state as the agent's /readyz said it this reconcile
    # (empty: not read; its engines count as not ready). `ready` is then the agent's own word.
    engines: Mapping[str, EngineState] = field(default_factory=dict)
    # Not current, but built for the same ranks and the same agent settings (only the image,
    # resources or pod overrides differ): it serves until the rolling update replaces it.
    serving: bool = False
    # Its /readyz: the digest of the rank map it runs on and why it did not take a newer one
    # ("": not read, or nothing refused); its readiness reason and message.
    rankmap: str = ""
    rankmap_refused: str = ""
    reason: str = ""
    message: str = ""


UNKNOWN_PHASE = "Unknown"  # an engine whose agent said nothing of it (not answering, not listed)


def agent_fallbacks(agents: Sequence[AgentView]) -> str:
    """Who carries KV over another transport than the rank map asked for, in words; "" if nobody.
    Only current agents count (a pod on its way out says nothing about the cluster now)."""
    fell = sorted(
        (v.name, v.requested, v.transport) for v in agents if v.current and v.transport and v.transport != v.requested
    )
    return "; ".join(f"agent {n} carries KV over {t} instead of the requested {r}" for n, r, t in fell)


@dataclass(frozen=True)
class Observed:
    generation: int
    spec: PDClusterSpec
    outcome: Placement | PlacementFailure | None  # None: the spec itself was unusable
    agents: Sequence[AgentView] = ()
    spec_error: str | None = None
    # Nodes lost under our agents; Degraded while their ranks are not yet Ready elsewhere.
    lost_nodes: Sequence[str] = field(default_factory=tuple)
    namespace: str = ""  # the PDCluster's: the engines' endpoint host names carry it
    router: Mapping[str, Any] | None = None  # spec.router's Deployment as read (its readiness)
    # Agent pods the API server refused to create (admission: Pod Security, quota, a webhook),
    # by name, with its message: Ready is False with reason PodRejected until they are created.
    refused_pods: Mapping[str, str] = field(default_factory=dict)
    # Agent pods the kube-scheduler has not bound, by name, with the node the planner chose and
    # the scheduler's reason: Ready and Placed are False with reason PodUnschedulable meanwhile.
    unschedulable_pods: Mapping[str, str] = field(default_factory=dict)
    rankmap: str = ""  # the digest of the rank map the operator wrote last


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def rankmap_condition(agents: Sequence[AgentView], rankmap: str) -> dict[str, str]:
    """RankMapCurrent: whether every agent that serves runs the rank map the operator wrote last
    (live membership: running agents adopt a newer map in seconds), naming those behind and what
    they said when they refused it. An agent not read yet is not counted either way."""
    serving = [v for v in agents if v.current or v.serving]
    read = [v for v in serving if v.rankmap]
    behind = sorted((v for v in read if v.rankmap != rankmap), key=lambda v: v.name)
    if not behind:
        return _condition(c.COND_RANKMAP_CURRENT, True, "AgentsCurrent", f"{len(read)} agents run rank map {rankmap}")
    named = [f"{v.name} ({v.rankmap_refused})" if v.rankmap_refused else v.name for v in behind[:3]]
    more = f" and {len(behind) - 3} more" if len(behind) > 3 else ""
    return _condition(
        c.COND_RANKMAP_CURRENT,
        False,
        "AgentsBehind",
        f"{len(behind)} of {len(read)} agents still run an older rank map than {rankmap}: {', '.join(named)}{more}",
    )


def _not_ready_words(agents: Sequence[AgentView], wanted: Mapping[str, str]) -> str:
    """What agents that are not Ready say of themselves (their /readyz reason and message)."""
    words = sorted(
        (v.name, v.reason, v.message) for v in agents if v.name in wanted and not v.ready and v.current and v.reason
    )
    said = "; ".join(f"{n}: {r}: {m[:300]}" for n, r, m in words[:2])
    return f"; not ready: {said}" + (f" (and {len(words) - 2} more)" if len(words) > 2 else "") if said else ""


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
        message = _pods_unschedulable(obs.unschedulable_pods)
        override = {
            c.COND_READY: _condition(c.COND_READY, False, "PodUnschedulable", message),
            c.COND_PLACED: _condition(c.COND_PLACED, False, "PodUnschedulable", message),
        }
        status["conditions"] = [override.get(x["type"], x) for x in status["conditions"]]
    if obs.refused_pods:  # whatever else holds, the cluster is not Ready while a pod is refused
        refused = _pods_refused(obs.refused_pods)
        status["conditions"] = [refused if x["type"] == c.COND_READY else x for x in status["conditions"]]
    return status


def ready_condition(status: Mapping[str, Any]) -> dict[str, str]:
    """The Ready condition of a status compute_status wrote."""
    return next(x for x in status["conditions"] if x["type"] == c.COND_READY)


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
            _condition(c.COND_READY, False, "InvalidSpec", msg),
            _condition(c.COND_PLACED, False, "InvalidSpec", msg),
            _condition(c.COND_TRANSPORT_READY, False, "InvalidSpec", msg),
            _condition(c.COND_DEGRADED, False, "InvalidSpec", msg),
        ]
        return status
    if isinstance(outcome, PlacementFailure):
        status.update(_unplaced(p_desired, d_desired))
        status["conditions"] = [
            _condition(c.COND_READY, False, "NotPlaced", outcome.message),
            _condition(c.COND_PLACED, False, outcome.reason, outcome.message),
            _condition(c.COND_TRANSPORT_READY, False, "NotPlaced", f"{outcome.requested_transport.value} not placed"),
            _condition(c.COND_DEGRADED, False, "NotPlaced", "nothing runs, so nothing is degraded"),
        ]
        return status

    placement = outcome
    pods = {agent_name(cluster, a.unit, a.node): a for a in placement.agents}
    wanted = {name: a.node for name, a in pods.items()}
    # An agent awaiting its turn in a rolling update still serves its ranks: Ready stays True
    # while old pods serve, and drops only for the pod being replaced.
    ready_names = {v.name for v in obs.agents if v.ready and (v.current or v.serving) and wanted.get(v.name) == v.node}
    updated = sum(1 for v in obs.agents if v.current and wanted.get(v.name) == v.node)
    ready_agents = len(ready_names)
    p_ready = _ready_replicas(Role.PREFILL, p_desired, pods, ready_names)
    d_ready = _ready_replicas(Role.DECODE, d_desired, pods, ready_names)
    all_ready = ready_agents == len(wanted) and p_ready == p_desired and d_ready == d_desired
    status.update(
        {
            "transport": placement.transport.value,
            "prefill": {"desired": p_desired, "ready": p_ready},
            "decode": {"desired": d_desired, "ready": d_ready},
            "prefillReady": f"{p_ready}/{p_desired}",
            "decodeReady": f"{d_ready}/{d_desired}",
            "agents": {"desired": len(wanted), "ready": ready_agents},
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
        agents_msg += _not_ready_words(obs.agents, wanted)
    if placement.is_fallback:
        placed = _condition(
            c.COND_PLACED, True, "FallbackTCP", f"placed on tcp by the declared fallback; {placement.fallback_reason}"
        )
        transport_ready = _condition(
            c.COND_TRANSPORT_READY,
            False,
            "FallbackTCP",
            f"requested {placement.requested_transport.value} could not be placed; running tcp",
        )
        degraded = _condition(c.COND_DEGRADED, True, "TransportFallback", placement.fallback_reason or "fallback")
    else:
        placed = _condition(
            c.COND_PLACED,
            True,
            "Placed",
            f"{sum(a.gpus for a in placement.agents)} ranks in {len(wanted)} pods on {len(set(wanted.values()))} nodes",
        )
        transport_ready = (
            _condition(c.COND_TRANSPORT_READY, True, "AgentsReady", agents_msg)
            if all_ready
            else _condition(c.COND_TRANSPORT_READY, False, "AgentsNotReady", agents_msg)
        )
        fell_back = agent_fallbacks(obs.agents)
        if fell_back:
            # The agents' own fallback (their node lacked what the labels promised): running, degraded.
            transport_ready = _condition(c.COND_TRANSPORT_READY, False, "AgentFallback", fell_back)
        if obs.lost_nodes and not all_ready:
            degraded = _condition(
                c.COND_DEGRADED,
                True,
                "NodeLost",
                # Lost: gone, NotReady, cordoned, or tainted against the pods (planner.usable_nodes).
                f"re-placing ranks from lost nodes: {', '.join(sorted(obs.lost_nodes))}",
            )
        elif fell_back:
            degraded = _condition(c.COND_DEGRADED, True, "AgentTransportFallback", fell_back)
        else:
            degraded = _condition(
                c.COND_DEGRADED, False, "AsRequested", f"running {placement.transport.value} as requested"
            )
    rolling = f"; rolling update: {updated}/{len(wanted)} agents updated" if updated < len(wanted) else ""
    ready = (
        _condition(c.COND_READY, True, "RollingUpdate" if rolling else "AgentsReady", agents_msg + rolling)
        if all_ready
        else _condition(c.COND_READY, False, "AgentsNotReady", agents_msg + rolling)
    )
    members = [rankmap_condition(obs.agents, obs.rankmap)] if obs.rankmap else []
    if spec.engine is None:
        status.update(_no_engines())
        status["conditions"] = [ready, placed, transport_ready, degraded, *members]
        return status
    engines = _engine_status(obs, cluster, placement)
    status.update(engines)
    counts = engines["engines"]
    engines_ok = all(counts[r]["ready"] == counts[r]["desired"] for r in ("prefill", "decode"))
    engines_msg = (
        f"prefill engines {engines['prefillEnginesReady']}, decode engines {engines['decodeEnginesReady']} ready"
    )
    engines_ready = _condition(
        c.COND_ENGINES_READY, engines_ok, "EnginesReady" if engines_ok else "EnginesNotReady", engines_msg
    )
    router = _router_status(obs, cluster)
    status["router"] = router
    router_ok = router is None or router["readyReplicas"] > 0
    router_msg = "" if router is None else f"; router {router['ready']} ready"
    if all_ready and not engines_ok:
        ready = _condition(c.COND_READY, False, "EnginesNotReady", f"{agents_msg}; {engines_msg}{router_msg}{rolling}")
    elif all_ready and not router_ok:
        ready = _condition(c.COND_READY, False, "RouterNotReady", f"{agents_msg}; {engines_msg}{router_msg}{rolling}")
    elif all_ready:
        ready = _condition(
            c.COND_READY,
            True,
            "RollingUpdate" if rolling else "AgentsReady",
            f"{agents_msg}; {engines_msg}{router_msg}{rolling}",
        )
    status["conditions"] = [ready, placed, transport_ready, degraded, engines_ready, *members]
    return status


def _pods_refused(refused: Mapping[str, str]) -> dict[str, str]:
    first = min(refused)
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return _condition(
        c.COND_READY, False, "PodRejected", f"the API server refused agent pod {first}{more}: {refused[first]}"
    )


def _pods_unschedulable(pods: Mapping[str, str]) -> str:
    first = min(pods)
    more = f" (and {len(pods) - 1} more)" if len(pods) > 1 else ""
    return f"the scheduler has not bound agent pod {first}{more} to its {pods[first]}"


def _no_engines() -> dict[str, Any]:
    """Fabric-only (or nothing placed): the engine keys are absent (None deletes them)."""
    return dict.fromkeys(("engines", "prefillEnginesReady", "decodeEnginesReady", "endpoints", "services", "router"))


def _router_status(obs: Observed, cluster: str) -> dict[str, Any] | None:
    """spec.router: its Service and URL, and its replicas ready as its Deployment says."""
    router = obs.spec.router
    if router is None:
        return None
    seen = (obs.router or {}).get("status") or {}
    ready = int(seen.get("readyReplicas") or 0)
    name = router_name(cluster)
    return {
        "service": name,
        "url": f"http://{name}.{obs.namespace}.svc:{router.port}",
        "replicas": router.replicas,
        "readyReplicas": ready,
        "ready": f"{ready}/{router.replicas}",
    }


def _engine_status(obs: Observed, cluster: str, placement: Placement) -> dict[str, Any]:
    """Engines ready and restarted per role (the agents' /readyz), each engine's phase, restarts
    and last exit, and what a PD router needs: its URL (its pod's stable name under the agents'
    headless Service), prefill's bootstrap address, the per-role Services."""
    spec = obs.spec
    assert spec.engine is not None
    views = {v.name: v for v in obs.agents if v.current or v.serving}
    endpoints = engine_endpoints(cluster, obs.namespace, spec, placement)
    for entries in endpoints.values():
        for entry in entries:
            view = views.get(entry["pod"])
            # The agent's word on the engine it runs; no word (not read, not listed): not ready.
            state = view.engines.get(entry["engine"]) if view is not None else None
            entry["ready"] = bool(state is not None and state.ready)
            entry["phase"] = state.phase if state is not None else UNKNOWN_PHASE
            entry["restarts"] = state.restarts if state is not None else 0
            entry["lastExit"] = state.last_exit if state is not None else ""
            entry["sandboxed"] = bool(state is not None and state.sandboxed)
    desired = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas}
    ready = {r: sum(1 for x in endpoints[r] if x["ready"]) for r in endpoints}
    restarts = {r: sum(x["restarts"] for x in endpoints[r]) for r in endpoints}
    return {
        "engines": {r: {"desired": desired[r], "ready": ready[r], "restarts": restarts[r]} for r in endpoints},
        "prefillEnginesReady": f"{ready['prefill']}/{desired['prefill']}",
        "decodeEnginesReady": f"{ready['decode']}/{desired['decode']}",
        "endpoints": endpoints,
        "services": {r: engine_service_name(cluster, r) for r in endpoints},
    }


def _unplaced(p_desired: int, d_desired: int) -> dict[str, Any]:
    return {
        "transport": None,
        "prefill": {"desired": p_desired, "ready": 0},
        "decode": {"desired": d_desired, "ready": 0},
        "prefillReady": f"0/{p_desired}",
        "decodeReady": f"0/{d_desired}",
        "agents": {"desired": 0, "ready": 0},
        "placement": [],
        "nvlinkDomain": None,
        **_no_engines(),
    }


def _stamp_conditions(new: list[dict[str, str]], old: Sequence[Mapping[str, Any]], now: str) -> list[dict[str, str]]:
    old_by_type = {cond.get("type"): cond for cond in old or ()}
    out = []
    for cond in new:
        prev = old_by_type.get(cond["type"])
        stamped = dict(cond)
        if prev is not None and prev.get("status") == cond["status"] and prev.get("lastTransitionTime"):
            stamped["lastTransitionTime"] = prev["lastTransitionTime"]
        else:
            stamped["lastTransitionTime"] = now
        out.append(stamped)
    return out


def status_patch(desired: Mapping[str, Any], stored: Mapping[str, Any] | None, now: str) -> dict[str, Any] | None:
    """Merge patch for .status, or None when the stored status already says all of `desired`."""
    stored = stored or {}
    full = dict(desired)
    full["conditions"] = _stamp_conditions(list(desired.get("conditions", [])), stored.get("conditions") or [], now)
    patch = {}
    for key in OWNED_KEYS:
        want = full.get(key)
        have = stored.get(key)
        if want != have:
            patch[key] = want  # None deletes the key in a merge patch
    return patch or None
