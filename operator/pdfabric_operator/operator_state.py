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
from pdfabric_operator.roles import RolesMemory


class OperatorState:
    """Process-wide state of the operator (one operator per process)."""

    def __init__(self) -> None:
        self.config = OperatorConfig()
        self.kube: Kube | None = None
        self.wakers: dict[str, asyncio.Event] = {}
        self.memory: dict[str, ClusterMemory] = {}
        self.generations: dict[str, int] = {}
        self.transports: dict[str, dict[str, AgentTransport]] = {}  # cluster uid -> pod uid -> the agent's word
        self.reports: dict[str, dict[str, AgentReport]] = {}  # cluster uid -> pod uid -> its /readyz, last read
        self.silences: dict[str, dict[str, int]] = {}  # cluster uid -> pod uid -> its /readyz unanswered in a row
        self.node_prints: dict[str, tuple[Any, ...]] = {}
        self.roles: dict[str, RolesMemory] = {}  # cluster uid -> its PDRoles' sync memory (roles.py)
        self.role_generations: dict[str, int] = {}  # PDRole uid -> the generation last seen
        self.metrics_started = False
        self.last_reconcile = 0.0

    def get_kube(self) -> Kube:
        if self.kube is None:
            self.kube = Kube.from_configuration(load_configuration())
        return self.kube

    def wake(self, uid: str | None) -> None:
        event = self.wakers.get(uid or "")
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self.wakers.values():
            event.set()


STATE = OperatorState()
