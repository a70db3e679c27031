"""Who a change wakes (operator_state.py): a node's change wakes the clusters with a pod on it and
every cluster not yet satisfied, never a satisfied cluster elsewhere; each wake-up's cause is kept
for the reconcile it starts (pdfabric_operator_reconcile_causes_total)."""

from __future__ import annotations

import asyncio

from pdfabric_operator.bookkeeping import Result
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
