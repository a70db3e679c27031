"""The operator's process-wide state (one operator per process): its settings, the API client,
each PDCluster's wake-up event and reconcile memory, and what the agents last said. The kopf
handlers (main.py) and the loops they start share it."""

from __future__ import annotations

import asyncio
from typing import Any

from pdfabric_operator.agentstate import AgentReport, AgentTransport
from pdfabric_operator.bookkeeping import ClusterMemory
from pdfabric_operator.config import OperatorConfig
from pdfabric_operator.kube import Kube, load_configuration
from pdfabric_operator.metrics import WakeCause
from pdfabric_operator.roles import RolesMemory
from pdfabric_operator.snapshot import OwnPod


class OperatorState:
    """Process-wide state of the operator (one operator per process)."""

    def __init__(self) -> None:
        self.config = OperatorConfig()
        self.kube: Kube | None = None
        self.wakers: dict[str, asyncio.Event] = {}
        self.causes: dict[str, set[WakeCause]] = {}  # cluster uid -> why it was woken since its last reconcile
        # Clusters whose last reconcile found them Ready with every replica placed as asked: a node
        # they hold no pod on cannot change anything for them (it only matters to one waiting for room).
        self.satisfied: set[str] = set()
        self.memory: dict[str, ClusterMemory] = {}
        self.generations: dict[str, int] = {}
        self.transports: dict[str, dict[str, AgentTransport]] = {}  # cluster uid -> pod uid -> the agent's word
        self.reports: dict[str, dict[str, AgentReport]] = {}  # cluster uid -> pod uid -> its /readyz, last read
        self.silences: dict[str, dict[str, int]] = {}  # cluster uid -> pod uid -> its /readyz unanswered in a row
        self.node_prints: dict[str, tuple[Any, ...]] = {}
        self.agent_pod_views: dict[str, OwnPod] = {}  # pod uid -> the agent pod as a reconcile last could read it
        self.roles: dict[str, RolesMemory] = {}  # cluster uid -> its PDRoles' sync memory (roles.py)
        self.role_generations: dict[str, int] = {}  # PDRole uid -> the generation last seen
        self.metrics_started = False
        self.last_reconcile = 0.0

    def get_kube(self) -> Kube:
        if self.kube is None:
            self.kube = Kube.from_configuration(load_configuration())
        return self.kube

    def wake(self, uid: str | None, cause: WakeCause) -> None:
        event = self.wakers.get(uid or "")
        if event is not None:
            self.causes.setdefault(uid or "", set()).add(cause)
            event.set()

    def wake_for_node(self, users: set[str]) -> None:
        """A node's placement inputs changed (or it went): wake the clusters with a pod on it and
        every cluster not satisfied (waiting for room, falling back, unplaced, still starting)."""
        for uid in list(self.wakers):
            if uid in users or uid not in self.satisfied:
                self.wake(uid, WakeCause.NODE)

    def agent_pod_changed(self, pod_uid: str, view: OwnPod | None) -> bool:
        """Whether an agent pod's event changed anything a reconcile reads of it (`view`, None: the
        pod is gone). Status heartbeats and writes of fields the operator does not read wake nothing:
        at 2,000 pods they kept the operator half a core busy at rest."""
        if view is None:
            self.agent_pod_views.pop(pod_uid, None)
            return True
        if self.agent_pod_views.get(pod_uid) == view:
            return False
        self.agent_pod_views[pod_uid] = view
        return True

    def take_causes(self, uid: str) -> set[WakeCause]:
        """Why the cluster was woken since this was last asked (empty: its interval passed)."""
        return self.causes.pop(uid, set())


STATE = OperatorState()
