"""The rank map: what the operator tells every agent of a PDCluster (ConfigMap key `rankmap.json`).

It is the meeting point of the control and data planes. The operator writes it from a placement;
each agent reads it, finds its own entry by node name, and learns its ranks, its peers and the
normalised spec. Version it: agents refuse a map newer than they understand.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdfabric_core.policy.types import Role

if TYPE_CHECKING:
    from pdfabric_core.spec import PDClusterSpec

RANKMAP_VERSION = 1
RANKMAP_KEY = "rankmap.json"


@dataclass(frozen=True, order=True)
class Rank:
    """One GPU worth of a PD instance: prefill (replica, dp, tp, cp, pp) or decode (replica, dp,
    tp, pp). ``dp_rank`` is the server's DP group as SGLang numbers it (``dp_group``: its
    attention-DP rank, or its system DP rank under ``--dp-size``); ``tp_rank`` is the attention TP
    rank within the group, the rank KV heads are sharded by."""

    role: Role
    replica: int
    tp_rank: int
    cp_rank: int = 0
    pp_rank: int = 0
    gpu: int = 0  # device index on the node
    dp_rank: int = 0

    def __post_init__(self) -> None:
        # Callers may pass "prefill"/"decode"; store the enum so the role is always one of the two.
        if type(self.role) is not Role:
            object.__setattr__(self, "role", Role(self.role))

    @property
    def rank_id(self) -> str:
        """``decode-0-tp1``, ``prefill-2-dp1-tp0-cp1-pp1``: DP and PP only when not 0, so a rank map
        without DP keeps its ids."""
        dp = f"-dp{self.dp_rank}" if self.dp_rank else ""
        base = f"{self.role}-{self.replica}{dp}-tp{self.tp_rank}"
        if self.role is Role.PREFILL:
            base += f"-cp{self.cp_rank}"
        return base + (f"-pp{self.pp_rank}" if self.pp_rank else "")

    @classmethod
    def from_id(cls, rank_id: str, gpu: int = 0) -> Rank:
        """The rank a ``rank_id`` names (its inverse); ValueError naming the id when it names none."""
        parts = rank_id.split("-")
        try:
            role, replica = Role(parts[0]), int(parts[1])
            fields = {p[:2]: int(p[2:]) for p in parts[2:]}
        except (IndexError, ValueError):
            raise ValueError(f"not a pdfabric rank id: {rank_id!r}") from None
        tp, cp, pp, dp = (fields.get(k, 0) for k in ("tp", "cp", "pp", "dp"))
        rank = cls(role, replica, tp, cp, pp, gpu, dp)
        if set(fields) - {"tp", "cp", "pp", "dp"} or rank.rank_id != rank_id:
            raise ValueError(f"not a pdfabric rank id: {rank_id!r}")
        return rank

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "role": self.role.value,
            "replica": self.replica,
            "tpRank": self.tp_rank,
            "cpRank": self.cp_rank,
            "ppRank": self.pp_rank,
            "gpu": self.gpu,
        }
        if self.dp_rank:
            d["dpRank"] = self.dp_rank
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rank:
        try:
            role = Role(d["role"])
        except ValueError:
            raise ValueError(f"rank role must be prefill or decode, got {d['role']!r}") from None
        return cls(
            role,
            int(d["replica"]),
            int(d["tpRank"]),
            int(d.get("cpRank", 0)),
            int(d.get("ppRank", 0)),
            int(d.get("gpu", 0)),
            int(d.get("dpRank", 0)),
        )


def replica_ranks(spec: PDClusterSpec, role: Role, replica: int, *, gpu: int = 0) -> list[Rank]:
    """Every rank of one replica of `role`, in the order ranks are numbered: pp outermost, then the
    DP group, then cp (prefill only; decode CP is 1), then tp (SGLang's (dp, cp, tp) layout within
    a PP stage). Each rank gets device index `gpu` (placement assigns the real ones)."""
    if Role(role) is Role.PREFILL:
        p = spec.prefill
        return [
            Rank(Role.PREFILL, replica, tp, cp, pp, gpu, dp)
            for pp in range(p.pp)
            for dp in range(p.dp)
            for cp in range(p.cp)
            for tp in range(p.tp)
        ]
    d = spec.decode
    return [
        Rank(Role.DECODE, replica, tp, 0, pp, gpu, dp) for pp in range(d.pp) for dp in range(d.dp) for tp in range(d.tp)
    ]


@dataclass(frozen=True)
class AgentEntry:
    name: str  # agent pod name
    node: str
    ranks: tuple[Rank, ...]
    domain: str | None = None  # NVLink domain (clique) when the transport needs one

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "node": self.node, "ranks": [r.to_dict() for r in self.ranks]}
        if self.domain is not None:
            d["domain"] = self.domain
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentEntry:
        return cls(str(d["name"]), str(d["node"]), tuple(Rank.from_dict(r) for r in d["ranks"]), d.get("domain"))


@dataclass(frozen=True)
class RankMap:
    namespace: str
    cluster: str
    cluster_uid: str
    transport: str  # the transport the placement was made for (after any declared fallback)
    spec: Mapping[str, Any]  # the PDCluster spec as stored (camelCase); parse with parse_spec
    agents: tuple[AgentEntry, ...]
    # prefill replica -> decode replicas it may feed (all, unless the transport confines them)
    feeds: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    version: int = RANKMAP_VERSION

    def agent_named(self, name: str) -> AgentEntry:
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise LookupError(f"rank map of {self.namespace}/{self.cluster} has no agent {name!r}")

    def own_entry(self, pod_name: str, node: str) -> AgentEntry:
        """The entry of the agent in pod `pod_name` on `node`: by pod name (a node may carry several
        pods of one cluster, a pod per placement unit); by node only for an agent run without a
        pod name, where the node must then hold exactly one."""
        if pod_name:
            entry = self.agent_named(pod_name)
            if entry.node != node:
                raise LookupError(f"rank map puts agent {pod_name!r} on node {entry.node!r}, not {node!r}")
            return entry
        on_node = [a for a in self.agents if a.node == node]
        if len(on_node) != 1:
            raise LookupError(
                f"rank map of {self.namespace}/{self.cluster} has {len(on_node)} agents on node {node!r}; "
                f"set POD_NAME to say which one this is"
            )
        return on_node[0]

    @property
    def digest(self) -> str:
        """A short hash of the map's content: which map an agent runs, as it and the operator say."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def agent_for_rank(self, rank_id: str) -> AgentEntry:
        for agent in self.agents:
            if any(r.rank_id == rank_id for r in agent.ranks):
                return agent
        raise LookupError(f"rank {rank_id!r} is not placed in {self.namespace}/{self.cluster}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "cluster": {"namespace": self.namespace, "name": self.cluster, "uid": self.cluster_uid},
                "transport": self.transport,
                "spec": self.spec,
                "agents": [a.to_dict() for a in self.agents],
                "feeds": {str(k): list(v) for k, v in sorted(self.feeds.items())},
            },
            sort_keys=True,
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> RankMap:
        d = json.loads(text)
        version = int(d.get("version", 0))
        if version != RANKMAP_VERSION:
            raise ValueError(f"rank map version {version} is not supported (this agent reads {RANKMAP_VERSION})")
        c = d["cluster"]
        return cls(
            namespace=c["namespace"],
            cluster=c["name"],
            cluster_uid=c["uid"],
            transport=d["transport"],
            spec=d["spec"],
            agents=tuple(AgentEntry.from_dict(a) for a in d["agents"]),
            feeds={int(k): tuple(int(x) for x in v) for k, v in d.get("feeds", {}).items()},
            version=version,
        )
