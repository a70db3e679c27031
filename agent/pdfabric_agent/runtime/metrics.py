"""Every Prometheus metric the agent exports, declared once.

Naming rule: ``pdfabric_<noun>_<verb or unit>_<type suffix>`` (``_total`` for counters, base units:
bytes, seconds). Labels whose values are a closed set (kind, outcome, refusal reason) are Enums and
every value is pre-created by ``precreate`` at start, so a series exists at zero before the first
event and dashboards never show "no data" for a healthy agent.

Semantics that differ from upstream SGLang on purpose:
- bytes are counted after the engine confirmed the batch (never planned bytes), per batch, so a
  request that fails half-way counts what moved (upstream #40164 over-counted state bytes);
- latency runs from submit (API call) to confirmed completion: every batch returned and the decode
  agent acknowledged (upstream #31993 measured from the last chunk's enqueue).

Every series carries ``pdcluster``, the PDCluster's name (``namespace`` comes from the scrape), not
``cluster``: kube-prometheus-stack setups add ``cluster`` (external labels, relabelling) for the
Kubernetes cluster, and the two would collide (docs/upgrade.md has the PromQL change).

docs/metrics.md is generated from ``REGISTRY`` by hack/gen_metrics_docs.py, closed label values
read back from the series ``precreate`` makes: declaring a metric on the registry documents it.
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdfabric_agent.protocol.labels import Completion, Integrity, Kind, Outcome, Refusal
from pdfabric_core.duties import decode_targets, expected_sources
from pdfabric_core.policy.rank_mapping import decode_pp_stage, sending_cp_ranks
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank, RankMap
from pdfabric_core.spec import PDClusterSpec

__all__ = ["REGISTRY", "Completion", "Integrity", "Kind", "Outcome", "Refusal"]

REGISTRY = CollectorRegistry(auto_describe=True)

# Labels identifying where bytes went; `path` is the code path that moved them (e.g. "mooncake",
# "tcp-side-channel", a GPU kernel path later) so an alternative path shows beside the engine.
TRAFFIC_LABELS = ("pdcluster", "role", "backend", "transport", "path")


transfer_bytes = Counter(
    "pdfabric_transfer_bytes_total",
    "Bytes confirmed moved by the transfer engine (prefill: written; decode: acknowledged as landed).",
    [*TRAFFIC_LABELS, "kind"],
    registry=REGISTRY,
)
state_bytes_skipped = Counter(
    "pdfabric_state_dedup_skipped_bytes_total",
    "State bytes not sent because the CP-replicated state dedup rule said CP rank 0 sends them.",
    ["pdcluster", "backend"],
    registry=REGISTRY,
)
transfer_blocks = Counter(
    "pdfabric_transfer_blocks_total",
    "Contiguous (src, dst, length) blocks handed to the engine after page coalescing.",
    TRAFFIC_LABELS,
    registry=REGISTRY,
)
transfer_batches = Counter(
    "pdfabric_transfer_batches_total",
    "Batched engine writes issued (each at most maxBatchEntries blocks).",
    TRAFFIC_LABELS,
    registry=REGISTRY,
)
requests = Counter(
    "pdfabric_requests_total",
    "Transfer requests (rooms) finished, by outcome.",
    ["pdcluster", "role", "outcome"],
    registry=REGISTRY,
)
request_duration = Histogram(
    "pdfabric_request_duration_seconds",
    "Submit to confirmed completion of a successful room (all batches done and the peer acknowledged).",
    ["pdcluster", "role", "backend", "transport"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
decode_completions = Counter(
    "pdfabric_decode_completions_total",
    "Sources of decode rooms seen complete, by how the decode agent learned it (completion board: no message after the data).",
    ["pdcluster", "how"],
    registry=REGISTRY,
)
api_refusals = Counter(
    "pdfabric_api_refusals_total",
    "API requests refused before they changed anything, by reason.",
    ["pdcluster", "reason"],
    registry=REGISTRY,
)
engine_up = Gauge(
    "pdfabric_engine_up",
    "1 while the rank's transfer engine is initialised with its pools registered.",
    ["pdcluster", "rank", "backend", "transport"],
    registry=REGISTRY,
)
agent_ready = Gauge(
    "pdfabric_agent_ready",
    "1 when the agent is ready (transport validated, engines up, API listening).",
    ["pdcluster"],
    registry=REGISTRY,
)
transport_info = Gauge(
    "pdfabric_transport_info",
    "1 for the transport this agent carries KV over (transport) and the one the rank map asked for (requested); they differ after a declared fallback.",
    ["pdcluster", "requested", "transport"],
    registry=REGISTRY,
)
pool_bytes = Gauge(
    "pdfabric_pool_bytes",
    "Registered pool size per rank and kind.",
    ["pdcluster", "rank", "kind", "device"],
    registry=REGISTRY,
)
peers_blacklisted = Gauge(
    "pdfabric_peers_blacklisted",
    "Peer agents currently blacklisted after a failed transfer (re-probed with backoff).",
    ["pdcluster"],
    registry=REGISTRY,
)
session_recoveries = Counter(
    "pdfabric_session_recoveries_total",
    "Blacklisted peers that answered a probe and were admitted again.",
    ["pdcluster"],
    registry=REGISTRY,
)
peer_probes = Counter(
    "pdfabric_peer_probes_total",
    "Probes of blacklisted peers, by result.",
    ["pdcluster", "result"],
    registry=REGISTRY,
)


integrity_checks = Counter(
    "pdfabric_integrity_checks_total",
    "Sources of a room whose checksum the decode agent compared with the sender's (spec.transfer.verify), by result.",
    ["pdcluster", "result"],
    registry=REGISTRY,
)
integrity_seconds = Histogram(
    "pdfabric_integrity_seconds",
    "Time to checksum one source's bytes of one room (either side), spec.transfer.verify.",
    ["pdcluster", "role"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    registry=REGISTRY,
)

# The per-peer view: `rank` is a local rank id, `peer` the agent the rank map gives the other side
# (never a name a request or report carried), `role` this side's role. The series are pre-created
# for every pair the rank map implies (``precreate_peers``): bounded by the cluster, not by traffic.
PEER_LABELS = ("pdcluster", "rank", "peer", "role")
PEER_BUCKETS = (0.005, 0.025, 0.1, 0.5, 2.5, 10.0)  # few buckets: series per pair stay small

peer_bytes = Counter(
    "pdfabric_peer_transfer_bytes_total",
    "Bytes confirmed moved between a local rank and a peer agent (prefill: per target, decode: per source).",
    PEER_LABELS,
    registry=REGISTRY,
)
peer_requests = Counter(
    "pdfabric_peer_requests_total",
    "A room's part between a local rank and one peer rank (prefill: a target, decode: a source) ended, by outcome.",
    [*PEER_LABELS, "outcome"],
    registry=REGISTRY,
)
peer_request_duration = Histogram(
    "pdfabric_peer_request_duration_seconds",
    "Submit to the end of a successful part with one peer rank (prefill: its acknowledgement, decode: its arrival).",
    PEER_LABELS,
    buckets=PEER_BUCKETS,
    registry=REGISTRY,
)
peer_transport_info = Gauge(
    "pdfabric_peer_transport_info",
    "1 per (local rank, peer agent) pair: the transport its KV travels over (transport), the one the rank map asked for (requested; they differ after a fallback) and the code path (path: the GPU kernel path for a peer on this node when the rank's backend has one, else the engine).",
    [*PEER_LABELS, "requested", "transport", "path"],
    registry=REGISTRY,
)
# The pre-flight link check (probe.py): set once a peer is probed (no series before: not measured).
peer_probe_bandwidth = Gauge(
    "pdfabric_peer_probe_bandwidth_gbps",
    "Pre-flight link check: GB/s (1e9 bytes/s) a probe write of a few MiB from a local rank into the peer agent's probe region reached over the chosen transport; 0 when the probe failed.",
    PEER_LABELS,
    registry=REGISTRY,
)
peer_probe_latency = Gauge(
    "pdfabric_peer_probe_latency_seconds",
    "Pre-flight link check: median time of a small (4 KiB) probe write from a local rank to the peer agent's probe region, engine call to confirmed.",
    PEER_LABELS,
    registry=REGISTRY,
)

# The serving engines the agent supervises (spec.engine; supervisor.py), one series per engine of
# the pod (engine: its name, prefill-0), at zero from the start. Not the transfer engines above.
serving_engine_sandboxed = Gauge(
    "pdfabric_serving_engine_sandboxed",
    "1 when the agent starts its serving engines in the Landlock sandbox that hides the peer key from them "
    "(spec.engine.sandbox), 0 when they run without it (Disabled, or BestEffort on a kernel without Landlock).",
    ["pdcluster"],
    registry=REGISTRY,
)
serving_engine_ready = Gauge(
    "pdfabric_serving_engine_ready",
    "1 while the serving engine the agent runs answers its health path (the pod is ready only when every one does).",
    ["pdcluster", "engine", "role"],
    registry=REGISTRY,
)
serving_engine_restarts = Counter(
    "pdfabric_serving_engine_restarts",
    "Runs of a serving engine that ended (an exit, a kill after failed health probes, a program not found), each followed by a restart.",
    ["pdcluster", "engine", "role"],
    registry=REGISTRY,
)


# The peer certificate the operator renews in place (tls.PeerTls): each changed set the agent saw,
# loaded, or refused (it does not load: a key that is not its certificate's) and tried again.
rankmap_reloads = Counter(
    "pdfabric_rankmap_reloads",
    "Newer rank maps the agent read (a role was scaled): outcome adopted (it runs on it now), or refused (it cannot: its own pod is being replaced or deleted; /readyz says why).",
    ["pdcluster", "outcome"],
    registry=REGISTRY,
)
feed_subscribers = Gauge(
    "pdfabric_room_feed_subscribers",
    "Engine connections following a rank's room feed (GET /v1/events/{rank}): one per engine rank that polls its table.",
    ["pdcluster"],
    registry=REGISTRY,
)
feed_dropped = Counter(
    "pdfabric_room_feed_dropped_total",
    "Room feed subscribers dropped for falling 65536 views behind (the engine resynchronises from a snapshot).",
    ["pdcluster"],
    registry=REGISTRY,
)
rankmap_peers = Gauge(
    "pdfabric_rankmap_peers",
    "Agents of the rank map this agent runs on, itself included (state current), and agents a newer map dropped that still drain their rooms (state leaving).",
    ["pdcluster", "state"],
    registry=REGISTRY,
)
peer_series_pairs = Gauge(
    "pdfabric_peer_series_pairs",
    "(local rank, peer agent) pairs of the per-peer view: those the rank map implies for this agent (state implied) and those whose series it exports now (state held), at most PDFABRIC_PEER_SERIES_MAX.",
    ["pdcluster", "state"],
    registry=REGISTRY,
)
peer_series_evictions = Counter(
    "pdfabric_peer_series_evictions",
    "Pairs whose per-peer series were removed to hold the bound PDFABRIC_PEER_SERIES_MAX (the least recently active pair makes room for a newly active one; its counters start again at zero when it is active again).",
    ["pdcluster"],
    registry=REGISTRY,
)
peer_stream_frames = Counter(
    "pdfabric_peer_stream_frames_total",
    "Peer messages this agent received as frames of a peer's stream (GET /v1/peer/stream) rather than as POSTs.",
    ["pdcluster"],
    registry=REGISTRY,
)
input_refusals = Counter(
    "pdfabric_input_refusals",
    "Reads of a file the agent re-reads while it serves (input rankmap, peer-certificate, peers-file) that it refused: unreadable or not parsing. The agent keeps what it runs on; /readyz says why under inputsRefused until a read is taken. Counted once per failing content.",
    ["pdcluster", "input"],
    registry=REGISTRY,
)
peer_certificate_reloads = Counter(
    "pdfabric_peer_certificate_reloads",
    "Changed peer certificate files the agent saw (the operator renewed them in place): outcome loaded, or refused and tried again.",
    ["pdcluster", "outcome"],
    registry=REGISTRY,
)


def precreate(cluster: str, role: str, backend: str, transport: str, paths: tuple[str, ...]) -> None:
    """Create every closed-set series at zero for this agent's identity."""
    for path in paths:
        for kind in Kind:
            transfer_bytes.labels(cluster, role, backend, transport, path, kind.value)
        transfer_blocks.labels(cluster, role, backend, transport, path)
        transfer_batches.labels(cluster, role, backend, transport, path)
    for outcome in Outcome:
        requests.labels(cluster, role, outcome.value)
    for reason in Refusal:
        api_refusals.labels(cluster, reason.value)
    for how in Completion:
        decode_completions.labels(cluster, how.value)
    for check in Integrity:
        integrity_checks.labels(cluster, check.value)
    integrity_seconds.labels(cluster, role)
    request_duration.labels(cluster, role, backend, transport)
    state_bytes_skipped.labels(cluster, backend)
    peers_blacklisted.labels(cluster)
    session_recoveries.labels(cluster)
    peer_stream_frames.labels(cluster)
    peer_series_evictions.labels(cluster)
    for state in ("implied", "held"):
        peer_series_pairs.labels(cluster, state)
    for result in ("ok", "failed"):
        peer_probes.labels(cluster, result)
    agent_ready.labels(cluster)


def peer_ranks(rankmap: RankMap, spec: PDClusterSpec, agent_name: str) -> set[tuple[str, str, str, Role]]:
    """(local rank id, peer agent, peer rank id, role) of every rank pair this agent's ranks can
    move bytes with, from the rank map and the duties alone: a prefill rank's targets in the
    decode replicas it feeds, a decode rank's expected sources in every prefill replica."""
    owner = {r.rank_id: a.name for a in rankmap.agents for r in a.ranks}
    entry = next(a for a in rankmap.agents if a.name == agent_name)
    pairs: set[tuple[str, str, str, Role]] = set()
    for rank in entry.ranks:
        peers: list[str] = []  # peer rank ids
        if rank.role is Role.PREFILL:
            pf = spec.prefill
            split = pf.dsa_cache_layer_split
            if rank.cp_rank not in sending_cp_ranks(
                pf.cp, all_cp_ranks_transfer=pf.all_cp_ranks_transfer, dsa_cache_layer_split=split
            ):
                continue  # a CP rank that sends nothing for this spec
            stage = decode_pp_stage(rank.pp_rank, pf.pp, spec.decode.pp)
            for replica in rankmap.feeds.get(rank.replica, tuple(range(spec.decode.replicas))):
                for dp, route in itertools.product(range(spec.decode.dp), decode_targets(spec, rank.tp_rank)):
                    peers.append(Rank(Role.DECODE, replica, route.decode_tp_rank, 0, stage, dp_rank=dp).rank_id)
        else:
            for replica, dp in itertools.product(range(spec.prefill.replicas), range(spec.prefill.dp)):
                for p, c, s in expected_sources(spec, rank.tp_rank, rank.pp_rank):
                    peers.append(Rank(Role.PREFILL, replica, p, c, s, dp_rank=dp).rank_id)
        pairs.update((rank.rank_id, owner[peer], peer, rank.role) for peer in peers if owner.get(peer))
    return pairs


def peer_pairs(rankmap: RankMap, spec: PDClusterSpec, agent_name: str) -> set[tuple[str, str, Role]]:
    """(local rank id, peer agent, role) of every pair ``peer_ranks`` names: the per-peer view."""
    return {(rank_id, peer, role) for rank_id, peer, _, role in peer_ranks(rankmap, spec, agent_name)}
