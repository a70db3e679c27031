"""Grafana dashboards as code, built with Grafana's own grafana-foundation-sdk: writes
charts/pdfabric/dashboards/*.json.

The chart ships them as ConfigMaps labelled grafana_dashboard: "1". Every panel's query uses only
metrics the agent and operator declare and filters by the dashboard's variables (datasource,
namespace, PDCluster; the per-peer panels by peer too); tests/unit/test_dashboards.py fails when
the JSON is stale or a query names an unknown metric, and the e2e tests run every query against a
real Prometheus scraping real agents. hack/render_panels.py plots the traffic panels' queries.

    python hack/gen_dashboards.py          # rewrite the JSON
    python hack/gen_dashboards.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gtimeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as gmodel
from grafana_foundation_sdk.models import prometheus as gprom_model

OUT_DIR = Path(__file__).resolve().parents[1] / "charts" / "pdfabric" / "dashboards"
RATE = "$__rate_interval"
SEL = 'namespace=~"$namespace", pdcluster=~"$pdcluster"'
PEER_SEL = f'{SEL}, peer=~"$peer"'
DATASOURCE = gmodel.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The variables a query may name, and what a concrete query (e2e, hack/render_panels.py) puts there.
VARIABLES = ("namespace", "pdcluster", "peer")


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
        f'{{{PEER_SEL}, role="prefill"}}[{RATE}])))'
    )


# The per-peer view (bounded: one series set per local rank and peer agent the rank map implies).
PEER_PANELS = (
    row("Peers"),
    Panel(
        "Bytes/s by rank -> peer",
        (
            (
                f'sum by (rank, peer) (rate(pdfabric_peer_transfer_bytes_total{{{PEER_SEL}, role="prefill"}}[{RATE}]))',
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
                f'sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{PEER_SEL}, outcome!="success"}}[{RATE}]))',
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
                f'sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{PEER_SEL}, outcome="success"}}[{RATE}])) '
                f"/ sum by (role, rank, peer) (rate(pdfabric_peer_requests_total{{{PEER_SEL}}}[{RATE}]))",
                "{{role}} {{rank}} / {{peer}}",
            ),
        ),
        unit="percentunit",
    ),
    Panel(
        "Slowest pairs (p99, top 10)",
        ((f"sort_desc(topk(10, {peer_p99('le, pdcluster, rank, peer')}))", ""),),
        unit="s",
        kind="table",
        description="The slow pair is the first row: the prefill rank and the decode agent between which parts "
        "of rooms take longest to be acknowledged.",
    ),
)

# The serving engines the agents run (spec.engine; the agent's engines/supervisor.py): no series, so no data, for
# a fabric-only PDCluster whose engines are deployed by something else.
ENGINE_PANELS = (
    row("Serving engines"),
    Panel(
        "Serving engines ready by role",
        ((f"sum by (role) (pdfabric_serving_engine_ready{{{SEL}}})", "{{role}}"),),
        description="Engines whose health path answers 200 (model loading is not ready); a pod is Ready "
        "only when all its engines are.",
    ),
    Panel(
        "Serving engine restarts (1h)",
        (
            (
                f"sum by (pod, engine, role) (increase(pdfabric_serving_engine_restarts_total{{{SEL}}}[1h]))",
                "{{engine}} ({{role}}) on {{pod}}",
            ),
        ),
        description="Restarts by the agent over the last hour: an exit, a kill after failed health probes. "
        "The cause: lines prefixed [<engine>] in the agent's log, lastExit in the PDCluster's status.endpoints.",
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
    Panel("Engines up", ((f"sum by (transport) (pdfabric_engine_up{{{SEL}}})", "{{transport}}"),), kind="stat"),
    Panel("Agents ready", ((f"sum(pdfabric_agent_ready{{{SEL}}})", "ready"),), kind="stat"),
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
    Panel(
        "Peers blacklisted",
        ((f"sum by (pdcluster) (pdfabric_peers_blacklisted{{{SEL}}})", "{{pdcluster}}"),),
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
    *ENGINE_PANELS,
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


def concrete(expr: str, rate: str = "1m", **values: str) -> str:
    """A panel query as Grafana sends it: each variable replaced by its value (".*", All, when not
    given) and $__rate_interval by `rate`. For the e2e checks and hack/render_panels.py."""
    unknown = set(values) - set(VARIABLES)
    assert not unknown, f"no dashboard variable {sorted(unknown)}"
    for name in VARIABLES:
        expr = expr.replace(f"${name}", values.get(name, ".*"))
    return expr.replace(RATE, rate)


def query_variable(name: str, label: str, query: str) -> gdash.QueryVariable:
    """A multi-value variable from label_values(), All meaning any value (also a missing label)."""
    return (
        gdash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(gmodel.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(gmodel.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(gmodel.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def variables(fabric: bool) -> list[gdash.DatasourceVariable | gdash.QueryVariable]:
    out: list[gdash.DatasourceVariable | gdash.QueryVariable] = [
        gdash.DatasourceVariable("datasource").label("Data source").type("prometheus")
    ]
    if fabric:
        # namespace comes from the scrape (the PodMonitor's target labels), pdcluster and peer from the agent.
        out += [
            query_variable("namespace", "Namespace", "label_values(pdfabric_agent_ready, namespace)"),
            query_variable(
                "pdcluster", "PDCluster", 'label_values(pdfabric_agent_ready{namespace=~"$namespace"}, pdcluster)'
            ),
            query_variable(
                "peer",
                "Peer agent",
                'label_values(pdfabric_peer_transfer_bytes_total{namespace=~"$namespace", pdcluster=~"$pdcluster"}, peer)',
            ),
        ]
    return out


def panel_builder(panel: Panel, panel_id: int) -> gtimeseries.Panel | gstat.Panel | gtable.Panel:
    builder: gtimeseries.Panel | gstat.Panel | gtable.Panel
    if panel.kind == "stat":
        builder = gstat.Panel().span(8)
    elif panel.kind == "table":
        builder = gtable.Panel().span(24)
    else:
        builder = gtimeseries.Panel().span(12)
    builder.id(panel_id).title(panel.title).datasource(DATASOURCE).unit(panel.unit).height(8)
    if panel.description:
        builder.description(panel.description)
    for j, (expr, legend) in enumerate(panel.exprs):
        query = gprom.Dataquery().ref_id(chr(ord("A") + j)).expr(expr).legend_format(legend)
        if panel.kind == "table":
            query.instant().format(gprom_model.PromQueryFormat.TABLE)
        builder.with_target(query)
    return builder


def build(uid: str, title: str, panels: tuple[Panel, ...], fabric: bool) -> dict[str, object]:
    board = (
        gdash.Dashboard(title)
        .uid(uid)
        .tags(["pdfabric"])
        .version(1)
        .time("now-1h", "now")
        .refresh("30s")
        .variables(variables(fabric))  # type: ignore[arg-type]
    )
    for i, panel in enumerate(panels):
        if panel.kind == "row":
            board.with_row(gdash.Row(panel.title).id(i + 1))
        else:
            board.with_panel(panel_builder(panel, i + 1))
    out: dict[str, object] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return out


def render() -> dict[str, str]:
    return {
        f"{uid}.json": json.dumps(build(uid, title, panels, fabric), indent=2, sort_keys=True) + "\n"
        for uid, (title, panels, fabric) in DASHBOARDS.items()
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
