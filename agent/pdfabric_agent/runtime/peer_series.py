"""The per-peer view, bounded: the series of each (local rank, peer agent, role) pair.

While the rank map implies at most ``limit`` pairs for this agent (``PDFABRIC_PEER_SERIES_MAX``,
256 by default: 8 ranks talking to 32 peer agents each), every pair's series exist at zero from the
start, as a complete per-peer view. Past it they cannot all be kept: the largest PDCluster the CRD
admits (8,192 ranks, 512 x 512 replicas of TP 8) implies 4,096 pairs for one agent of 8 ranks, about
74,000 series and 10 MB of /metrics per agent, 75 million for its 1,024 agents. Then a pair's series
are made by its first traffic, and the ``limit`` most recently active pairs keep theirs: the least
recently active pair's are removed to make room (``pdfabric_peer_series_evictions_total``). An
evicted pair that is active again starts its counters at zero, which Prometheus's ``rate`` and
``increase`` read as a counter reset. The per-cluster series (``pdfabric_transfer_bytes_total`` and
the rest) are exact whatever the bound; ``pdfabric_peer_series_pairs`` says how many pairs the map
implies and how many are held.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Mapping

from prometheus_client.metrics import MetricWrapperBase

from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.runtime import metrics
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec

DEFAULT_LIMIT = 256

Pair = tuple[str, str, str, str]  # pdcluster, local rank id, peer agent, role
TransportLabels = tuple[str, str, str]  # requested, transport, path


class PeerSeries:
    """The pairs whose series are exported, least recently active first, and what each pair's
    ``pdfabric_peer_transport_info`` says."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 0:
            raise ValueError("the per-peer series bound cannot be negative")
        self.limit = limit
        self._held: OrderedDict[Pair, TransportLabels | None] = OrderedDict()
        self._transport: dict[Pair, TransportLabels | None] = {}  # every pair the rank map implies
        self._implied: Counter[str] = Counter()  # per cluster: pairs in _transport
        self._held_count: Counter[str] = Counter()  # per cluster: pairs in _held

    def publish(
        self,
        rankmap: RankMap,
        spec: PDClusterSpec,
        agent_name: str,
        requested: str,
        transport: str,
        paths: Mapping[str, tuple[str, str]],
    ) -> int:
        """Take the pairs ``rankmap`` implies for ``agent_name`` (``metrics.peer_pairs``) and what
        each one's transport is; with at most ``limit`` of them, make all their series at zero.
        ``paths``: per local rank id, (path to a peer on this node, path to a peer on another
        node). Returns how many pairs the map implies."""
        cluster = rankmap.cluster
        node = {a.name: a.node for a in rankmap.agents}
        implied: dict[Pair, TransportLabels | None] = {}
        for rank_id, peer, role in metrics.peer_pairs(rankmap, spec, agent_name):
            labels = None  # a rank without a backend here (yet): no transport to tell
            if rank_id in paths:
                same_node, other_node = paths[rank_id]
                path = same_node if node.get(peer) == node.get(agent_name) else other_node
                labels = (requested, transport, path)
            implied[(cluster, rank_id, peer, role.value)] = labels
        self._transport = {k: v for k, v in self._transport.items() if k[0] != cluster} | implied
        self._implied[cluster] = len(implied)
        for pair, labels in list(self._held.items()):
            if pair[0] == cluster and pair in implied and labels != implied[pair]:
                self._remove(pair)  # a fallback changed its transport: made again below or on traffic
        if len(implied) <= self.limit:
            for pair in implied:
                self._hold(pair, touch=False)
        self._report(cluster)
        return len(implied)

    def count(
        self,
        cluster: str,
        rank_id: str,
        peer: str,
        role: Role,
        outcome: Outcome,
        duration_s: float | None = None,
        nbytes: int = 0,
    ) -> None:
        """One room's part with one peer rank ended: its bytes, its outcome, and its latency when
        it succeeded, on the pair's series (made now, and another pair's removed, if need be)."""
        pair = (cluster, rank_id, peer, role.value)
        if not self._hold(pair, touch=True):
            return
        self._report(cluster)
        if nbytes:
            metrics.peer_bytes.labels(*pair).inc(nbytes)
        metrics.peer_requests.labels(*pair, outcome.value).inc()
        if outcome is Outcome.SUCCESS and duration_s is not None:
            metrics.peer_request_duration.labels(*pair).observe(duration_s)

    def forget_peer(self, peer: str) -> int:
        """Remove every pair of agent ``peer`` (it left the rank map); returns how many."""
        gone = [pair for pair in self._held if pair[2] == peer]
        for pair in gone:
            self._remove(pair)
        kept = {k: v for k, v in self._transport.items() if k[2] != peer}
        if len(kept) != len(self._transport):
            self._transport = kept
            self._implied = Counter(k[0] for k in kept)
        for cluster in {pair[0] for pair in gone}:
            self._report(cluster)
        return len(gone)

    def _hold(self, pair: Pair, *, touch: bool) -> bool:
        """The pair's series exist after this (False: the bound is 0); ``touch``: it is the most
        recently active now."""
        if pair in self._held:
            if touch:
                self._held.move_to_end(pair)
            return True
        if self.limit == 0:
            return False
        while len(self._held) >= self.limit:
            oldest = next(iter(self._held))
            self._remove(oldest)
            metrics.peer_series_evictions.labels(oldest[0]).inc()
        labels = self._transport.get(pair)
        self._held[pair] = labels
        self._held_count[pair[0]] += 1
        metrics.peer_bytes.labels(*pair)
        metrics.peer_request_duration.labels(*pair)
        for outcome in Outcome:
            metrics.peer_requests.labels(*pair, outcome.value)
        if labels is not None:
            metrics.peer_transport_info.labels(*pair, *labels).set(1)
        return True

    def _remove(self, pair: Pair) -> None:
        labels = self._held.pop(pair)
        self._held_count[pair[0]] -= 1
        series: list[tuple[MetricWrapperBase, tuple[str, ...]]] = [
            (metrics.peer_bytes, pair),
            (metrics.peer_request_duration, pair),
            *((metrics.peer_requests, (*pair, outcome.value)) for outcome in Outcome),
        ]
        if labels is not None:
            series.append((metrics.peer_transport_info, (*pair, *labels)))
        for metric, values in series:
            with contextlib.suppress(KeyError):  # already gone: removing is all that was asked
                metric.remove(*values)

    def _report(self, cluster: str) -> None:
        metrics.peer_series_pairs.labels(cluster, "implied").set(self._implied[cluster])
        metrics.peer_series_pairs.labels(cluster, "held").set(self._held_count[cluster])


# The agent's one view (its metrics are the process's registry); ``limit`` set from its config.
PEERS = PeerSeries()
