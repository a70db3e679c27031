"""Who a change wakes (operator_state.py): a node's change wakes the clusters with a pod on it and
every cluster not yet satisfied, never a satisfied cluster elsewhere; each wake-up's cause is kept
for the reconcile it starts (pdfabric_operator_reconcile_causes_total); how long a cluster waits
for an event before it reconciles anyway (a satisfied one without engines: the resync)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import kopf
import pytest

from pdfabric_operator.bookkeeping import Result
from pdfabric_operator.config import OperatorConfig
from pdfabric_operator.metrics import ReconcileResult, WakeCause
from pdfabric_operator.operator_state import OperatorState


def state(*uids: str) -> OperatorState:
    st = OperatorState()
    for uid in uids:
        st.wakers[uid] = asyncio.Event()
    return st


def woken(st: OperatorState) -> set[str]:
    return {uid for uid, event in st.wakers.items() if event.is_set()}


def test_a_node_change_wakes_its_users_and_the_unsatisfied_only() -> None:
    st = state("on-node", "elsewhere", "waiting")
    st.satisfied |= {"on-node", "elsewhere"}
    st.wake_for_node({"on-node", "not-reconciled-here"})
    assert woken(st) == {"on-node", "waiting"}
    assert st.take_causes("on-node") == {WakeCause.NODE}
    assert st.take_causes("elsewhere") == set()


def test_causes_gather_until_taken_and_unknown_clusters_are_ignored() -> None:
    st = state("a")
    st.wake("a", WakeCause.POD)
    st.wake("a", WakeCause.SPEC)
    st.wake("a", WakeCause.POD)
    st.wake("gone", WakeCause.POD)
    st.wake(None, WakeCause.POD)
    assert st.take_causes("a") == {WakeCause.POD, WakeCause.SPEC}
    assert st.take_causes("a") == set()
    assert "gone" not in st.causes


def test_satisfied_is_ready_placed_as_asked_with_nothing_to_report() -> None:
    ready = Result(ReconcileResult.READY, ready=True, placed=True)
    assert ready.satisfied
    assert not Result(ReconcileResult.PROGRESSING, placed=True).satisfied
    assert not Result(ReconcileResult.READY, ready=True, placed=False).satisfied
    assert not Result(ReconcileResult.READY, ready=True, placed=True, problem=("FallbackTCP", "tcp")).satisfied
    assert not Result(ReconcileResult.READY, ready=True, placed=True, unplaced={"decode": 1}).satisfied
    assert Result(ReconcileResult.READY, ready=True, placed=True, unplaced={"decode": 0}).satisfied


@pytest.mark.parametrize(
    ("satisfied", "engine", "cert_due_s", "expected"),
    [
        (False, False, None, (20.0, WakeCause.INTERVAL)),  # not Ready as asked: look again at the interval
        (True, True, None, (20.0, WakeCause.INTERVAL)),  # engines: read from /readyz, not watched
        (True, False, None, (300.0, WakeCause.RESYNC)),  # every change that matters to it is watched
        (True, False, 60.0, (60.0, WakeCause.CERTIFICATE)),  # woken when a peer certificate is due
        (True, False, 3600.0, (300.0, WakeCause.RESYNC)),
        (True, False, -5.0, (1.0, WakeCause.CERTIFICATE)),  # overdue: at once, not in a loop
    ],
)
def test_a_satisfied_cluster_without_engines_waits_for_the_resync_not_the_interval(
    monkeypatch: pytest.MonkeyPatch, satisfied: bool, engine: bool, cert_due_s: float | None, expected: tuple
) -> None:
    from pdfabric_operator import reconcile_loop
    from pdfabric_operator.operator_state import STATE

    monkeypatch.setattr(STATE, "config", OperatorConfig(reconcile_interval=20.0, resync_interval=300.0))
    body = kopf.Body({"spec": {"engine": {"image": "x"}} if engine else {}})  # type: ignore[typeddict-item]
    due = datetime.now(UTC) + timedelta(seconds=cert_due_s) if cert_due_s is not None else None
    interval, cause = reconcile_loop._period(satisfied, body, due)
    assert cause is expected[1] and interval == pytest.approx(expected[0], abs=1.0)


def test_the_resync_is_never_shorter_than_the_reconcile_interval() -> None:
    env = {"PDFABRIC_RECONCILE_INTERVAL": "30", "PDFABRIC_RESYNC_INTERVAL": "10", "PDFABRIC_PRIORITY": "1"}
    assert OperatorConfig.from_env(env).resync_interval == 30.0
    assert OperatorConfig.from_env({"PDFABRIC_PRIORITY": "1"}).resync_interval == 300.0


def test_an_agent_pod_wakes_its_cluster_only_when_what_a_reconcile_reads_of_it_changed() -> None:
    from pdfabric_operator.snapshot import OwnPod

    st = OperatorState()
    pod = OwnPod("a", "ns", "p1", "node-1", False, False, "h1", "r")
    assert st.agent_pod_changed("p1", pod)  # first seen
    assert not st.agent_pod_changed("p1", OwnPod("a", "ns", "p1", "node-1", False, False, "h1", "r"))  # a heartbeat
    assert st.agent_pod_changed("p1", OwnPod("a", "ns", "p1", "node-1", True, False, "h1", "r"))  # Ready now
    assert st.agent_pod_changed("p1", None) and "p1" not in st.agent_pod_views  # gone, and forgotten
