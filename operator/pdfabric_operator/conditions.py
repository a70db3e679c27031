"""The PDCluster's conditions, each with a reason and a message that says why: the helpers
compute_status assembles them with, the agents' own words (fallbacks, not-ready reasons, rank maps
behind), and lastTransitionTime, which moves only when a condition's status flips."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdfabric_operator import constants as c
from pdfabric_operator.observed import AgentView


def condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def rankmap_condition(agents: Sequence[AgentView], rankmap: str) -> dict[str, str]:
    """RankMapCurrent: whether every agent that serves runs the rank map the operator wrote last
    (live membership: running agents adopt a newer map in seconds), naming those behind and what
    they said when they refused it. An agent not read yet is not counted either way."""
    serving = [v for v in agents if v.current or v.serving]
    read = [v for v in serving if v.rankmap]
    behind = sorted((v for v in read if v.rankmap != rankmap), key=lambda v: v.name)
    if not behind:
        return condition(c.COND_RANKMAP_CURRENT, True, "AgentsCurrent", f"{len(read)} agents run rank map {rankmap}")
    named = [f"{v.name} ({v.rankmap_refused})" if v.rankmap_refused else v.name for v in behind[:3]]
    more = f" and {len(behind) - 3} more" if len(behind) > 3 else ""
    return condition(
        c.COND_RANKMAP_CURRENT,
        False,
        "AgentsBehind",
        f"{len(behind)} of {len(read)} agents still run an older rank map than {rankmap}: {', '.join(named)}{more}",
    )


def not_ready_words(agents: Sequence[AgentView], wanted: Mapping[str, str]) -> str:
    """What agents that are not Ready say of themselves (their /readyz reason and message)."""
    words = sorted(
        (v.name, v.reason, v.message) for v in agents if v.name in wanted and not v.ready and v.current and v.reason
    )
    said = "; ".join(f"{n}: {r}: {m[:300]}" for n, r, m in words[:2])
    return f"; not ready: {said}" + (f" (and {len(words) - 2} more)" if len(words) > 2 else "") if said else ""


def agent_fallbacks(agents: Sequence[AgentView]) -> str:
    """Who carries KV over another transport than the rank map asked for, in words; "" if nobody.
    Only current agents count (a pod on its way out says nothing about the cluster now)."""
    fell = sorted(
        (v.name, v.requested, v.transport) for v in agents if v.current and v.transport and v.transport != v.requested
    )
    return "; ".join(f"agent {n} carries KV over {t} instead of the requested {r}" for n, r, t in fell)


def pods_refused(refused: Mapping[str, str]) -> dict[str, str]:
    first = min(refused)
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return condition(
        c.COND_READY, False, "PodRejected", f"the API server refused agent pod {first}{more}: {refused[first]}"
    )


def pods_unschedulable(pods: Mapping[str, str]) -> str:
    first = min(pods)
    more = f" (and {len(pods) - 1} more)" if len(pods) > 1 else ""
    return f"the scheduler has not bound agent pod {first}{more} to its {pods[first]}"


def ready_condition(status: Mapping[str, Any]) -> dict[str, str]:
    """The Ready condition of a status compute_status wrote."""
    return next(x for x in status["conditions"] if x["type"] == c.COND_READY)


def stamp_conditions(new: list[dict[str, str]], old: Sequence[Mapping[str, Any]], now: str) -> list[dict[str, str]]:
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
