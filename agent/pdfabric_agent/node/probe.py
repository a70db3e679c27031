"""The pre-flight link check: before an agent reports Ready, each of its sending ranks writes a
few MiB through its real transfer engine into the probe region of the peer ranks it will send to,
and the agent exports GB/s and latency per (rank, peer agent). Every peer agent it sends to is asked
for its regions (one GET, 16 at a time: that it answers, and admits this agent, is part of being Ready); the
writes go to at most ``max_peers`` of them (``PDFABRIC_PROBE_PEERS_MAX``, 16): a prefill agent of
the largest PDCluster sends to 512 decode agents, and writing 8 MiB to each of 4,096 peer ranks at
every start is no check but a load. Each agent picks its peers spread over the sorted peer list from
an offset of its own (its place in the rank map), so the agents between them write to every peer. With
``spec.transfer.minProbeGBps`` above 0 the agent stays not Ready (reason ProbeBelowThreshold,
naming the slow peer) and probes again until every peer is fast enough.

Why peers cannot abuse it:
- every rank registers a probe region of its own (``PROBE_BYTES``), apart from its KV, state and
  aux memory: a probe write, or a peer writing garbage there, touches no KV; nothing reads it;
- its address is served on the peer door only (``GET /v1/peer/probe``: mutual TLS, an agent of the
  rank map), and the call makes the answering agent do nothing but describe its regions (with each
  rank's transfer metadata where its backend needs it loaded before a write: NIXL);
- the prober's own work is fixed here, not by anything a peer sends: a handful of writes of at
  most the region's size, at start (and while below the threshold, once per ``RETRY_S``), with the
  peer's size clamped to ``PROBE_BYTES``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.peers.client import PeerRefused
from pdfabric_agent.protocol.peer_answers import TransferMetadata
from pdfabric_agent.runtime import metrics
from pdfabric_agent.transfer.base import TransferBackend
from pdfabric_core.policy.types import Device, Role
from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec

PROBE_BYTES = 4 * 1024 * 1024  # per rank; the bandwidth write fills a peer's region once per round
BLOCK_BYTES = 1024 * 1024  # the bandwidth write's blocks (4 in one batch: under any maxBatchEntries)
LATENCY_BYTES = 4096
LATENCY_ROUNDS = 5
BANDWIDTH_ROUNDS = 2
DISCOVER_S = 30.0  # how long the first probe waits for a peer's door to answer
RETRY_S = 10.0  # below the threshold: probe the slow pairs again this often
MAX_PEERS = 16  # peer agents written to (PDFABRIC_PROBE_PEERS_MAX)
# Peers asked for their regions at once: 512 asked one after another, each a TLS handshake and a
# GET, held a large cluster's new agent for seconds before its writes began.
ASK_CONCURRENCY = 16
REASON_SLOW = "ProbeBelowThreshold"
# Peers that refuse this agent's certificate: their rank map does not list it yet. Not Ready until
# they all admit it (live membership: they adopt the new map within seconds), whatever the threshold.
REASON_PEERS_BEHIND = "PeersDoNotKnowThisAgent"


@dataclass(frozen=True)
class Region:
    """A peer rank's probe region, as its agent describes it."""

    endpoint: str  # the peer rank's engine session
    addr: int
    size: int
    metadata: bytes | None = None  # what the prober's backend loads before writing there (NIXL)


@dataclass(frozen=True)
class Result:
    rank: str
    peer: str  # the peer agent
    gbps: float  # 0: failed
    latency_s: float | None
    error: str = ""


def allocate(
    rankmap: RankMap, backends: Mapping[str, TransferBackend], device: Device, shm_dir: str, gpus: Mapping[str, int]
) -> dict[str, Pool]:
    """One probe region per rank, registered with the rank's engine (named like the rank's pools,
    so stale-pool cleanup removes it after a crash)."""
    tag = f"pdfabric-{rankmap.cluster_uid[:8]}-{os.getpid()}"
    regions: dict[str, Pool] = {}
    for rank_id, backend in backends.items():
        pool = Pool.allocate(f"{tag}-{rank_id}-probe", PROBE_BYTES, device, shm_dir=shm_dir, gpu=gpus[rank_id])
        backend.register(pool)
        regions[rank_id] = pool
    return regions


def describe(regions: Mapping[str, Pool], backends: Mapping[str, TransferBackend]) -> dict[str, Any]:
    """The body of GET /v1/peer/probe."""
    ranks: dict[str, Any] = {}
    for rank_id, pool in regions.items():
        backend = backends[rank_id]
        described = backend.local_metadata()
        endpoint = backend.endpoint() if described is None else described[0]
        ranks[rank_id] = {"endpoint": endpoint, "addr": pool.addr, "size": pool.size}
        if described is not None:  # the metadata route's encoding (TransferMetadata), one place
            ranks[rank_id]["metadata"] = TransferMetadata(rank_id, *described).to_json()["metadata"]
    return {"ranks": ranks}


def parse_regions(body: Mapping[str, Any]) -> dict[str, Region]:
    out: dict[str, Region] = {}
    ranks = body.get("ranks")
    if not isinstance(ranks, dict):
        raise ValueError("no ranks in the probe description")
    for rank_id, r in ranks.items():
        if not isinstance(r, dict):
            raise ValueError(f"probe region of {rank_id!r} is not an object")
        endpoint, addr, size, metadata = r.get("endpoint"), r.get("addr"), r.get("size"), r.get("metadata")
        if not isinstance(endpoint, str) or not isinstance(addr, int) or not isinstance(size, int):
            raise ValueError(f"probe region of {rank_id!r} needs endpoint, addr and size")
        loaded = None
        if metadata is not None:  # read as the metadata route's answer is: typed, bounded, base64
            try:
                doc = {"rank": str(rank_id), "endpoint": endpoint, "metadata": metadata}
                loaded = TransferMetadata.parse(doc).metadata
            except ValueError as exc:
                raise ValueError(f"probe region of {rank_id!r}: {exc}") from None
        out[str(rank_id)] = Region(endpoint, addr, min(size, PROBE_BYTES), loaded)
    return out


def measure(
    backend: TransferBackend, src: Pool, region: Region, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """(GB/s, median latency in seconds) of writes from ``src`` into ``region``; raises what the
    engine raises. Runs in a worker thread (engine calls block)."""
    if region.metadata is not None and backend.needs_metadata(region.endpoint):
        backend.load_metadata(region.endpoint, region.metadata)
    size = min(region.size, src.size)
    small = min(LATENCY_BYTES, size)
    backend.write_batch(region.endpoint, [Block(src.addr, region.addr, small)])  # opens the session
    latencies = []
    for _ in range(LATENCY_ROUNDS):
        t0 = clock()
        backend.write_batch(region.endpoint, [Block(src.addr, region.addr, small)])
        latencies.append(clock() - t0)
    step = min(BLOCK_BYTES, size)
    blocks = [Block(src.addr + off, region.addr + off, min(step, size - off)) for off in range(0, size, step)]
    per_batch = max(1, backend.max_batch_entries)
    t0 = clock()
    for _ in range(BANDWIDTH_ROUNDS):
        for i in range(0, len(blocks), per_batch):
            backend.write_batch(region.endpoint, blocks[i : i + per_batch])
    elapsed = max(clock() - t0, 1e-9)
    return BANDWIDTH_ROUNDS * size / elapsed / 1e9, statistics.median(latencies)


Fetch = Callable[[str], Any]  # peer agent -> awaitable of its /v1/peer/probe body


def spread(peers: list[str], offset: int, most: int) -> frozenset[str]:
    """At most ``most`` of the sorted ``peers``, evenly spaced from ``offset``: agents with
    consecutive offsets pick disjoint ones while there are enough, so together they reach all."""
    if len(peers) <= most:
        return frozenset(peers)
    step = len(peers) / most
    return frozenset(peers[(offset + int(j * step)) % len(peers)] for j in range(most))


class LinkCheck:
    """The probes of one agent: which (rank, peer rank) pairs, and their last results."""

    def __init__(
        self,
        rankmap: RankMap,
        spec: PDClusterSpec,
        agent_name: str,
        backends: Mapping[str, TransferBackend],
        regions: Mapping[str, Pool],
        max_peers: int = MAX_PEERS,
    ) -> None:
        self.cluster = rankmap.cluster
        self.threshold = spec.transfer.min_probe_g_bps
        self.backends = backends
        self.regions = regions
        # Only the ranks that send probe: a decode rank receives, its prefill peers probe it.
        self.targets = sorted(
            (rank, peer, peer_rank)
            for rank, peer, peer_rank, role in metrics.peer_ranks(rankmap, spec, agent_name)
            if role is Role.PREFILL
        )
        names = sorted(a.name for a in rankmap.agents)
        offset = names.index(agent_name) if agent_name in names else 0
        self.peer_agents = sorted({peer for _, peer, _ in self.targets})
        self.measured = spread(self.peer_agents, offset, max_peers)
        self.results: dict[tuple[str, str], Result] = {}
        self.refused: dict[str, str] = {}  # peer agent -> its refusal of this agent's certificate

    @property
    def measured_pairs(self) -> int:
        """The (rank, peer rank) pairs the writes go to."""
        return sum(1 for _, peer, _ in self.targets if peer in self.measured)

    async def run(
        self,
        fetch: Fetch,
        executor: Executor,
        *,
        discover_s: float = DISCOVER_S,
        only: set[str] | None = None,
        waiting: Callable[[str], None] | None = None,
    ) -> list[Result]:
        """Probe every pair (of the peer agents `only`, when given) once; peers whose door does
        not answer yet are asked again until ``discover_s``, and `waiting` is told who and why
        after each round that left some; every (rank, peer agent) pair's worst peer rank is its
        result. Peers that refused this agent's certificate are in ``refused`` afterwards."""
        peers = sorted({peer for _, peer, _ in self.targets if only is None or peer in only})
        described: dict[str, dict[str, Region]] = {}
        errors: dict[str, str] = {}
        deadline = time.monotonic() + discover_s
        asking = asyncio.Semaphore(ASK_CONCURRENCY)

        async def ask(peer: str) -> None:
            async with asking:
                try:
                    described[peer] = parse_regions(await fetch(peer))
                    errors.pop(peer, None)
                    self.refused.pop(peer, None)
                except PeerRefused as exc:
                    errors[peer] = f"{type(exc).__name__}: {exc}"[:300]
                    if exc.status in (401, 403):
                        self.refused[peer] = str(exc)[:300]
                    else:
                        self.refused.pop(peer, None)
                except Exception as exc:  # unreachable, malformed: asked again
                    errors[peer] = f"{type(exc).__name__}: {exc}"[:300]
                    self.refused.pop(peer, None)

        while True:
            await asyncio.gather(*(ask(peer) for peer in peers if peer not in described))
            if len(described) == len(peers) or time.monotonic() >= deadline:
                break
            if waiting is not None:
                first = min(errors)
                waiting(
                    f"link check: {len(errors)} of {len(peers)} peer agents not answering yet; {first}: {errors[first]}"
                )
            await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        by_pair: dict[tuple[str, str], Result] = {}
        for rank, peer, peer_rank in self.targets:
            if peer not in peers or peer not in self.measured:
                continue
            region = described.get(peer, {}).get(peer_rank)
            if region is None:
                why = errors.get(peer) or f"{peer} describes no probe region for {peer_rank}"
                result = Result(rank, peer, 0.0, None, why)
            else:
                try:
                    gbps, latency = await loop.run_in_executor(
                        executor, measure, self.backends[rank], self.regions[rank], region
                    )
                    result = Result(rank, peer, gbps, latency)
                except Exception as exc:
                    result = Result(rank, peer, 0.0, None, f"{type(exc).__name__}: {exc}"[:300])
            prev = by_pair.get((rank, peer))
            if prev is None or result.gbps < prev.gbps:
                by_pair[(rank, peer)] = result
        for (rank, peer), result in by_pair.items():
            self.results[(rank, peer)] = result
            labels = (self.cluster, rank, peer, Role.PREFILL.value)
            metrics.peer_probe_bandwidth.labels(*labels).set(result.gbps)
            if result.latency_s is not None:
                metrics.peer_probe_latency.labels(*labels).set(result.latency_s)
        return list(by_pair.values())

    def slow(self) -> list[Result]:
        """Pairs below the threshold (none without one), slowest first."""
        if self.threshold <= 0:
            return []
        return sorted((r for r in self.results.values() if r.gbps < self.threshold), key=lambda r: r.gbps)

    def verdict(self) -> str:
        """The readiness message while slow pairs remain: the slowest named first."""
        slow = self.slow()
        parts = [
            f"rank {r.rank} -> peer {r.peer}: " + (f"probe failed ({r.error})" if r.error else f"{r.gbps:.3g} GB/s")
            for r in slow[:4]
        ]
        more = f" and {len(slow) - 4} more" if len(slow) > 4 else ""
        return f"link check below transfer.minProbeGBps {self.threshold:g}: {'; '.join(parts)}{more}"

    def refusals(self) -> str:
        """The readiness message while peers refuse this agent's certificate."""
        named = "; ".join(f"{peer}: {why}" for peer, why in sorted(self.refused.items())[:3])
        more = f" and {len(self.refused) - 3} more" if len(self.refused) > 3 else ""
        return f"{len(self.refused)} peer agents refuse this agent (their rank map does not list it yet): {named}{more}"

    def summary(self) -> str:
        if not self.results:
            return "no peers to probe"
        worst = min(self.results.values(), key=lambda r: r.gbps)
        return (
            f"link check: {len(self.results)} pairs with {len(self.measured)} of {len(self.peer_agents)} peer agents, "
            f"slowest {worst.rank} -> {worst.peer} {worst.gbps:.3g} GB/s"
        )
