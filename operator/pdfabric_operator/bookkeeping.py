"""What a PDCluster's reconciles keep: ``ClusterMemory``, remembered between runs (lost on restart,
by design), and ``Result``, what one run did and what the handler is to report (actions, Events,
the Ready and Placed gauges)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdfabric_core.rankmap import Rank
from pdfabric_operator.group_restarts import GroupHolds
from pdfabric_operator.metrics import ReconcileResult
from pdfabric_operator.pki import KeyPair


@dataclass
class ClusterMemory:
    """What one PDCluster's reconciles remember between runs (lost on restart, by design)."""

    last_status: dict[str, Any] | None = None
    last_status_rv: str | None = None  # resourceVersion our last status patch produced
    children_checked_at: float = 0.0
    children_absent: bool = False
    last_rankmap_hash: str | None = None
    # Every serving agent said it runs the rank map last written (status RankMapCurrent True).
    membership_settled: bool = True
    last_plan: dict[str, tuple[Rank, ...]] | None = None  # node -> ranks of the last placement
    engine_services_hash: str | None = None  # the rank map the engines' Services were last checked for
    # Engine restarts last seen, pod uid -> engine -> count (an EngineRestarted Event when it grows);
    # pods that ran before this memory began are judged from their first reading on.
    engine_restarts: dict[str, dict[str, int]] = field(default_factory=dict)
    restart_baseline: set[str] | None = None
    # Agent pod name -> when its peer certificate is to be issued anew (read from its Secret the
    # first time, then from each issue).
    cert_renew_at: dict[str, datetime] = field(default_factory=dict)
    router_absent: bool = False  # spec.router is off and its children were checked gone
    # The cluster's peer CA as its Secret holds it (read or made once, not per certificate issued;
    # forgotten when the shared-children check finds the Secret gone).
    ca: KeyPair | None = None
    group_holds: GroupHolds = field(default_factory=GroupHolds)  # groups released (group_restarts.py)


@dataclass
class Result:
    result: ReconcileResult
    patched: bool = False
    actions: list[str] = field(default_factory=list)
    # Why the cluster cannot run as asked (no fit, or the declared fallback), for a k8s Event.
    problem: tuple[str, str] | None = None
    # Warning Events to emit once each (reason, message): engines that restarted since last seen.
    events: list[tuple[str, str]] = field(default_factory=list)
    # Normal Events to emit once each (reason, message): peer certificates renewed.
    notices: list[tuple[str, str]] = field(default_factory=list)
    # The Ready and Placed conditions as written (the per-PDCluster gauges the alerts read).
    ready: bool = False
    placed: bool = False
    # Replicas per role a scale step asked for that found no room (the planner's shortfall).
    unplaced: dict[str, int] = field(default_factory=dict)

    @property
    def satisfied(self) -> bool:
        """Ready with every replica placed as asked and nothing to report (no fallback, no
        shortfall): a node this cluster holds no pod on cannot change anything for it."""
        ready = self.result is ReconcileResult.READY and self.placed and self.problem is None
        return ready and not any(self.unplaced.values())
