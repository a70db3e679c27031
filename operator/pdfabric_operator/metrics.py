"""Every operator metric, declared once. Names: pdfabric_operator_<noun>_<verb>_<unit suffix>.

Label values come from Enums and are pre-created, so each series exists at zero before the first
event (a dashboard can tell "no failures" from "no data"). The per-PDCluster gauges are the
exception: a series exists while the operator reconciles that PDCluster. Their labels are
pdcluster_namespace and pdcluster, not namespace and cluster: a scrape of the operator sets
namespace to the operator's own, and cluster is the multi-cluster label of many Prometheus setups.
"""

from __future__ import annotations

import enum

from prometheus_client import Counter, Gauge, Histogram

from pdfabric_operator.placement import PlacementReason


class ReconcileResult(enum.StrEnum):
    READY = "ready"  # placed and every agent Ready
    PROGRESSING = "progressing"  # placed, agents not all Ready yet
    UNPLACED = "unplaced"  # no fit: Placed=False
    INVALID = "invalid"  # spec rejected by parse_spec
    ERROR = "error"  # an API call failed; retried on the next wake or interval


class WakeCause(enum.StrEnum):
    """What started a PDCluster's reconcile (one reconcile may have several)."""

    SPEC = "spec"  # a new generation of the PDCluster
    PDROLE = "pdrole"  # a PDRole's spec (kubectl scale, an autoscaler) or its deletion
    POD = "pod"  # an event of one of its pods
    NODE = "node"  # a node's placement inputs changed (readiness, capacity, labels, taints)
    RETRY = "retry"  # the last reconcile or PDRole sync failed
    UNSETTLED = "unsettled"  # agents not yet on the rank map last written: read again soon
    INTERVAL = "interval"  # nothing happened for PDFABRIC_RECONCILE_INTERVAL
    RESYNC = "resync"  # satisfied, no engines: nothing happened for PDFABRIC_RESYNC_INTERVAL
    CERTIFICATE = "certificate"  # satisfied, and an agent's peer certificate came due for renewal


class ErrorType(enum.StrEnum):
    API_CONFLICT = "api_conflict"
    API_NOT_FOUND = "api_not_found"
    API_FORBIDDEN = "api_forbidden"
    API_SERVER = "api_server"
    API_OTHER = "api_other"
    INTERNAL = "internal"


RECONCILES = Counter("pdfabric_operator_reconciles_total", "PDCluster reconciles by result.", ["result"])
RECONCILE_CAUSES = Counter(
    "pdfabric_operator_reconcile_causes_total",
    "What started PDCluster reconciles, by cause (a reconcile with several causes counts under each).",
    ["cause"],
)
RECONCILE_DURATION = Histogram(
    "pdfabric_operator_reconcile_duration_seconds",
    "Wall time of one PDCluster reconcile (plan, apply children, write status).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ERRORS = Counter("pdfabric_operator_errors_total", "Reconcile errors by type.", ["type"])
PLACEMENT_FAILURES = Counter(
    "pdfabric_operator_placement_failures_total", "Reconciles that found no placement, by reason.", ["reason"]
)
PLACEMENT_SHORTFALLS = Counter(
    "pdfabric_operator_placement_shortfalls_total",
    "Reconciles of a running PDCluster that placed fewer replicas than asked (the rest wait for room), by reason.",
    ["reason"],
)
FALLBACKS = Counter("pdfabric_operator_transport_fallbacks_total", "Placements that used the declared TCP fallback.")
API_REQUESTS = Counter(
    "pdfabric_operator_api_requests_total",
    "Kubernetes API requests the reconciler made (kopf's watches excluded), by verb and resource.",
    ["verb", "resource"],
)
CLUSTERS = Gauge("pdfabric_operator_clusters", "PDClusters this operator reconciles now.")
PDCLUSTER_READY = Gauge(
    "pdfabric_operator_pdcluster_ready",
    "1 while the PDCluster's Ready condition is True (a rolling update included), else 0.",
    ["pdcluster_namespace", "pdcluster"],
)
PDCLUSTER_PLACED = Gauge(
    "pdfabric_operator_pdcluster_placed",
    "1 while the PDCluster's Placed condition is True (the declared TCP fallback included), else 0.",
    ["pdcluster_namespace", "pdcluster"],
)
PDCLUSTER_UNPLACED = Gauge(
    "pdfabric_operator_pdcluster_unplaced_replicas",
    "Replicas of a role the PDCluster's spec asks for that no node has room for (all of them while it is not placed).",
    ["pdcluster_namespace", "pdcluster", "role"],
)

for _r in ReconcileResult:
    RECONCILES.labels(_r.value)
for _cause in WakeCause:
    RECONCILE_CAUSES.labels(_cause.value)
for _e in ErrorType:
    ERRORS.labels(_e.value)
for _reason in PlacementReason:
    PLACEMENT_FAILURES.labels(_reason.value)
    PLACEMENT_SHORTFALLS.labels(_reason.value)
