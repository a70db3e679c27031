"""GET /v1/info's answer, typed: which cluster and agent an engine reached, the transport and byte
mover it runs, and per local rank its role, the backend's endpoint, the agent's pools (how a
client maps them) and the engine's own buffers once registered. The agent builds an ``AgentInfo``
and writes ``to_json``; every caller (the SGLang plugin, the vLLM connector, the reference
engine, the client's ``map_pools``) reads it through ``parse``, once, and ``rank`` for its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools
from pdfabric_agent.protocol.views import MemoryAnswer, answer_object, typed_field

POOL_KINDS = ("kv", "state", "aux")


@dataclass(frozen=True)
class PoolInfo:
    """One of a rank's pools as a client maps it: a shared-memory file (``handle`` its path) on
    the CPU, a CUDA IPC export (``handle`` its JSON) on GPU ``gpu``."""

    addr: int
    size: int
    device: str
    handle: str
    gpu: int | None = None

    @classmethod
    def of(cls, pool: Pool) -> Self:
        return cls(pool.addr, pool.size, pool.device.value, pool.handle, pool.gpu)

    def to_json(self) -> dict[str, Any]:
        return {"addr": self.addr, "size": self.size, "device": self.device, "handle": self.handle, "gpu": self.gpu}

    @classmethod
    def parse(cls, doc: Any, what: str) -> Self:
        d = answer_object(doc, what)
        gpu = d.get("gpu")
        if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool)):
            raise ValueError(f"{what}: 'gpu' is {gpu!r}")
        return cls(
            typed_field(d, "addr", int, what),
            typed_field(d, "size", int, what),
            typed_field(d, "device", str, what),
            typed_field(d, "handle", str, what),
            gpu,
        )


@dataclass(frozen=True)
class RankInfo:
    """One local rank: its role, the byte mover's endpoint and path, the agent's pools and their
    layout, and the engine's registered buffers (None until its engine registers)."""

    role: str
    endpoint: str
    path: str
    layout: PoolLayout
    pools: Mapping[str, PoolInfo]  # by kind: kv, state, aux
    engine_memory: MemoryAnswer | None = None

    @classmethod
    def of(
        cls, role: str, endpoint: str, path: str, pools: RankPools, engine_memory: MemoryAnswer | None = None
    ) -> Self:
        kinds = dict(zip(POOL_KINDS, pools.all(), strict=True))
        return cls(role, endpoint, path, pools.layout, {k: PoolInfo.of(p) for k, p in kinds.items()}, engine_memory)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "endpoint": self.endpoint,
            "path": self.path,
            "layout": self.layout.to_dict(),
            **{kind: pool.to_json() for kind, pool in self.pools.items()},
            "engine_memory": self.engine_memory.memory_json() if self.engine_memory is not None else None,
        }

    @classmethod
    def parse(cls, rank_id: str, doc: Any) -> Self:
        what = f"/v1/info's rank {rank_id}"
        d = answer_object(doc, what)
        try:
            layout = PoolLayout.from_dict(dict(answer_object(d.get("layout"), f"{what} layout")))
        except (TypeError, KeyError) as exc:
            raise ValueError(f"{what}: bad layout ({exc})") from None
        memory = d.get("engine_memory")
        return cls(
            typed_field(d, "role", str, what),
            typed_field(d, "endpoint", str, what),
            typed_field(d, "path", str, what),
            layout,
            {kind: PoolInfo.parse(d.get(kind), f"{what} {kind} pool") for kind in POOL_KINDS},
            None if memory is None else MemoryAnswer.parse({"rank": rank_id, "memory": memory}),
        )


@dataclass(frozen=True)
class AgentInfo:
    """GET /v1/info: the cluster (namespace, name, uid), the agent's name, the transport it carries
    KV over, its transfer backend, and its local ranks by rank id."""

    namespace: str
    cluster: str
    cluster_uid: str
    agent: str
    transport: str
    backend: str
    ranks: Mapping[str, RankInfo]

    def rank(self, rank_id: str, hint: str = "") -> RankInfo:
        """This agent's rank ``rank_id``, or a RuntimeError saying which it serves (and ``hint``:
        what the engine should set to name another)."""
        if rank_id not in self.ranks:
            raise RuntimeError(
                f"pdfabric: agent {self.agent} does not serve rank {rank_id} (it serves {sorted(self.ranks)})"
                + (f"; {hint}" if hint else "")
            )
        return self.ranks[rank_id]

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": {"namespace": self.namespace, "name": self.cluster, "uid": self.cluster_uid},
            "agent": self.agent,
            "transport": self.transport,
            "backend": self.backend,
            "ranks": {rank_id: r.to_json() for rank_id, r in self.ranks.items()},
        }

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "/v1/info"
        d = answer_object(doc, what)
        cluster = answer_object(d.get("cluster"), f"{what} cluster")
        ranks = answer_object(d.get("ranks"), f"{what} ranks")
        return cls(
            typed_field(cluster, "namespace", str, f"{what} cluster"),
            typed_field(cluster, "name", str, f"{what} cluster"),
            typed_field(cluster, "uid", str, f"{what} cluster"),
            typed_field(d, "agent", str, what),
            typed_field(d, "transport", str, what),
            typed_field(d, "backend", str, what),
            {str(rank_id): RankInfo.parse(str(rank_id), r) for rank_id, r in ranks.items()},
        )
