"""reconcile_once against an in-memory API: steady state writes nothing, the ledger prevents
double-booking before the watch cache catches up, stale pods are replaced, no fit removes children."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role
from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.bookkeeping import ClusterMemory
from pdfabric_operator.builders.credentials import keypair_from_secret
from pdfabric_operator.builders.names import ClusterRef, agent_name, ca_secret_name, peer_tls_secret_name
from pdfabric_operator.kube import Refused
from pdfabric_operator.ledger import Ledger
from pdfabric_operator.metrics import ReconcileResult
from pdfabric_operator.placement import PlacedPod
from pdfabric_operator.reconcile import reconcile_once
from pdfabric_operator.snapshot import OwnPod, Snapshot
from tests.builders import gpu_node, pdcluster


class FakeKube:
    """Just enough of pdfabric_operator.kube.Kube, recording every call."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.status: dict[str, Any] = {}
        self.rv = 0

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        return self.objects.get((kind, namespace, name))

    def create(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.calls.append(("create", *key[::2]))
        if key in self.objects:
            return False
        self.objects[key] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        return True

    def replace(self, obj: dict[str, Any], resource_version: str) -> None:
        self.calls.append(("update", obj["kind"], obj["metadata"]["name"]))
        stored = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(int(resource_version) + 1)}}
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = stored

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        self.calls.append(("delete", kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    def annotate(
        self, kind: str, namespace: str, name: str, uid: str, annotations: dict[str, str], *, labels: bool = False
    ) -> bool:
        self.calls.append(("label" if labels else "annotate", kind, name))
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            return False
        field = "labels" if labels else "annotations"
        obj["metadata"][field] = {**obj["metadata"].get(field, {}), **annotations}
        return True

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("patch", "status", name))
        self.status.update(patch)
        self.rv += 1
        return {"metadata": {"resourceVersion": str(self.rv)}, "status": self.status}

    def pods(self, uid: str, ready: bool = True) -> list[OwnPod]:
        return [
            OwnPod(
                o["metadata"]["name"],
                o["metadata"]["namespace"],
                "pod-uid",
                o["metadata"]["annotations"]["pdfabric.dev/node"],
                ready,
                False,
                o["metadata"]["annotations"]["pdfabric.dev/pod-hash"],
                o["metadata"]["annotations"]["pdfabric.dev/ranks"],
                config_hash=o["metadata"]["annotations"]["pdfabric.dev/config-hash"],
                rankmap_hash=o["metadata"]["annotations"].get("pdfabric.dev/rankmap-hash", ""),
                budget=o["metadata"]["labels"].get("pdfabric.dev/disruption-budget", ""),
            )
            for (kind, _, _), o in self.objects.items()
            if kind == "Pod" and o["metadata"]["labels"]["pdfabric.dev/cluster-uid"] == uid
        ]


def _run(
    kube: FakeKube, ref: ClusterRef, builder: Any, snap: Snapshot, memory: ClusterMemory, ledger: Ledger, **kw: Any
):
    return reconcile_once(
        kube,
        ref,
        builder.raw_spec(),
        1,
        dict(kube.status),
        snap,
        memory,
        recheck_children_after=1e9,
        ledger=ledger,
        stored_rv=str(kube.rv),
        **kw,
    )


# The tests of one pod's life: an intra-node NVLink group (a prefill replica and the decode
# replicas it feeds) is one pod; other transports give each replica a pod of its own.
def one_pod() -> Any:
    return pdcluster().transport("nvlink-intra")


def test_converges_then_steady_state_makes_no_writes() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    first = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert first.result is ReconcileResult.PROGRESSING
    assert sorted(a.split()[1] for a in first.actions) == [
        "configmap",
        "engine-token",
        "networkpolicy",
        "pdb",
        "pdb",  # a PodDisruptionBudget per role
        "peer",
        "pod",
        "pod",  # prefill-0's and decode-0's
        "service",
    ]
    # Agents report Ready: one status write, then nothing at all.
    second = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert second.result is ReconcileResult.READY and second.patched and not second.actions
    kube.calls.clear()
    third = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert not third.patched and not third.actions
    assert [c for c in kube.calls if c[0] != "get"] == []


def test_ledger_prevents_double_booking_before_the_cache_catches_up() -> None:
    kube, ledger = FakeKube(), Ledger()
    nodes = [gpu_node("a", 8), gpu_node("b", 8)]
    builder = pdcluster().prefill(tp=4).decode(tp=4)
    # Neither cluster's pods are in the (empty) watch cache yet.
    for uid in ("u1", "u2"):
        _run(kube, ClusterRef("ns", f"pd-{uid}", uid), builder, Snapshot(nodes, [], []), ClusterMemory(), ledger)
    used = {
        (o["metadata"]["labels"]["pdfabric.dev/cluster-uid"], o["metadata"]["annotations"]["pdfabric.dev/node"])
        for (kind, _, _), o in kube.objects.items()
        if kind == "Pod"
    }
    assert sorted(used) == [("u1", "a"), ("u2", "b")], "two 8-GPU clusters must not share one 8-GPU node"


def test_foreign_pods_count_until_ledger_knows_the_owner() -> None:
    kube, ledger = FakeKube(), Ledger()
    nodes = [gpu_node("a", 8), gpu_node("b", 8)]
    cached = [PlacedPod("a", {"nvidia.com/gpu": 8}, None)]  # not a PDCluster's pod
    _run(
        kube,
        ClusterRef("ns", "pd", "u1"),
        pdcluster().prefill(tp=4).decode(tp=4),
        Snapshot(nodes, cached, []),
        ClusterMemory(),
        ledger,
    )
    pods = [o for (kind, _, _), o in kube.objects.items() if kind == "Pod"]
    assert [pod["metadata"]["annotations"]["pdfabric.dev/node"] for pod in pods] == ["b", "b"]


def test_stale_pod_is_replaced_and_unplaceable_removes_children() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, pdcluster(), Snapshot(nodes, [], []), memory, ledger)
    decode, old = kube.pods("u1")  # decode-0's pod, prefill-0's
    grown = pdcluster().prefill(tp=2)
    res = _run(kube, ref, grown, Snapshot(nodes, [], [decode, old]), memory, ledger)
    # prefill-0's ranks moved: its pod goes (same name, new hash: recreated next round); decode-0's stays.
    assert [a for a in res.actions if a.startswith(("delete pod", "create pod"))] == [f"delete pod {old.name}"]
    assert f"annotate pod {decode.name} with rank map {memory.last_rankmap_hash}" in res.actions  # told at once
    res = _run(kube, ref, grown, Snapshot(nodes, [], [decode]), memory, ledger)
    assert [a for a in res.actions if a.startswith(("delete pod", "create pod"))] == [f"create pod {old.name}"]
    too_big = pdcluster().prefill(tp=8).decode(tp=8)
    res = _run(kube, ref, too_big, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert res.result is ReconcileResult.UNPLACED
    assert kube.objects == {}
    assert kube.status["conditions"][1]["reason"] == "InsufficientGPUs"
    assert ledger.merged([], exclude_uid="") == []  # nothing recorded for an unplaced cluster


def test_replan_after_node_loss_is_stable_while_pods_are_replaced() -> None:
    # Regression: stickiness read from pods flipped ranks between two nodes while one pod was
    # being replaced (its deleting pod no longer counted, so the plan moved the other way).
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().prefill(replicas=2, tp=4).decode(replicas=1, tp=4)
    nodes = [gpu_node(n, 8) for n in "abc"]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    before = kube.pods("u1")
    victim = max(before, key=lambda p: len(p.ranks)).node
    nodes = [gpu_node(n, 8, ready=n != victim) for n in "abc"]
    _run(kube, ref, builder, Snapshot(nodes, [], before), memory, ledger)
    plan = dict(memory.last_plan or {})
    assert victim not in plan and sum(len(r) for r in plan.values()) == 12
    lingering = [OwnPod(p.name, p.namespace, p.uid, p.node, False, True, p.pod_hash, p.ranks) for p in before]
    for _ in range(3):
        res = _run(kube, ref, builder, Snapshot(nodes, [], lingering + kube.pods("u1")), memory, ledger)
        assert memory.last_plan == plan
        assert not [a for a in res.actions if a.startswith("delete pod")]


def test_status_written_by_someone_else_is_corrected() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, pdcluster(), Snapshot(nodes, [], []), memory, ledger)
    _run(kube, ref, pdcluster(), Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert kube.status["conditions"][0]["status"] == "True"
    # A stale writer (say, a replica on its way out) overwrites Ready; the object changed under us.
    kube.status["conditions"] = [dict(c, status="False") for c in kube.status["conditions"]]
    kube.rv += 1
    res = _run(kube, ref, pdcluster(), Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert res.patched
    assert kube.status["conditions"][0]["status"] == "True"


def test_failed_agent_is_replaced() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, one_pod(), Snapshot(nodes, [], []), memory, ledger)
    (pod,) = kube.pods("u1")
    failed = OwnPod(pod.name, pod.namespace, pod.uid, pod.node, False, False, pod.pod_hash, pod.ranks, failed=True)
    res = _run(kube, ref, one_pod(), Snapshot(nodes, [], [failed]), memory, ledger)
    assert res.actions == [f"delete pod {pod.name}"]
    assert kube.status["agents"] == {"desired": 1, "ready": 0}


# (id, cached pods, ledger usage of "other", expected GPUs held by "other" per node)
MERGE_CASES = [
    ("cache-only-for-unknown-owner", [PlacedPod("a", {"g": 4}, "other")], None, {"a": 4}),
    ("ledger-ahead-of-cache", [], {"b": {"g": 8}}, {"b": 8}),
    ("terminating-old-pod-still-counts", [PlacedPod("a", {"g": 8}, "other")], {"b": {"g": 8}}, {"a": 8, "b": 8}),
    ("bigger-of-the-two", [PlacedPod("a", {"g": 4}, "other")], {"a": {"g": 8}}, {"a": 8}),
    ("own-cluster-excluded", [PlacedPod("a", {"g": 4}, "me")], None, {}),
]


@pytest.mark.parametrize(("cached", "usage", "expected"), [c[1:] for c in MERGE_CASES], ids=[c[0] for c in MERGE_CASES])
def test_ledger_merge(cached, usage, expected) -> None:
    ledger = Ledger()
    if usage is not None:
        ledger.record("other", usage)
    ledger.record("me", {"z": {"g": 1}})
    held: dict[str, int] = {}
    for pod in ledger.merged(cached, exclude_uid="me"):
        assert pod.owner_uid != "me"
        held[pod.node] = held.get(pod.node, 0) + pod.requests.get("g", 0)
    assert held == expected


def test_image_change_rolls_one_agent_at_a_time() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node(n, 8) for n in "abc"]
    old = pdcluster().prefill(replicas=2, tp=8).decode(tp=8)
    _run(kube, ref, old, Snapshot(nodes, [], []), memory, ledger)
    pods = kube.pods("u1")
    assert len(pods) == 3
    new = pdcluster().prefill(replicas=2, tp=8).decode(tp=8).agent(image="pdfabric/agent:v2")
    res = _run(kube, ref, new, Snapshot(nodes, [], pods), memory, ledger)
    rolled = [a for a in res.actions if a.endswith("(rolling)")]
    # The rank map (it holds the spec) is updated too, and the pods told of it.
    assert len(rolled) == 1 and [a for a in res.actions if a.startswith(("delete pod", "create pod"))] == rolled
    first = rolled[0].split()[2]
    # While the replaced agent is gone or not Ready, nobody else is touched.
    waiting = [p for p in kube.pods("u1") if p.name != first]  # as the pod index holds them now
    res = _run(kube, ref, new, Snapshot(nodes, [], waiting), memory, ledger)
    assert res.actions == [f"create pod {first}"]
    not_ready = [p if p.name != first else dataclasses.replace(p, ready=False) for p in kube.pods("u1")]
    assert not _run(kube, ref, new, Snapshot(nodes, [], not_ready), memory, ledger).actions
    # Replacement Ready: the next one goes.
    res = _run(kube, ref, new, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    (second,) = [a for a in res.actions if a.endswith("(rolling)")]
    assert second.split()[2] != first


def _ready(kube: FakeKube) -> tuple[str, str, str]:
    (ready,) = [c for c in kube.status["conditions"] if c["type"] == "Ready"]
    return ready["status"], ready["reason"], ready["message"]


def test_ready_stays_true_while_old_pods_serve_a_rolling_update() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node(n, 8) for n in "ab"]
    old = pdcluster().prefill(tp=8).decode(tp=8)
    _run(kube, ref, old, Snapshot(nodes, [], []), memory, ledger)
    pods = kube.pods("u1")
    _run(kube, ref, old, Snapshot(nodes, [], pods), memory, ledger)
    assert _ready(kube)[:2] == ("True", "AgentsReady")
    new = pdcluster().prefill(tp=8).decode(tp=8).agent(image="pdfabric/agent:v2")
    res = _run(kube, ref, new, Snapshot(nodes, [], pods), memory, ledger)
    assert _ready(kube) == ("True", "RollingUpdate", "2/2 agents ready on tcp; rolling update: 0/2 agents updated")
    first = next(a for a in res.actions if a.endswith("(rolling)")).split()[2]
    # The one being replaced does not serve: Ready is False until its successor is.
    gone = [p for p in pods if p.name != first]
    _run(kube, ref, new, Snapshot(nodes, [], gone), memory, ledger)
    assert _ready(kube)[:2] == ("False", "AgentsNotReady")
    _run(kube, ref, new, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert _ready(kube) == ("True", "RollingUpdate", "2/2 agents ready on tcp; rolling update: 1/2 agents updated")


def test_agents_on_other_settings_do_not_count_as_serving() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node(n, 8) for n in "ab"]
    old = pdcluster().prefill(tp=8).decode(tp=8)
    _run(kube, ref, old, Snapshot(nodes, [], []), memory, ledger)
    pods = kube.pods("u1")
    # Another model geometry: old and new agents would not agree on a page, so they do not serve.
    new = pdcluster().prefill(tp=8).decode(tp=8).model(layers=61)
    _run(kube, ref, new, Snapshot(nodes, [], pods), memory, ledger)
    assert _ready(kube)[:2] == ("False", "AgentsNotReady")


def _cert_serial(kube: FakeKube, agent: str) -> str:
    secret = kube.objects[("Secret", "ns", peer_tls_secret_name(agent))]
    return str(secret["metadata"]["annotations"]["pdfabric.dev/cert-serial"])


def test_each_new_agent_pod_gets_a_new_certificate_and_a_gone_agent_leaves_none() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    (pod,) = kube.pods("u1")
    first = _cert_serial(kube, pod.name)
    ca = kube.objects[("Secret", "ns", ca_secret_name("pd"))]
    # Steady state: nothing is re-issued.
    _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert _cert_serial(kube, pod.name) == first
    # The pod is replaced (deleted, by anyone): the new pod comes with a new certificate, same CA.
    kube.objects.pop(("Pod", "ns", pod.name))
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert ("Pod", "ns", pod.name) in kube.objects
    assert _cert_serial(kube, pod.name) != first
    assert kube.objects[("Secret", "ns", ca_secret_name("pd"))] is ca
    # No node fits any more: the pods go, and so do their certificates.
    _run(kube, ref, builder, Snapshot([], [], kube.pods("u1")), memory, ledger)
    assert ("Secret", "ns", peer_tls_secret_name(pod.name)) not in kube.objects


def test_network_policy_follows_the_operator_settings() -> None:
    """Settings change with an operator restart (a fresh memory): the policy is updated or deleted."""
    kube, ledger = FakeKube(), Ledger()
    ref = ClusterRef("ns", "pd", "u1")
    builder, nodes = pdcluster().prefill(tp=4).decode(tp=4), [gpu_node("a", 8)]
    key = ("NetworkPolicy", "ns", "pd-agents")

    def run(**kw: Any) -> list[str]:
        return _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), ClusterMemory(), ledger, **kw).actions

    assert "create networkpolicy" in run()
    assert "from" not in kube.objects[key]["spec"]["ingress"][1]  # metrics from anywhere
    assert "networkpolicy" not in " ".join(run())  # unchanged: left alone
    assert "update networkpolicy" in run(monitoring_namespace="monitoring")
    (source,) = kube.objects[key]["spec"]["ingress"][1]["from"]
    assert source == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert "delete networkpolicy (turned off)" in run(network_policy=False)
    assert key not in kube.objects
    assert "networkpolicy" not in " ".join(run(network_policy=False))


def test_a_namesake_network_policy_is_never_replaced_or_deleted() -> None:
    kube, ledger = FakeKube(), Ledger()
    ref = ClusterRef("ns", "pd", "u1")
    theirs = {"kind": "NetworkPolicy", "metadata": {"name": "pd-agents", "namespace": "ns"}, "spec": {"x": 1}}
    kube.objects[("NetworkPolicy", "ns", "pd-agents")] = theirs
    for kw in ({"monitoring_namespace": "monitoring"}, {"network_policy": False}):
        snap = Snapshot([gpu_node("a", 8)], [], [])
        _run(kube, ref, pdcluster().prefill(tp=4).decode(tp=4), snap, ClusterMemory(), ledger, **kw)
        assert kube.objects[("NetworkPolicy", "ns", "pd-agents")] is theirs


# --- spec.engine: the agents' word on their engines ----------------------------------------------


def _report(ready: bool = True, **restarts: int) -> AgentReport:
    engines = {"prefill-0": ("prefill", 0), "decode-0": ("decode", 0)}
    states = {
        name: EngineState(
            name,
            Role(role),
            rep,
            "Running",
            True,
            restarts.get(name.replace("-", "_"), 0),
            7,
            "exit code 1",
            sandboxed=name.startswith("decode"),
        )
        for name, (role, rep) in engines.items()
    }
    return AgentReport(ready, None, states)


def test_engine_readiness_and_the_agents_own_come_from_readyz() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().engine()
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    pods = kube.pods("u1")
    # Not read: pod Ready says the agent's readiness, the engines are not ready.
    res = _run(kube, ref, builder, Snapshot(nodes, [], pods), memory, ledger)
    assert kube.status["engines"]["prefill"] == {"desired": 1, "ready": 0, "restarts": 0}
    assert kube.status["agents"] == {"desired": 1, "ready": 1}
    assert res.result != ReconcileResult.READY
    # Read: the engines' word; the agent's own `ready` rather than the pod's.
    res = _run(kube, ref, builder, Snapshot(nodes, [], pods, reports={"pod-uid": _report()}), memory, ledger)
    assert res.result == ReconcileResult.READY
    assert kube.status["endpoints"]["decode"][0]["phase"] == "Running"
    # Each engine's sandbox as its agent reports it.
    assert [kube.status["endpoints"][r][0]["sandboxed"] for r in ("prefill", "decode")] == [False, True]
    not_ready = {"pod-uid": _report(ready=False)}
    _run(kube, ref, builder, Snapshot(nodes, [], pods, reports=not_ready), memory, ledger)
    assert kube.status["agents"] == {"desired": 1, "ready": 0}


def test_engine_restarts_emit_one_event_per_growth() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().engine()
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)  # no pods yet: any pod is new
    pods = kube.pods("u1")

    def events(**restarts: int) -> list[tuple[str, str]]:
        snap = Snapshot(nodes, [], pods, reports={"pod-uid": _report(**restarts)})
        return _run(kube, ref, builder, snap, memory, ledger).events

    # A pod started since the operator watched: its engines count from 0.
    (event,) = events(decode_0=1)
    assert event[0] == "EngineRestarted"
    assert event[1] == f"engine decode-0 in pod {pods[0].name} restarted (1 restarts; last exit: exit code 1)"
    assert events(decode_0=1) == []  # the same count: nothing new
    assert [e[1].split()[1] for e in events(decode_0=2, prefill_0=1)] == ["decode-0", "prefill-0"]
    assert kube.status["engines"]["decode"]["restarts"] == 2
    # A pod that ran before the operator's memory of the cluster began: its first reading is a baseline.
    fresh = ClusterMemory()
    snap = Snapshot(nodes, [], pods, reports={"pod-uid": _report(decode_0=5)})
    assert _run(kube, ref, builder, snap, fresh, ledger).events == []
    snap = Snapshot(nodes, [], pods, reports={"pod-uid": _report(decode_0=6)})
    assert len(_run(kube, ref, builder, snap, fresh, ledger).events) == 1


def test_peer_certificates_are_renewed_in_place_two_thirds_through() -> None:
    import datetime

    from pdfabric_operator import pki

    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    valid = datetime.timedelta(days=30)
    clock = [datetime.datetime.now(datetime.UTC)]
    kw: dict[str, Any] = {"cert_valid_for": valid, "now": lambda: clock[0]}
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger, **kw)
    (name,) = [n for (kind, _, n) in kube.objects if kind == "Pod"]
    secret_key = ("Secret", "ns", peer_tls_secret_name(name))

    def serial() -> str:
        return str(kube.objects[secret_key]["metadata"]["annotations"]["pdfabric.dev/cert-serial"])

    first = serial()
    leaf = keypair_from_secret(kube.objects[secret_key])
    assert pki.not_after(leaf.cert_pem) - clock[0] <= valid
    due = pki.renewal_time(leaf.cert_pem)
    assert abs(due - (clock[0] + valid * 2 / 3)) < datetime.timedelta(seconds=5)
    clock[0] = due - datetime.timedelta(seconds=10)
    early = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger, **kw)
    assert serial() == first and not early.notices
    clock[0] = due + datetime.timedelta(seconds=1)
    res = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger, **kw)
    assert res.actions == [f"renew certificate of {name}"]
    assert [r for r, _ in res.notices] == ["PeerCertificateRenewed"]
    assert serial() != first and ("Pod", "ns", name) in kube.objects  # in place: the pod stays
    again = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger, **kw)
    assert not again.actions  # not renewed at every reconcile
    # An operator that restarts (no memory) reads when each certificate is due from its Secret.
    kube.calls.clear()
    fresh = ClusterMemory()
    restarted = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), fresh, ledger, **kw)
    assert not restarted.notices and ("get", "Secret", peer_tls_secret_name(name)) in kube.calls
    # A Secret that is gone is issued again for the running pod.
    del kube.objects[secret_key]
    fresh = ClusterMemory()
    lost = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), fresh, ledger, **kw)
    assert lost.actions == [f"renew certificate of {name}"] and secret_key in kube.objects


def test_spec_router_is_created_read_for_readiness_replaced_when_engines_move_and_removed() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().engine().router()
    nodes = [gpu_node("a", 8)]
    first = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert {"create deployment pd-router", "create service pd-router"} <= set(first.actions)
    reports = {"pod-uid": _report()}
    res = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    # Engines ready, router not yet: not Ready, and the status says why.
    assert res.result != ReconcileResult.READY
    assert kube.status["router"] == {
        "service": "pd-router", "url": "http://pd-router.ns.svc:8000", "replicas": 1, "readyReplicas": 0,
        "ready": "0/1",
    }  # fmt: skip
    assert kube.status["conditions"][0]["reason"] == "RouterNotReady"
    dep = kube.objects[("Deployment", "ns", "pd-router")]
    dep["status"] = {"readyReplicas": 1}
    res = _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    assert res.result == ReconcileResult.READY and kube.status["router"]["ready"] == "1/1"
    assert not res.actions  # steady: nothing rewritten
    # spec.router changes: the Deployment is replaced (it rolls); gone: both are deleted.
    changed = pdcluster().engine().router(args=["--policy", "random"])
    res = _run(kube, ref, changed, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    assert "update deployment pd-router" in res.actions
    assert kube.objects[("Deployment", "ns", "pd-router")]["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == [
        "--policy", "random",
    ]  # fmt: skip
    off = pdcluster().engine()
    res = _run(kube, ref, off, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    assert {"delete deployment pd-router (no router)", "delete service pd-router (no router)"} <= set(res.actions)
    assert "router" not in kube.status or kube.status["router"] is None
    kube.calls.clear()
    _run(kube, ref, off, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    assert ("get", "Deployment", "pd-router") not in kube.calls  # checked gone once, not every reconcile


class RefusingKube(FakeKube):
    """An API server whose admission (Pod Security here) refuses every Pod."""

    REFUSAL = 'pods "pd-a" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true'

    def create(self, obj: dict[str, Any]) -> bool:
        if obj["kind"] == "Pod":
            self.calls.append(("create", "Pod", obj["metadata"]["name"]))
            raise Refused(403, self.REFUSAL)
        return super().create(obj)


def test_a_refused_agent_pod_is_reported_and_tried_again() -> None:
    kube, ledger, memory = RefusingKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    res = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    (ready,) = [c for c in kube.status["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PodRejected")
    name = agent_name("pd", "group-0", "a")
    assert ready["message"] == f"the API server refused agent pod {name}: {RefusingKube.REFUSAL}"
    assert res.problem == ("PodRejected", ready["message"])  # the Event
    assert not any(a.startswith("create pod") for a in res.actions)
    again = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert (
        again.problem == res.problem
        and [c for c in kube.calls if c[:2] == ("create", "Pod")] == [("create", "Pod", name)] * 2
    )
    # Once admission lets it in (the namespace's level changed), the condition goes.
    kube.__class__ = FakeKube
    third = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert f"create pod {name}" in third.actions and third.problem is None
    (ready,) = [c for c in kube.status["conditions"] if c["type"] == "Ready"]
    assert ready["reason"] != "PodRejected"


def test_an_agent_pod_the_scheduler_does_not_bind_is_reported() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    word = "0/1 nodes are available: 1 Insufficient cpu."
    pending = [dataclasses.replace(p, ready=False, unschedulable=word) for p in kube.pods("u1")]
    res = _run(kube, ref, builder, Snapshot(nodes, [], pending), memory, ledger)
    name = agent_name("pd", "group-0", "a")
    (ready,) = [c for c in kube.status["conditions"] if c["type"] == "Ready"]
    assert (ready["reason"], ready["message"]) == (
        "PodUnschedulable",
        f"the scheduler has not bound agent pod {name} to its node a: {word}",
    )
    assert res.problem == ("PodUnschedulable", ready["message"])
    assert not res.actions, "the pod stays: the scheduler binds it once it fits"
    # A spec that changes the pod (smaller requests) replaces an unbound pod at once: no roll waits on it.
    smaller = builder.agent(resources={"requests": {"cpu": "1"}})
    fixed = _run(kube, ref, smaller, Snapshot(nodes, [], pending), memory, ledger)
    assert f"delete pod {name}" in fixed.actions
    _run(kube, ref, smaller, Snapshot(nodes, [], []), memory, ledger)  # the pod gone: created anew
    bound = _run(kube, ref, smaller, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert bound.problem is None and bound.result is ReconcileResult.READY, kube.status["conditions"]


def test_unplaceable_deletes_only_the_children_it_owns() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, pdcluster(), Snapshot(nodes, [], []), memory, ledger)
    # A user's own objects that carry names of this cluster's children (never created here: no
    # spec.engine, no spec.router), and one of another cluster's.
    mine = {"kind": "Service", "metadata": {"name": "pd-prefill", "namespace": "ns"}}
    theirs = {
        "kind": "Deployment",
        "metadata": {"name": "pd-router", "namespace": "ns", "ownerReferences": [{"uid": "u2"}]},
    }
    for obj in (mine, theirs):
        kube.objects[(obj["kind"], "ns", obj["metadata"]["name"])] = obj
    too_big = pdcluster().prefill(tp=8).decode(tp=8)
    res = _run(kube, ref, too_big, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert res.result is ReconcileResult.UNPLACED
    assert set(kube.objects) == {("Service", "ns", "pd-prefill"), ("Deployment", "ns", "pd-router")}
    assert not [
        c for c in kube.calls if c[0] == "delete" and c[1:] in (("Service", "pd-prefill"), ("Deployment", "pd-router"))
    ]


def test_result_carries_ready_and_placed_for_the_gauges() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    first = _run(kube, ref, pdcluster(), Snapshot(nodes, [], []), memory, ledger)
    assert (first.ready, first.placed) == (False, True)
    second = _run(kube, ref, pdcluster(), Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert (second.ready, second.placed) == (True, True)
    unplaced = _run(kube, ref, pdcluster().prefill(tp=8).decode(tp=8), Snapshot(nodes, [], []), memory, ledger)
    assert (unplaced.ready, unplaced.placed) == (False, False)


def test_an_unbound_agent_pod_holds_its_planned_nodes_gpus_in_the_index() -> None:
    from pdfabric_operator import main

    planned = {"pdfabric.dev/node": "a"}
    ours = {"app.kubernetes.io/managed-by": "pdfabric-operator", "pdfabric.dev/cluster-uid": "u1"}
    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}]}
    held = main.gpu_pods(spec=spec, status={"phase": "Pending"}, labels=ours, annotations=planned)
    assert held == {"a": PlacedPod("a", {"nvidia.com/gpu": 4}, "u1")}
    # Someone else's unbound pod holds nothing yet (the scheduler decides where it goes).
    assert main.gpu_pods(spec=spec, status={"phase": "Pending"}, labels={}, annotations=planned) is None
    bound = main.gpu_pods(spec={**spec, "nodeName": "b"}, status={"phase": "Running"}, labels={}, annotations={})
    assert bound == {"b": PlacedPod("b", {"nvidia.com/gpu": 4}, None)}


def test_membership_is_unsettled_only_while_an_agent_that_answered_runs_an_older_rank_map() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = one_pod()
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    pods = kube.pods("u1")
    current = memory.last_rankmap_hash
    assert current

    def settled(**report: Any) -> bool:
        snap = Snapshot(nodes, [], pods, reports={"pod-uid": AgentReport(True, **report)} if report else {})
        _run(kube, ref, builder, snap, memory, ledger)
        return memory.membership_settled

    assert settled()  # not read yet: counted neither way, read again at the usual pace
    assert not settled(rankmap="0123456789abcdef")  # behind: the operator looks again soon
    cond = next(x for x in kube.status["conditions"] if x["type"] == "RankMapCurrent")
    assert (cond["status"], cond["reason"]) == ("False", "AgentsBehind")
    assert settled(rankmap=current)


@pytest.mark.parametrize("decode", [4, 1024])
def test_a_scale_step_past_the_nodes_keeps_every_pod_and_the_rank_map_and_reports_the_rest(decode: int) -> None:
    """Issue 40: decode scaled one past four one-GPU nodes (or to 1,024) of a running engine
    cluster: no pod deleted or created, no child rewritten, the rank map byte for byte the same;
    status says what is placed and why not the rest; scaling back clears it."""
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node(n, 1) for n in "abcd"]
    fits = pdcluster().transport("tcp").engine().router().decode(replicas=3)
    _run(kube, ref, fits, Snapshot(nodes, [], []), memory, ledger)
    reports = {"pod-uid": _report()}
    kube.objects[("Deployment", "ns", "pd-router")]["status"] = {"readyReplicas": 1}
    steady = _run(kube, ref, fits, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    children = {k: dict(v) for k, v in kube.objects.items() if k[0] != "Pod"}
    pods = {p.name: p.pod_hash for p in kube.pods("u1")}
    rankmap = memory.last_rankmap_hash
    kube.calls.clear()
    over = pdcluster().transport("tcp").engine().router().decode(replicas=decode)
    res = _run(kube, ref, over, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    writes = [c for c in kube.calls if c[0] not in ("get", "patch")]
    assert writes == [], writes
    assert {p.name: p.pod_hash for p in kube.pods("u1")} == pods
    assert {k: v for k, v in kube.objects.items() if k[0] != "Pod"} == children
    assert memory.last_rankmap_hash == rankmap
    assert (res.result, res.ready, res.placed) == (steady.result, steady.ready, True)
    assert res.unplaced == {"prefill": 0, "decode": decode - 3}
    assert res.problem is not None and res.problem[0] == "InsufficientGPUs"
    status = kube.status
    assert status["decode"] == {"desired": decode, "placed": 3, "ready": 3}
    assert status["decodeReady"] == f"3/{decode}"
    assert status["unplaced"]["decode"] == decode - 3 and status["unplaced"]["reason"] == "InsufficientGPUs"
    conditions = {x["type"]: x for x in status["conditions"]}
    assert conditions["Placed"]["status"] == "True" and conditions["Placed"]["reason"] == "PartiallyPlaced"
    assert conditions["Placed"]["message"].startswith(f"3 of {decode} decode replicas placed: ")
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "InsufficientGPUs"
    assert f"3 of {decode} decode replicas placed" in conditions["Ready"]["message"]
    assert status["engines"]["decode"]["desired"] == 3, "the engines of the replicas placed"
    # An operator restarted meanwhile plans from the rank map on record: the same, no writes.
    kube.calls.clear()
    restarted = ClusterMemory()
    _run(kube, ref, over, Snapshot(nodes, [], kube.pods("u1"), reports=reports), restarted, Ledger())
    assert [c for c in kube.calls if c[0] not in ("get", "patch")] == []
    assert restarted.last_rankmap_hash == rankmap
    # Scaled back: the shortfall is gone, nothing else changes.
    kube.calls.clear()
    res = _run(kube, ref, fits, Snapshot(nodes, [], kube.pods("u1"), reports=reports), memory, ledger)
    assert [c for c in kube.calls if c[0] not in ("get", "patch")] == []
    assert res.unplaced == {} and kube.status.get("unplaced") is None
    assert {x["type"]: x["reason"] for x in kube.status["conditions"]}["Placed"] == "Placed"


def test_ready_holds_while_every_placed_replica_serves_and_some_wait_for_room() -> None:
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node(n, 1) for n in "abcd"]
    _run(kube, ref, pdcluster().decode(replicas=3), Snapshot(nodes, [], []), memory, ledger)
    res = _run(kube, ref, pdcluster().decode(replicas=4), Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    assert res.result is ReconcileResult.READY and res.ready
    ready = kube.status["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "PartiallyPlaced")
    assert ready["message"].startswith("4/4 agents ready on tcp; 3 of 4 decode replicas placed: ")


def test_a_rank_map_configmap_written_over_is_put_back_at_the_next_check() -> None:
    """Someone writes the ConfigMap's data (a bad kubectl edit; its hash annotation stays): the
    agents keep their map and say so; the operator restores the rank map at its next check."""
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    _run(kube, ref, builder, Snapshot(nodes, [], kube.pods("u1")), memory, ledger)
    key = next(k for k in kube.objects if k[0] == "ConfigMap")
    good = dict(kube.objects[key]["data"])
    kube.objects[key]["data"] = {"rankmap.json": "[1, 2]"}
    snap = Snapshot(nodes, [], kube.pods("u1"))
    kept = _run(kube, ref, builder, snap, memory, ledger)
    assert kept.actions == [], "between checks nothing is read"
    out = reconcile_once(
        kube, ref, builder.raw_spec(), 1, dict(kube.status), snap, memory, recheck_children_after=0, ledger=ledger,
        stored_rv=str(kube.rv),
    )  # fmt: skip
    assert out.actions == ["restore configmap (its data was not the rank map)"]
    assert kube.objects[key]["data"] == good


@pytest.mark.parametrize("data", [None, {}, {"rankmap.json": "[1, 2]"}], ids=["no-data", "no-key", "not-a-map"])
def test_an_operator_restarted_over_a_rank_map_configmap_written_over_plans_from_the_pods(data: Any) -> None:
    """A fresh operator reads its last plan from the rank-map ConfigMap; one whose data someone
    removed or wrote over is no plan (it raised TypeError without data): the running pods are,
    none of them moves, and the ConfigMap is put back."""
    kube, ledger = FakeKube(), Ledger()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, builder, Snapshot(nodes, [], []), ClusterMemory(), ledger)
    pods = kube.pods("u1")
    key = next(k for k in kube.objects if k[0] == "ConfigMap")
    good = dict(kube.objects[key]["data"])
    kube.objects[key]["data"] = data
    out = _run(kube, ref, builder, Snapshot(nodes, [], pods), ClusterMemory(), Ledger())
    assert not [a for a in out.actions if "pod" in a.split()[:2]], out.actions
    assert kube.objects[key]["data"] == good


def _issuer_is(kube: FakeKube, agent: str, ca_name: str) -> bool:
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate(keypair_from_secret(kube.objects[("Secret", "ns", agent)]).cert_pem)
    ca = keypair_from_secret(kube.objects[("Secret", "ns", ca_name)])
    return leaf.issuer == x509.load_pem_x509_certificate(ca.cert_pem).subject


@pytest.mark.parametrize("router", [False, True], ids=["fabric", "engines-and-router"])
def test_a_new_cluster_makes_its_children_without_reading_any_first(router: bool) -> None:
    # Issue 47: a PDCluster never reconciled has nothing to read back. Each child is one create,
    # and the peer CA is made once and signs every agent's certificate without being read again.
    kube, ledger, memory = FakeKube(), Ledger(), ClusterMemory()
    ref = ClusterRef("ns", "pd", "u1")
    builder = pdcluster().prefill(replicas=2, tp=2).decode(replicas=2, tp=2)
    if router:
        builder = builder.engine().router()
    nodes = [gpu_node(n, 4) for n in "ab"]
    first = _run(kube, ref, builder, Snapshot(nodes, [], []), memory, ledger)
    assert [call for call in kube.calls if call[0] == "get"] == []
    pods = kube.pods("u1")
    assert len(pods) == 4 and ("create", "Secret", ca_secret_name("pd")) in kube.calls
    assert all(_issuer_is(kube, peer_tls_secret_name(p.name), ca_secret_name("pd")) for p in pods)
    assert ({"create deployment pd-router", "create service pd-router"} <= set(first.actions)) == router
    # Once its status is written it is no longer new: the next look at its children reads them.
    kube.calls.clear()
    memory.last_rankmap_hash = None  # due for its periodic check
    _run(kube, ref, builder, Snapshot(nodes, [], pods), memory, ledger)
    assert ("get", "ConfigMap", "pd-rankmap") in kube.calls
    assert [call for call in kube.calls if call[0] == "create"] == []


def test_children_left_by_a_run_cut_short_are_read_and_corrected_not_made_twice() -> None:
    # The operator died after making the children, before its first status write: the cluster
    # looks new again. Each create answers 409; the child is then read and compared as usual.
    kube, ledger = FakeKube(), Ledger()
    ref = ClusterRef("ns", "pd", "u1")
    nodes = [gpu_node("a", 8)]
    _run(kube, ref, pdcluster().prefill(tp=2), Snapshot(nodes, [], []), ClusterMemory(), ledger)
    stale_map = kube.objects[("ConfigMap", "ns", "pd-rankmap")]
    ca_secret = kube.objects[("Secret", "ns", ca_secret_name("pd"))]
    kube.status.clear()  # the status write of that run never happened
    for key in [k for k in kube.objects if k[0] == "Pod"]:
        del kube.objects[key]  # nor did its pods survive: made again, with new certificates
    memory = ClusterMemory()
    res = _run(kube, ref, pdcluster().prefill(tp=4), Snapshot(nodes, [], []), memory, ledger)
    assert "update configmap" in res.actions
    assert kube.objects[("ConfigMap", "ns", "pd-rankmap")]["data"] != stale_map["data"]
    assert kube.objects[("Secret", "ns", ca_secret_name("pd"))] is ca_secret  # the CA on record stays
    pods = kube.pods("u1")
    assert pods and all(_issuer_is(kube, peer_tls_secret_name(p.name), ca_secret_name("pd")) for p in pods)


def test_a_reconcile_serializes_its_rank_map_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each new pod is stamped with the map's digest; computed per pod, a cluster of 1,024 pods
    # serialized its 8,192-rank map 1,024 times (23 s of its first reconcile).
    from pdfabric_core.rankmap import RankMap

    calls = []
    to_json = RankMap.to_json
    monkeypatch.setattr(RankMap, "to_json", lambda self: calls.append(1) or to_json(self))
    builder = pdcluster().prefill(replicas=16, tp=2).decode(replicas=16, tp=2)
    nodes = [gpu_node(f"n{i}", 4) for i in range(16)]
    res = _run(FakeKube(), ClusterRef("ns", "pd", "u1"), builder, Snapshot(nodes, [], []), ClusterMemory(), Ledger())
    assert sum(a.startswith("create pod") for a in res.actions) == 32
    assert len(calls) <= 3, f"the rank map serialized {len(calls)} times for one reconcile"


def test_a_large_clusters_new_pods_are_created_a_bounded_number_at_a_time() -> None:
    # The largest PDCluster's 1,024 pods and certificates one after another were most of its
    # minute to Ready; at most CREATE_CONCURRENCY in flight, every pod made once.
    import threading
    import time

    from pdfabric_operator.reconcile import CREATE_CONCURRENCY

    class SlowKube(FakeKube):
        def __init__(self) -> None:
            super().__init__()
            self.lock, self.in_flight, self.most = threading.Lock(), 0, 0

        def create(self, obj: dict[str, Any]) -> bool:
            with self.lock:
                self.in_flight += 1
                self.most = max(self.most, self.in_flight)
            time.sleep(0.01)  # a round trip
            try:
                with self.lock:
                    return super().create(obj)
            finally:
                with self.lock:
                    self.in_flight -= 1

    kube = SlowKube()
    builder = pdcluster().prefill(replicas=16, tp=2).decode(replicas=16, tp=2)
    nodes = [gpu_node(f"n{i}", 4) for i in range(16)]
    ref = ClusterRef("ns", "pd", "u1")
    res = _run(kube, ref, builder, Snapshot(nodes, [], []), ClusterMemory(), Ledger())
    created = [a.split()[-1] for a in res.actions if a.startswith("create pod")]
    assert len(created) == len(set(created)) == 32
    assert 1 < kube.most <= CREATE_CONCURRENCY
    assert all(_issuer_is(kube, peer_tls_secret_name(name), ca_secret_name("pd")) for name in created)
