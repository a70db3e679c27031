"""What one reconcile reads: a snapshot of the watch caches (kopf indices) taken on the event loop,
so the reconcile, in a worker thread, never iterates a dict the loop is mutating. Pure values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.placement import GpuNode, PlacedPod


@dataclass(frozen=True)
class OwnPod:
    """An agent pod of some PDCluster, as the pod index holds it."""

    name: str
    namespace: str
    uid: str
    node: str
    ready: bool
    deleting: bool
    pod_hash: str
    ranks: str
    failed: bool = False  # phase Failed (e.g. the kubelet refused it): replace it
    ip: str = ""  # status.podIP: where the operator reads the agent's /readyz (agentstate)
    # Not bound yet and the scheduler said why (its PodScheduled=False message); "" otherwise.
    unschedulable: str = ""
    unschedulable_since: str = ""  # since when (the condition's lastTransitionTime, RFC 3339)
    config_hash: str = ""  # the agent settings it was built with (builders.agent_config_hash)
    rankmap_hash: str = ""  # the rank map the operator last told it of (ANN_RANKMAP_HASH)
    group_incarnation: str = ""  # a replica over several nodes: its group's incarnation (ANN_GROUP_INCARNATION)
    container_restarts: int = 0  # the kubelet's restartCount, summed over its containers
    budget: str = ""  # its LABEL_DISRUPTION_BUDGET ("" before this operator version labelled it)


@dataclass(frozen=True)
class Snapshot:
    nodes: Sequence[GpuNode]
    placed: Sequence[PlacedPod]
    own: Sequence[OwnPod]
    # Pod uid -> (requested, in use) as the agent's /readyz said (agentstate); absent: not read yet.
    transports: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # With spec.engine: pod uid -> the agent's /readyz as read for this reconcile (its own
    # readiness, its engines); absent: it did not answer.
    reports: Mapping[str, AgentReport] = field(default_factory=dict)
