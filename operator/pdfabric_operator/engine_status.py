"""The status of spec.engine and spec.router: each engine's phase, restarts and last exit as its
agent's /readyz said, engines ready per role, the endpoints and Services a PD router needs, and the
router's Deployment's readiness."""

from __future__ import annotations

from typing import Any

from pdfabric_operator.builders.names import engine_service_name, router_name
from pdfabric_operator.builders.services import engine_endpoints
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
