"""Grafana dashboards as code: writes charts/pdfabric/dashboards/*.json.

The chart ships them as ConfigMaps labelled grafana_dashboard: "1". Every panel's query uses only
metrics the agent and operator declare; tests/unit/test_dashboards.py fails when the JSON is
stale or a query names an unknown metric, and the e2e tests run every query against a real
Prometheus scraping real agents.

    python hack/gen_dashboards.py          # rewrite the JSON
    python hack/gen_dashboards.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "charts" / "pdfabric" / "dashboards"
RATE = "$__rate_interval"
SEL = 'cluster=~"$cluster"'


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat", "table" (instant, full width), "row" (a section header)
    description: str = ""


def row(title: str) -> Panel:
    """A section header: the panels after it, up to the next row, are laid out below it."""
    return Panel(title, (), kind="row")


def peer_p99(by: str) -> str:
    return (
        f"histogram_quantile(0.99, sum by ({by}) (rate(pdfabric_peer_request_duration_seconds_bucket"
        f'{{{SEL}, role="prefill"}}[{RATE}])))'
    )


# The per-peer view (bounded: one series set per local rank and peer agent the rank map implies).
PEER_PANELS = (
    row("Peers"),
    Panel(
        "Bytes/s by rank -> peer",
        (
            (
                f'sum by (rank, peer) (rate(pdfabric_peer_transfer_bytes_total{{{SEL}, role="prefill"}}[{RATE}]))',
                "{{rank}} -> {{peer}}",
            ),
        ),
        unit="Bps",
        description="Bytes each prefill rank moved to each decode agent (confirmed, per target).",
    ),
    Panel(
        "p99 latency by pair",
        ((peer_p99("le, rank, peer"), "{{rank}} -> {{peer}}"),),
        unit="s",
        description="Submit to the decode agent's acknowledgement of that target, per prefill rank and decode agent.",
    ),
    Panel(
        "Failures by pair",
        (
            (
                f'sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{SEL}, outcome!="success"}}[{RATE}]))',
                "{{role}} {{rank}} / {{peer}}",
            ),
        ),
        unit="reqps",
        description="Failed and timed-out parts of rooms, from both sides: the rank and the peer agent it waited on.",
    ),
    Panel(
        "Pair success ratio",
        (
            (
                f'sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{SEL}, outcome="success"}}[{RATE}])) '
                f"/ sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{SEL}}}[{RATE}]))",
                "{{role}} {{rank}} / {{peer}}",
            ),
        ),
        unit="percentunit",
    ),
    Panel(
        "Slowest pairs (p99, top 10)",
        ((f"sort_desc(topk(10, {peer_p99('le, cluster, rank, peer')}))", ""),),
        unit="s",
        kind="table",
        description="The slow pair is the first row: the prefill rank and the decode agent between which parts "
        "of rooms take longest to be acknowledged.",
    ),
)


TRANSFER_PANELS = (
    Panel(
        "KV transfer throughput by kind",
        ((f'sum by (kind) (rate(pdfabric_transfer_bytes_total{{{SEL}, role="prefill"}}[{RATE}]))', "{{kind}}"),),
        unit="Bps",
        description="Bytes the engine confirmed written by prefill ranks (kv, state, aux).",
    ),
    Panel(
        "Throughput by transport and path",
        (
            (
                f'sum by (transport, path) (rate(pdfabric_transfer_bytes_total{{{SEL}, role="prefill"}}[{RATE}]))',
                "{{transport}} / {{path}}",
            ),
        ),
        unit="Bps",
        description="Which transport and code path (engine, side channel, GPU kernel) carried the bytes.",
    ),
    Panel(
        "Requests by outcome",
        ((f"sum by (role, outcome) (rate(pdfabric_requests_total{{{SEL}}}[{RATE}]))", "{{role}} {{outcome}}"),),
        unit="reqps",
    ),
    Panel(
        "Submit-to-completion latency",
        tuple(
            (
                f"histogram_quantile({q}, sum by (le) (rate(pdfabric_request_duration_seconds_bucket"
                f'{{{SEL}, role="prefill"}}[{RATE}])))',
                f"p{int(q * 100)}",
            )
            for q in (0.5, 0.9, 0.99)
        ),
        unit="s",
        description="From the API call to the decode side's confirmation (not from the last chunk).",
    ),
    Panel(
        "How decode learned completion",
        ((f"sum by (how) (rate(pdfabric_decode_completions_total{{{SEL}}}[{RATE}]))", "{{how}}"),),
        unit="ops",
        description="completion-board: the decode agent read the GPU kernel's completion word itself; "
        "done-report: it waited for the sender's report.",
    ),
    Panel(
        "State bytes saved by CP dedup",
        ((f"sum(rate(pdfabric_state_dedup_skipped_bytes_total{{{SEL}}}[{RATE}]))", "saved"),),
        unit="Bps",
        description="State that CP ranks other than 0 did not send (sglang #36025 rule).",
    ),
    Panel(
        "State traffic reduction by CP dedup",
        (
            (
                f"sum(increase(pdfabric_state_dedup_skipped_bytes_total{{{SEL}}}[1h])) / "
                f"(sum(increase(pdfabric_state_dedup_skipped_bytes_total{{{SEL}}}[1h])) + "
                f'sum(increase(pdfabric_transfer_bytes_total{{{SEL}, role="prefill", kind="state"}}[1h])))',
                "reduction",
            ),
        ),
        unit="percentunit",
        kind="stat",
    ),
    Panel(
        "Blocks per engine batch",
        (
            (
                f'sum(rate(pdfabric_transfer_blocks_total{{{SEL}, role="prefill"}}[{RATE}])) / '
                f'sum(rate(pdfabric_transfer_batches_total{{{SEL}, role="prefill"}}[{RATE}]))',
                "blocks/batch",
            ),
        ),
        description="After page coalescing; capped by maxBatchEntries.",
    ),
    Panel("Engines up", ((f"sum by (transport) (pdfabric_engine_up{{{SEL}}})", "{{transport}}"),), kind="stat"),
    Panel("Agents ready", ((f"sum(pdfabric_agent_ready{{{SEL}}})", "ready"),), kind="stat"),
    Panel(
        "Peers blacklisted",
        ((f"sum by (cluster) (pdfabric_peers_blacklisted{{{SEL}}})", "{{cluster}}"),),
        description="Peers failed once and re-probed with backoff.",
    ),
    Panel(
        "API refusals by reason",
        ((f"sum by (reason) (rate(pdfabric_api_refusals_total{{{SEL}}}[{RATE}]))", "{{reason}}"),),
        unit="reqps",
    ),
    Panel(
        "Registered pool memory",
        ((f"sum by (kind, device) (pdfabric_pool_bytes{{{SEL}}})", "{{kind}} on {{device}}"),),
        unit="bytes",
    ),
    *PEER_PANELS,
)

OPERATOR_PANELS = (
    Panel(
        "Reconciles by result",
        ((f"sum by (result) (rate(pdfabric_operator_reconciles_total[{RATE}]))", "{{result}}"),),
        unit="ops",
    ),
    Panel(
        "Reconcile duration p99",
        (
            (
                f"histogram_quantile(0.99, sum by (le) (rate(pdfabric_operator_reconcile_duration_seconds_bucket[{RATE}])))",
                "p99",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Errors by type",
        ((f"sum by (type) (rate(pdfabric_operator_errors_total[{RATE}]))", "{{type}}"),),
        unit="ops",
    ),
    Panel(
        "Placement failures by reason",
        ((f"sum by (reason) (rate(pdfabric_operator_placement_failures_total[{RATE}]))", "{{reason}}"),),
        unit="ops",
    ),
    Panel("PDClusters reconciled", (("sum(pdfabric_operator_clusters)", "clusters"),), kind="stat"),
)

DASHBOARDS = {
    "pdfabric-transfer": ("pdfabric: KV transfer fabric", TRANSFER_PANELS, True),
    "pdfabric-operator": ("pdfabric: operator", OPERATOR_PANELS, False),
}


def all_exprs() -> list[str]:
    return [e for _, panels, _ in DASHBOARDS.values() for p in panels for e, _ in p.exprs]


def build(uid: str, title: str, panels: tuple[Panel, ...], cluster_var: bool) -> dict[str, object]:
    out_panels: list[dict[str, object]] = []
    top, n = 0, 0  # the current section's top row and its panel count (two panels a row)
    for i, panel in enumerate(panels):
        if panel.kind == "row":
            top += ((n + 1) // 2) * 8
            out_panels.append(
                {
                    "id": i + 1,
                    "type": "row",
                    "title": panel.title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": top},
                    "panels": [],
                }
            )
            top, n = top + 1, 0
            continue
        width = {"stat": 8, "table": 24}.get(panel.kind, 12)
        if panel.kind == "table" and n % 2:
            n += 1  # a full-width table starts a row of its own
        grid = {"h": 8, "w": width, "x": (n % 2) * 12, "y": top + (n // 2) * 8}
        n += 2 if panel.kind == "table" else 1
        table = {"format": "table", "instant": True} if panel.kind == "table" else {}
        out_panels.append(
            {
                "id": i + 1,
                "type": panel.kind,
                "title": panel.title,
                "description": panel.description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": grid,
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend, **table}
                    for j, (expr, legend) in enumerate(panel.exprs)
                ],
            }
        )
    variables: list[dict[str, object]] = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}
    ]
    if cluster_var:
        variables.append(
            {
                "name": "cluster",
                "type": "query",
                "label": "PDCluster",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": "label_values(pdfabric_agent_ready, cluster)", "refId": "cluster"},
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "refresh": 2,
            }
        )
    return {
        "uid": uid,
        "title": title,
        "tags": ["pdfabric"],
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": variables},
        "panels": out_panels,
    }


def render() -> dict[str, str]:
    return {
        f"{uid}.json": json.dumps(build(uid, title, panels, var), indent=2, sort_keys=True) + "\n"
        for uid, (title, panels, var) in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [n for n, text in files.items() if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != text]
        if stale:
            print(f"stale dashboards {stale}: run python hack/gen_dashboards.py", file=sys.stderr)
            return 1
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(files)} dashboards to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
