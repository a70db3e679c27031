"""What the planner reads and answers: GPU nodes and the pods already bound to them in, a
Placement (one pod per placement unit, its ranks and node) or a PlacementFailure (reason and a
message that says what to change) out. Pure values; the planner is planner.py."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdfabric_core.policy.types import Transport
from pdfabric_core.rankmap import Rank
from pdfabric_operator.scheduling import Taint


class PlacementReason(enum.StrEnum):
    """Why no placement fits: the Placed condition's reason and the failure metric's label."""

    NO_GPU_NODES = "NoGPUNodes"
    INSUFFICIENT_GPUS = "InsufficientGPUs"
    NO_RDMA_NODES = "NoRDMANodes"
    NO_NVLINK_DOMAIN = "NoNVLinkDomain"
    NVLINK_DOMAIN_TOO_SMALL = "NVLinkDomainTooSmall"
    NO_NODE_FOR_INTRA_NODE_GROUP = "NoNodeForIntraNodeGroup"


@dataclass(frozen=True)
class GpuNode:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, int] = field(default_factory=dict)  # extended resources only
    ready: bool = True
    schedulable: bool = True  # False when cordoned or being deleted
    taints: tuple[Taint, ...] = ()


@dataclass(frozen=True)
class PlacedPod:
    """A pod already bound to a node, holding extended resources (GPUs, RDMA)."""

    node: str
    requests: Mapping[str, int]
    owner_uid: str | None = None  # PDCluster uid for our agents, else None


@dataclass(frozen=True)
class AgentPlacement:
    """One node pod: the ranks of one placement unit (a replica, or an intra-node NVLink group)
    on one node. A pod per unit, not per node, so that scaling a role adds and removes pods and
    leaves every other pod, its engines and its rooms alone (a pod cannot gain GPUs in place)."""

    node: str
    ranks: tuple[Rank, ...]  # sorted; rank.gpu is the device index among the pod's own GPUs
    domain: str | None = None
    unit: str = ""  # the placement unit: prefill-<r>, decode-<r> or group-<p>

    @property
    def gpus(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Shortfall:
    """A scale step of a running cluster the nodes cannot take in full: the replicas asked, those
    placed (every running one that still fits, plus what fits of the new), and the planner's reason
    and message for the rest, which stay unplaced as a Deployment's Pending pods do."""

    prefill_asked: int
    decode_asked: int
    prefill_placed: int
    decode_placed: int
    reason: PlacementReason
    message: str

    def asked_placed(self, role: str) -> tuple[int, int]:
        """The replicas of `role` ("prefill" or "decode") asked and placed."""
        if role == "prefill":
            return self.prefill_asked, self.prefill_placed
        return self.decode_asked, self.decode_placed

    @property
    def unplaced(self) -> dict[str, int]:
        """Replicas asked and not placed, per role."""
        return {role: asked - placed for role in ("prefill", "decode") for asked, placed in [self.asked_placed(role)]}

    def role_words(self, role: str) -> str:
        """'3 of 4 decode replicas placed', or '' when the role is placed in full."""
        asked, placed = self.asked_placed(role)
        return f"{placed} of {asked} {role} replicas placed" if placed < asked else ""

    @property
    def words(self) -> str:
        """e.g. '3 of 4 decode replicas placed: decode-3 needs 1 GPUs but ...'."""
        roles = [w for w in (self.role_words("prefill"), self.role_words("decode")) if w]
        return f"{', '.join(roles)}: {self.message}"


@dataclass(frozen=True)
class Placement:
    transport: Transport  # what the agents run
    requested_transport: Transport
    agents: tuple[AgentPlacement, ...]  # sorted by node name, then unit
    feeds: Mapping[int, tuple[int, ...]]
    domain: str | None = None
    fallback_reason: str | None = None  # why the requested transport was not placed
    # Set when fewer replicas than asked are placed (a running cluster scaled past its nodes);
    # everything downstream is built for the placed counts (planner.placed_spec).
    shortfall: Shortfall | None = None

    @property
    def is_fallback(self) -> bool:
        return self.transport != self.requested_transport

    def ranks_by_node(self) -> dict[str, tuple[Rank, ...]]:
        """Every rank on each node, whichever pod holds it (what stickiness compares)."""
        by_node: dict[str, tuple[Rank, ...]] = {}
        for a in self.agents:
            by_node[a.node] = by_node.get(a.node, ()) + a.ranks
        return by_node


@dataclass(frozen=True)
class PlacementFailure:
    reason: PlacementReason
    message: str  # says what is missing and what to change
    requested_transport: Transport
