"""The status of spec.engine and spec.router: each engine's phase, restarts and last exit as its
agent's /readyz said, engines ready per role, the endpoints and Services a PD router needs, and the
router's Deployment's readiness."""

from __future__ import annotations

from typing import Any

from pdfabric_operator.builders.names import engine_service_name, router_name
from pdfabric_operator.builders.services import engine_endpoints
from pdfabric_operator.group_restarts import group_members
from pdfabric_operator.observed import Observed
from pdfabric_operator.placement import Placement

UNKNOWN_PHASE = "Unknown"  # an engine whose agent said nothing of it (not answering, not listed)


def no_engines() -> dict[str, Any]:
    """Fabric-only (or nothing placed): the engine keys are absent (None deletes them)."""
    return dict.fromkeys(("engines", "prefillEnginesReady", "decodeEnginesReady", "endpoints", "services", "router"))


def router_status(obs: Observed, cluster: str) -> dict[str, Any] | None:
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


def engine_status(obs: Observed, cluster: str, placement: Placement) -> dict[str, Any]:
    """Engines ready and restarted per role (the agents' /readyz), each engine's phase, restarts
    and last exit, and what a PD router needs: its URL (its pod's stable name under the agents'
    headless Service), prefill's bootstrap address, the per-role Services."""
    spec = obs.spec
    assert spec.engine is not None
    views = {v.name: v for v in obs.agents if v.current or v.serving}
    endpoints = engine_endpoints(cluster, obs.namespace, spec, placement)
    groups = group_members(cluster, spec, placement)
    for role, entries in endpoints.items():
        for entry in entries:
            # The agents' word on the engines they run; no word (not read, not listed): not ready.
            # A replica over several nodes is one entry (its leader's endpoints), ready while every
            # node rank's engine is, its restarts summed over them.
            others = groups.get(f"{role}-{entry['replica']}", [])
            pods = [entry["pod"], *(p for p in others if p != entry["pod"])]
            states = [views[p].engines.get(entry["engine"]) if p in views else None for p in pods]
            lead = states[0]
            sick = next((x for x in states if x is None or not x.ready), None)
            entry["ready"] = all(x is not None and x.ready for x in states)
            shown = lead if sick is None else sick
            entry["phase"] = shown.phase if shown is not None else UNKNOWN_PHASE
            entry["restarts"] = sum(x.restarts for x in states if x is not None)
            entry["lastExit"] = next((x.last_exit for x in states if x is not None and x.last_exit), "")
            entry["sandboxed"] = all(x is not None and x.sandboxed for x in states)
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
