"""The ranks this agent serves (engine backend and pools each) and where the rank map puts the
others."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from pdfabric_agent.memory.plan import Bases, MemoryMap
from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools, region_of
from pdfabric_agent.protocol.board import RoomBoard
from pdfabric_agent.protocol.errors import malformed, memory_not_registered, unknown_rank, wrong_peer
from pdfabric_agent.ranks.engine_memory import EngineMemory
from pdfabric_agent.transfer.base import TransferBackend
from pdfabric_core.policy.rank_mapping import decode_pp_stage
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from pdfabric_core.spec import PDClusterSpec


@dataclass
class LocalRank:
    """One rank of this node: its transfer engine and its memory, the agent's own pools (the
    synthetic engine, benchmarks) until a serving engine registers its buffers (``engine``)."""

    rank: Rank
    backend: TransferBackend
    pools: RankPools
    engine: EngineMemory | None = None
    engine_instance: str = ""  # the engine process that registered ``engine`` (service/registrants.py)

    @property
    def board(self) -> RoomBoard | None:
        """The registered engine's room board, when the agent mapped one."""
        return self.engine.board if self.engine is not None else None

    @property
    def layout(self) -> PoolLayout:
        return self.engine.layout if self.engine is not None else self.pools.layout

    @property
    def bases(self) -> MemoryMap:
        return self.engine.memory_map if self.engine is not None else self._pools_map

    @functools.cached_property
    def _pools_map(self) -> MemoryMap:
        """The agent's own pools never move: their map is made once (it is read per room)."""
        p = self.pools
        return MemoryMap.of_pools(p.layout, Bases(p.kv.addr, p.state.addr, p.aux.addr))

    def check_engine_memory(self, wanted: bool) -> None:
        """A room for the engine's own memory (``engine_memory``) needs the engine's registration:
        after an agent restart the engine must register again before its rooms (409)."""
        if wanted and self.engine is None:
            raise memory_not_registered(self.rank.rank_id)

    def regions(self) -> tuple[Pool, ...]:
        """Every registered region of the rank's memory (integrity sums and side-channel rows)."""
        return self.engine.regions() if self.engine is not None else self.pools.all()

    def read(self, addr: int, length: int) -> bytes:
        pool = region_of(self.regions(), addr, length)
        return pool.read(addr - pool.addr, length)

    def write(self, addr: int, data: bytes) -> None:
        pool = region_of(self.regions(), addr, len(data))
        pool.write(addr - pool.addr, data)


@dataclass(frozen=True)
class Leaving:
    """An agent a newer rank map dropped (its replica was scaled away): still a peer until
    ``until``, so the rooms it has open drain while its pod stops."""

    entry: AgentEntry
    until: float
    rankmap: RankMap  # the map it was dropped from: which prefill replicas fed it there


class NodeRanks:
    """Local ranks by id, and where the rank map puts the others: the one holder of the rank map
    and spec this agent runs on (``adopt`` moves to a newer map without a restart). Lookups refuse
    with 404 what the map lacks; an agent the map dropped is still found while it is leaving."""

    def __init__(self, rankmap: RankMap, spec: PDClusterSpec, agent_name: str, ranks: Mapping[str, LocalRank]) -> None:
        self.rankmap = rankmap
        self.spec = spec
        self.agent_name = agent_name
        self.by_id = dict(ranks)
        self.leaving: dict[str, Leaving] = {}

    def adopt(self, rankmap: RankMap, spec: PDClusterSpec, leave_until: float) -> tuple[list[str], list[str]]:
        """Run on `rankmap` from now on: returns (agents added, agents dropped). The dropped ones
        stay peers until `leave_until`; one that comes back is a member again."""
        before = {a.name: a for a in self.rankmap.agents}
        after = {a.name for a in rankmap.agents}
        added = sorted(after - set(before))
        dropped = sorted(set(before) - after)
        for name in dropped:
            self.leaving[name] = Leaving(before[name], leave_until, self.rankmap)
        for name in after:
            self.leaving.pop(name, None)
        self.rankmap, self.spec = rankmap, spec
        return added, dropped

    def left(self, now: float) -> list[AgentEntry]:
        """The leaving agents whose time is up, forgotten from now on."""
        gone = [name for name, x in self.leaving.items() if now >= x.until]
        return [self.leaving.pop(name).entry for name in gone]

    def peer_replicas(self, role: Role) -> int:
        """How many replicas of ``role`` a room may name: the spec's, and those of agents still
        leaving. A router that has not yet heard of a scale-down still sends requests to a replica
        the new map dropped; its rooms run while it drains, as the rooms it had open do."""
        group = self.spec.prefill if role is Role.PREFILL else self.spec.decode
        leaving = [r.replica + 1 for x in self.leaving.values() for r in x.entry.ranks if r.role is role]
        return max([group.replicas, *leaving])

    def feeds(self, prefill_replica: int, decode_replica: int) -> bool:
        """Whether that prefill replica feeds that decode replica: as the rank map says (a replica
        it says nothing of feeds every one), or, for a replica still leaving, as the map it was
        dropped from said."""
        maps = [self.rankmap]
        maps += [
            x.rankmap
            for x in self.leaving.values()
            if any(r.role is Role.DECODE and r.replica == decode_replica for r in x.entry.ranks)
        ]
        return any(decode_replica in m.feeds.get(prefill_replica, (decode_replica,)) for m in maps)

    def peer_agents(self) -> set[str]:
        """Every agent the peer door admits: the map's, and those still leaving."""
        return {a.name for a in self.rankmap.agents} | set(self.leaving)

    def _entry_for_rank(self, rank_id: str) -> AgentEntry:
        try:
            return self.rankmap.agent_for_rank(rank_id)
        except LookupError as exc:
            for x in self.leaving.values():
                if any(r.rank_id == rank_id for r in x.entry.ranks):
                    return x.entry
            raise unknown_rank(str(exc)) from None

    def served(self, rank_id: str) -> LocalRank:
        local = self.by_id.get(rank_id)
        if local is None:
            raise unknown_rank(f"rank {rank_id!r} is not served by agent {self.agent_name}")
        return local

    def local(self, rank_id: str, role: Role) -> LocalRank:
        local = self.served(rank_id)
        if local.rank.role != role:
            raise malformed(f"rank {rank_id!r} is a {local.rank.role} rank, not {role}")
        return local

    def agent_for(self, rank_id: str) -> str:
        return self._entry_for_rank(rank_id).name

    def check_speaker(self, rank_id: str, sender_agent: str | None) -> None:
        """A peer message about `rank_id` must come from the agent the rank map gives that rank
        (`sender_agent`: the name in the peer's client certificate; None off the peer door)."""
        if sender_agent is None:
            return
        owner = self.agent_for(rank_id)
        if owner != sender_agent:
            raise wrong_peer(f"agent {sender_agent} spoke for {rank_id}, which the rank map gives agent {owner}")

    def rank(self, rank_id: str) -> Rank:
        """Any rank of the cluster by id (404 for one the rank map lacks)."""
        entry = self._entry_for_rank(rank_id)
        return next(r for r in entry.ranks if r.rank_id == rank_id)

    def decode_stage(self, local: LocalRank) -> int:
        """The decode PP stage a prefill rank's layers land on."""
        return decode_pp_stage(local.rank.pp_rank, self.spec.prefill.pp, self.spec.decode.pp)
