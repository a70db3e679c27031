"""The status writer: conditions per outcome, ready counts, patch only on change."""

from __future__ import annotations

import dataclasses

import pytest

from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role
from pdfabric_operator.builders.names import agent_name
from pdfabric_operator.conditions import agent_fallbacks
from pdfabric_operator.observed import AgentView, Observed
from pdfabric_operator.placement import Placement, PlacementFailure
from pdfabric_operator.planner import plan_placement
from pdfabric_operator.status import compute_status, status_patch
from tests.builders import gpu_node, pdcluster

NODES = [gpu_node("a", 8), gpu_node("b", 8)]


def _conds(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def _placement(builder) -> Placement:
    result = plan_placement(builder.spec(), NODES, [], cluster_uid="u")
    assert isinstance(result, Placement)
    return result


def _views(placement: Placement, ready: set[str], current: bool = True) -> list[AgentView]:
    return [AgentView(agent_name("pd", a.unit, a.node), a.node, a.node in ready, current) for a in placement.agents]


BUILDER = pdcluster().prefill(replicas=2, tp=4).decode(replicas=2, tp=4)

# (id, ready nodes, current, expected Ready, prefillReady, decodeReady)
READY_CASES = [
    ("all-ready", {"a", "b"}, True, ("True", "AgentsReady"), "2/2", "2/2"),
    ("one-node-ready", {"a"}, True, ("False", "AgentsNotReady"), None, None),
    ("none-ready", set(), True, ("False", "AgentsNotReady"), "0/2", "0/2"),
    ("stale-pods-do-not-count", {"a", "b"}, False, ("False", "AgentsNotReady"), "0/2", "0/2"),
]


@pytest.mark.parametrize(
    ("ready", "current", "expected", "p_ready", "d_ready"),
    [c[1:] for c in READY_CASES],
    ids=[c[0] for c in READY_CASES],
)
def test_ready_counts(ready, current, expected, p_ready, d_ready) -> None:
    placement = _placement(BUILDER)
    status = compute_status(Observed(3, BUILDER.spec(), placement, _views(placement, ready, current)), "pd")
    assert _conds(status)["Ready"] == expected
    assert _conds(status)["Placed"] == ("True", "Placed")
    assert status["observedGeneration"] == 3
    if p_ready is not None:
        assert (status["prefillReady"], status["decodeReady"]) == (p_ready, d_ready)
    assert sum(p["gpus"] for p in status["placement"]) == 16


def test_one_ready_node_counts_its_whole_replicas() -> None:
    placement = _placement(BUILDER)
    node = placement.agents[0].node
    status = compute_status(Observed(1, BUILDER.spec(), placement, _views(placement, {node})), "pd")
    on_node = {(r.role, r.replica) for a in placement.agents if a.node == node for r in a.ranks}
    prefill = sum(1 for role, _ in on_node if role == "prefill")
    assert status["prefill"]["ready"] == prefill
    assert status["decode"]["ready"] == len(on_node) - prefill


def test_failure_conditions() -> None:
    failure = PlacementFailure(
        "NoRDMANodes", "no rdma here", pdcluster().transport("rdma").spec().transfer.effective_transport
    )
    status = compute_status(Observed(1, pdcluster().spec(), failure), "pd")
    assert _conds(status) == {
        "Ready": ("False", "NotPlaced"),
        "Placed": ("False", "NoRDMANodes"),
        "TransportReady": ("False", "NotPlaced"),
        "Degraded": ("False", "NotPlaced"),
    }
    assert status["placement"] == [] and status["transport"] is None


def test_fallback_conditions() -> None:
    builder = pdcluster().transport("rdma").placement(fallback="TCP")
    result = plan_placement(builder.spec(), NODES, [], cluster_uid="u")
    assert isinstance(result, Placement) and result.is_fallback
    status = compute_status(Observed(1, builder.spec(), result, _views(result, {"a", "b"})), "pd")
    assert _conds(status) == {
        "Ready": ("True", "AgentsReady"),
        "Placed": ("True", "FallbackTCP"),
        "TransportReady": ("False", "FallbackTCP"),
        "Degraded": ("True", "TransportFallback"),
    }
    assert (status["transport"], status["requestedTransport"]) == ("tcp", "rdma")


def test_lost_node_is_degraded_until_replaced_ranks_are_ready() -> None:
    placement = _placement(BUILDER)
    obs = Observed(1, BUILDER.spec(), placement, _views(placement, {"a"}), lost_nodes=("gone",))
    assert _conds(compute_status(obs, "pd"))["Degraded"] == ("True", "NodeLost")
    # The old agent may sit Terminating on the unreachable node for long; once the ranks run
    # elsewhere the cluster is whole again.
    obs = Observed(1, BUILDER.spec(), placement, _views(placement, {"a", "b"}), lost_nodes=("gone",))
    assert _conds(compute_status(obs, "pd"))["Degraded"] == ("False", "AsRequested")


def test_invalid_spec() -> None:
    status = compute_status(Observed(1, pdcluster().spec(), None, spec_error="bad"), "pd")
    assert _conds(status)["Placed"] == ("False", "InvalidSpec")
    assert status["expectedBytesPerRequest"] is None


def test_patch_only_on_change_and_transition_time_kept() -> None:
    placement = _placement(BUILDER)
    desired = compute_status(Observed(1, BUILDER.spec(), placement, _views(placement, set())), "pd")
    first = status_patch(desired, None, "T1")
    assert first is not None and all(c["lastTransitionTime"] == "T1" for c in first["conditions"])
    stored = dict(first)
    assert status_patch(desired, stored, "T2") is None
    ready = compute_status(Observed(1, BUILDER.spec(), placement, _views(placement, {"a", "b"})), "pd")
    patch = status_patch(ready, stored, "T3")
    assert patch is not None
    times = {c["type"]: c["lastTransitionTime"] for c in patch["conditions"]}
    assert times == {"Ready": "T3", "Placed": "T1", "TransportReady": "T3", "Degraded": "T1"}
    assert "expectedBytesPerRequest" not in patch  # unchanged keys are not sent


def test_patch_clears_keys_that_went_away() -> None:
    stored = {"nvlinkDomain": "x"}
    desired = compute_status(Observed(1, pdcluster().spec(), _placement(pdcluster()), []), "pd")
    patch = status_patch(desired, stored, "T")
    assert patch is not None and patch["nvlinkDomain"] is None  # merge patch: null deletes


def test_an_agents_own_fallback_is_degraded_and_named() -> None:
    """Placed for rdma, but an agent found no RDMA device and used the declared fallback: its
    /readyz says so (operator.agentstate), TransportReady and Degraded name it."""
    builder = pdcluster().prefill(replicas=2, tp=4).decode(replicas=2, tp=4)
    placement = _placement(builder)
    views = _views(placement, {"a", "b"})
    views = [
        AgentView(v.name, v.node, v.ready, v.current, "nvlink", "tcp" if v.node == "a" else "nvlink") for v in views
    ]
    status = compute_status(Observed(1, builder.spec(), placement, views), "pd")
    conds = {c["type"]: c for c in status["conditions"]}
    assert (conds["Ready"]["status"], conds["TransportReady"]["reason"]) == ("True", "AgentFallback")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "AgentTransportFallback")
    assert conds["Degraded"]["message"] == "; ".join(
        f"agent {v.name} carries KV over tcp instead of the requested nvlink" for v in views if v.node == "a"
    )
    assert agent_fallbacks(views) == conds["Degraded"]["message"]
    # Agents that say nothing yet, or a stale pod, say nothing about the cluster now.
    quiet = [AgentView(v.name, v.node, v.ready, v.node != "a", v.requested, v.transport) for v in views]
    assert _conds(compute_status(Observed(1, builder.spec(), placement, quiet), "pd"))["Degraded"][0] == "False"


# --- spec.engine ---------------------------------------------------------------------------------


def _state(name: str, ready: bool = True, **kw) -> EngineState:
    role = Role(name.split("-")[0])
    phase = "Running" if ready else "Starting"
    return EngineState(name, role, int(name.split("-")[1]), kw.pop("phase", phase), ready, **kw)


def _engine_status(states: dict[str, EngineState | None], agent_ready: bool = True):
    """One node with the pods of prefill-0, prefill-1 and decode-0, an engine each; `states`
    overrides the agents' word per engine (None: not listed)."""
    builder = pdcluster().prefill(replicas=2).decode(replicas=1).engine()
    spec = builder.spec()
    placement = plan_placement(spec, [gpu_node("n1", 8)], [], cluster_uid="u")
    assert isinstance(placement, Placement)
    engines: dict[str, EngineState | None] = {n: _state(n) for n in ("prefill-0", "prefill-1", "decode-0")}
    engines.update(states)
    views = []
    for a in placement.agents:
        listed = {n: x for n, x in engines.items() if x is not None and n == a.unit}
        views.append(AgentView(agent_name("pd", a.unit, a.node), a.node, agent_ready, True, engines=listed))
    return compute_status(Observed(1, spec, placement, views, namespace="ns"), "pd")


def _cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_fabric_only_status_has_no_engine_keys() -> None:
    spec = pdcluster().spec()
    placement = plan_placement(spec, [gpu_node("n1", 8)], [], cluster_uid="u")
    status = compute_status(Observed(1, spec, placement, []), "pd")
    for key in ("engines", "prefillEnginesReady", "decodeEnginesReady", "endpoints", "services"):
        assert status[key] is None
    assert "EnginesReady" not in {c["type"] for c in status["conditions"]}


def test_engines_ready_per_role_and_ready_waits_for_them() -> None:
    status = _engine_status({"prefill-1": _state("prefill-1", False)})
    assert status["engines"] == {
        "prefill": {"desired": 2, "ready": 1, "restarts": 0},
        "decode": {"desired": 1, "ready": 1, "restarts": 0},
    }
    assert (status["prefillEnginesReady"], status["decodeEnginesReady"]) == ("1/2", "1/1")
    assert _cond(status, "EnginesReady")["status"] == "False"
    assert (_cond(status, "Ready")["status"], _cond(status, "Ready")["reason"]) == ("False", "EnginesNotReady")
    assert status["agents"] == {"desired": 3, "ready": 3}  # the agents themselves are Ready
    ok = _engine_status({})
    assert _cond(ok, "EnginesReady")["status"] == _cond(ok, "Ready")["status"] == "True"


def test_endpoints_are_what_a_pd_router_needs() -> None:
    status = _engine_status({"decode-0": _state("decode-0", False, restarts=2, last_exit="exit code 1")})

    def host(unit: str) -> str:
        return f"{agent_name('pd', unit, 'n1')}.pd-agents.ns.svc"

    pre, dec = status["endpoints"]["prefill"], status["endpoints"]["decode"]
    assert [(x["replica"], x["url"], x["bootstrap"], x["ready"]) for x in pre] == [
        (0, f"http://{host('prefill-0')}:30000", f"{host('prefill-0')}:8998", True),
        (1, f"http://{host('prefill-1')}:30000", f"{host('prefill-1')}:8998", True),
    ]
    assert [(x["replica"], x["url"], x["ready"], x["engine"]) for x in dec] == [
        (0, f"http://{host('decode-0')}:31000", False, "decode-0")
    ]
    assert (dec[0]["phase"], dec[0]["restarts"], dec[0]["lastExit"]) == ("Starting", 2, "exit code 1")
    assert (pre[0]["phase"], pre[0]["restarts"], pre[0]["lastExit"]) == ("Running", 0, "")
    assert "container" not in dec[0]
    assert status["engines"]["decode"] == {"desired": 1, "ready": 0, "restarts": 2}
    assert "bootstrap" not in dec[0]
    assert status["services"] == {"prefill": "pd-prefill", "decode": "pd-decode"}


def test_an_engine_the_agent_does_not_list_is_not_ready() -> None:
    status = _engine_status({"prefill-0": None})
    (p0, _) = status["endpoints"]["prefill"]
    assert (p0["ready"], p0["phase"], p0["restarts"], p0["lastExit"]) == (False, "Unknown", 0, "")
    assert _cond(status, "EnginesReady")["status"] == "False"


def test_an_agent_not_ready_itself_is_not_ready_though_its_engines_are() -> None:
    status = _engine_status({}, agent_ready=False)
    assert status["agents"] == {"desired": 3, "ready": 0}
    assert (_cond(status, "Ready")["status"], _cond(status, "Ready")["reason"]) == ("False", "AgentsNotReady")
    assert _cond(status, "EnginesReady")["status"] == "True"


def test_an_unbound_pod_is_reported_with_the_schedulers_word() -> None:
    placement = _placement(BUILDER)
    pod = agent_name("pd", placement.agents[0].unit, placement.agents[0].node)
    word = "node a: 0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: x}"
    status = compute_status(
        Observed(1, BUILDER.spec(), placement, _views(placement, set()), unschedulable_pods={pod: word}), "pd"
    )
    conds = {c["type"]: c for c in status["conditions"]}
    message = f"the scheduler has not bound agent pod {pod} to its {word}"
    for kind in ("Ready", "Placed"):
        assert (conds[kind]["status"], conds[kind]["reason"], conds[kind]["message"]) == (
            "False",
            "PodUnschedulable",
            message,
        )
    assert conds["Degraded"]["reason"] == "AsRequested"


def test_agents_awaiting_their_turn_in_a_roll_still_serve() -> None:
    placement = _placement(BUILDER)
    old = [AgentView(agent_name("pd", a.unit, a.node), a.node, True, False, serving=True) for a in placement.agents]
    status = compute_status(Observed(1, BUILDER.spec(), placement, old), "pd")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "RollingUpdate")
    assert ready["message"].endswith("rolling update: 0/4 agents updated")
    assert (status["prefillReady"], status["decodeReady"]) == ("2/2", "2/2")


def test_rankmap_current_names_the_agents_behind_and_what_they_said() -> None:
    placement = _placement(BUILDER)
    views = _views(placement, {"a", "b"})
    names = [v.name for v in views]
    on = [dataclasses.replace(v, rankmap="new") for v in views]
    status = compute_status(Observed(1, BUILDER.spec(), placement, on, rankmap="new"), "pd")
    assert _conds(status)["RankMapCurrent"] == ("True", "AgentsCurrent")
    behind = [dataclasses.replace(v, rankmap="old") if v.name == names[1] else v for v in on]
    refused = "rank map new: the rank map moved its ranks (its pod is being replaced)"
    behind[2] = dataclasses.replace(behind[2], rankmap="old", rankmap_refused=refused)
    status = compute_status(Observed(1, BUILDER.spec(), placement, behind, rankmap="new"), "pd")
    cond = next(c for c in status["conditions"] if c["type"] == "RankMapCurrent")
    assert (cond["status"], cond["reason"]) == ("False", "AgentsBehind")
    first, second = sorted([names[1], names[2]])
    said = {names[1]: first, names[2]: f"{names[2]} ({refused})"}
    assert cond["message"] == (f"2 of 4 agents still run an older rank map than new: {said[first]}, {said[second]}")
    # Agents not read yet count neither way; a PDCluster not placed has no such condition.
    quiet = compute_status(Observed(1, BUILDER.spec(), placement, views, rankmap="new"), "pd")
    assert _conds(quiet)["RankMapCurrent"] == ("True", "AgentsCurrent")
    assert "RankMapCurrent" not in _conds(compute_status(Observed(1, BUILDER.spec(), placement, views), "pd"))


def test_agents_not_ready_say_why_in_the_ready_condition() -> None:
    placement = _placement(BUILDER)
    views = _views(placement, {"a"})
    slow = [
        dataclasses.replace(v, reason="Probing", message="2 of 4 peer ranks refused the link check: 403")
        if not v.ready
        else v
        for v in views
    ]
    status = compute_status(Observed(1, BUILDER.spec(), placement, slow), "pd")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    not_ready = sorted(v.name for v in slow if not v.ready)
    assert ready["status"] == "False"
    assert f"not ready: {not_ready[0]}: Probing: 2 of 4 peer ranks refused the link check: 403" in ready["message"]
