"""What every part of the agent shares: settings, the spec and rank map, the local ranks, the room
registry, the peer client and the peer ranks' transfer metadata, background tasks, the engine worker
threads and the engines' room feed."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdfabric_agent.peers.client import PeerClient
from pdfabric_agent.peers.metadata import MetadataLoader
from pdfabric_agent.ranks.local import NodeRanks
from pdfabric_agent.rooms.feed import RoomFeed
from pdfabric_agent.rooms.registry import MetricLabels, RoomRegistry
from pdfabric_agent.runtime.config import AgentConfig
from pdfabric_agent.runtime.tasks import Liveness, TaskSet
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec


@dataclass
class AgentContext:
    cfg: AgentConfig
    ranks: NodeRanks  # holds the rank map and spec, which a newer rank map replaces (``spec``, ``rankmap``)
    rooms: RoomRegistry
    peers: PeerClient
    tasks: TaskSet
    workers: ThreadPoolExecutor  # blocking engine calls and large plans
    clock: Callable[[], float]
    labels: MetricLabels
    liveness: Liveness
    metadata: MetadataLoader  # peer ranks' transfer metadata, for a backend that needs it (NIXL)
    feed: RoomFeed = field(default_factory=RoomFeed)  # room views pushed to engines (GET /v1/events)

    @property
    def spec(self) -> PDClusterSpec:
        return self.ranks.spec

    @property
    def rankmap(self) -> RankMap:
        return self.ranks.rankmap

    def traffic_labels(self, role: Role, path: str) -> tuple[str, str, str, str, str]:
        lab = self.labels
        return (lab.cluster, role, lab.backend, lab.transport, path)
