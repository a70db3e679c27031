"""The rank map: what the operator tells every agent of a PDCluster (ConfigMap key `rankmap.json`).

It is the meeting point of the control and data planes. The operator writes it from a placement;
each agent reads it, finds its own entry by node name, and learns its ranks, its peers and the
normalised spec. Version it: agents refuse a map newer than they understand.
"""

from __future__ import annotations

import functools
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
# Replica, rank and device numbers a map may carry: far above any CRD bound, far below what would
# make a rank id or an index overflow anything downstream.
MAX_INDEX = 1 << 20


class RankMapError(ValueError):
    """A rank map that does not parse, with where and what: the one exception its reader raises for
    any text (a map written by hand, truncated, of another shape or nested past any sense)."""


def _field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``d[key]`` when it is a `kind` (an int is never a bool); `default` when absent and given."""
    if key not in d:
        if default is not ...:
            return default
        raise RankMapError(f"{where} has no {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RankMapError(f"{where}.{key} must be {_kind_name(kind)}, not {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list", type(None): "null"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _index(value: Any, where: str) -> int:
    """A replica, rank or device number: an integer in [0, MAX_INDEX)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise RankMapError(f"{where} must be an integer, not {type(value).__name__}")
    if not 0 <= value < MAX_INDEX:
        raise RankMapError(f"{where} must be in [0, {MAX_INDEX}), not {value}")
    return value


def _index_field(d: Mapping[str, Any], key: str, where: str, default: Any = ...) -> int:
    return _index(_field(d, key, object, where, default), f"{where}.{key}")


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
    def from_dict(cls, d: Any, where: str = "rank") -> Rank:
        """The rank `d` describes (``to_dict``'s inverse); RankMapError saying what is wrong."""
        if not isinstance(d, dict):
            raise RankMapError(f"{where} must be an object, not {type(d).__name__}")
        role = _field(d, "role", str, where)
        if role not in {r.value for r in Role}:
            raise RankMapError(f"{where}.role must be prefill or decode, not {role!r}")
        return cls(
            Role(role),
            _index_field(d, "replica", where),
            _index_field(d, "tpRank", where),
            _index_field(d, "cpRank", where, 0),
            _index_field(d, "ppRank", where, 0),
            _index_field(d, "gpu", where, 0),
            _index_field(d, "dpRank", where, 0),
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


def replica_parts(spec: PDClusterSpec, role: Role, replica: int) -> list[list[Rank]]:
    """One replica's ranks by node rank: ``nodesPerReplica`` equal blocks in rank order, the block
    SGLang's ``--nnodes``/``--node-rank`` give each node (with dp and cp 1 the order is (pp, tp): a
    node takes whole PP stages, or a TP slice of one stage). One block for a single-node replica."""
    ranks = replica_ranks(spec, role, replica)
    nodes = spec.role(role).nodes_per_replica
    size = len(ranks) // nodes
    return [ranks[k * size : (k + 1) * size] for k in range(nodes)]


def node_rank(spec: PDClusterSpec, rank: Rank) -> int:
    """The node rank (0: the leader, where the engine's HTTP server runs) holding `rank`."""
    par = spec.role(rank.role)
    if par.nodes_per_replica == 1:
        return 0
    if rank.role is Role.PREFILL:
        index = ((rank.pp_rank * par.dp + rank.dp_rank) * par.cp + rank.cp_rank) * par.tp + rank.tp_rank
    else:
        index = (rank.pp_rank * par.dp + rank.dp_rank) * par.tp + rank.tp_rank
    return index // (par.ranks_per_replica // par.nodes_per_replica)


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
    def from_dict(cls, d: Any, where: str = "agent") -> AgentEntry:
        if not isinstance(d, dict):
            raise RankMapError(f"{where} must be an object, not {type(d).__name__}")
        ranks = _field(d, "ranks", list, where)
        return cls(
            _field(d, "name", str, where),
            _field(d, "node", str, where),
            tuple(Rank.from_dict(r, f"{where}.ranks[{i}]") for i, r in enumerate(ranks)),
            _field(d, "domain", (str, type(None)), where, None),
        )


@dataclass(frozen=True)
class RankMap:
    namespace: str
    cluster: str
    cluster_uid: str
    transport: str  # the transport the placement was made for (after any declared fallback)
    spec: Mapping[str, Any]  # the PDCluster spec as stored (camelCase); parse with parse_spec
    agents: tuple[AgentEntry, ...]
    # prefill replica -> decode replicas it may feed, where the transport confines them; a prefill
    # replica not in it feeds every decode replica
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

    @functools.cached_property
    def digest(self) -> str:
        """A short hash of the map's content: which map an agent runs, as it and the operator say.
        Computed once per map (the map is frozen): the operator stamps it on every new pod, and
        serializing a map of thousands of ranks per pod made a large cluster's first reconcile
        quadratic."""
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
            separators=(",", ":"),  # compact: the map of thousands of ranks must fit one ConfigMap
        )

    @classmethod
    def from_json(cls, text: str) -> RankMap:
        """The map `text` holds; RankMapError (a ValueError) naming the first thing wrong, for any
        text at all: the agents re-read this file while they serve, and a bad write must not be
        able to end them (process/rankmap_file.py)."""
        try:
            d = json.loads(text)
        except RecursionError:
            raise RankMapError("rank map is nested too deeply to be one") from None
        except ValueError as exc:  # JSONDecodeError, and text that is not valid Unicode
            raise RankMapError(f"rank map is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise RankMapError(f"rank map must be a JSON object, not {type(d).__name__}")
        version = _field(d, "version", int, "rank map", 0)
        if version != RANKMAP_VERSION:
            raise RankMapError(f"rank map version {version} is not supported (this agent reads {RANKMAP_VERSION})")
        c = _field(d, "cluster", dict, "rank map")
        agents = _field(d, "agents", list, "rank map")
        feeds: dict[int, tuple[int, ...]] = {}
        for key, value in _field(d, "feeds", dict, "rank map", {}).items():
            where = f"rank map feeds[{key!r}]"
            if not (key.isascii() and key.isdigit() and len(key) < 8) or not isinstance(value, list):
                raise RankMapError(f"{where}: feeds map a prefill replica number to a list of decode replicas")
            feeds[_index(int(key), where)] = tuple(_index(x, f"{where}[{i}]") for i, x in enumerate(value))
        return cls(
            namespace=_field(c, "namespace", str, "rank map cluster"),
            cluster=_field(c, "name", str, "rank map cluster"),
            cluster_uid=_field(c, "uid", str, "rank map cluster"),
            transport=_field(d, "transport", str, "rank map"),
            spec=_field(d, "spec", dict, "rank map"),
            agents=tuple(AgentEntry.from_dict(a, f"rank map agents[{i}]") for i, a in enumerate(agents)),
            feeds=feeds,
            version=version,
        )
