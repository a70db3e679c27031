"""The shipped transfer dashboard's traffic panels as PNG, from a real Prometheus (Grafana itself
cannot be installed here): each panel's own queries (hack/gen_dashboards.py), with the dashboard's
variables set, run as range queries and plotted with matplotlib, one picture a panel.

`make demo` (hack/demo.py) writes docs/img/ fresh from its run; by hand, against any Prometheus
that scrapes agents:

    python hack/render_panels.py http://127.0.0.1:9090 --pdcluster demo --namespace demo --last 300
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, MaxNLocator

import gen_dashboards

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "img"
# The panels that show traffic; the README shows them. Titles as in gen_dashboards.TRANSFER_PANELS.
TRAFFIC_PANELS = (
    "KV transfer throughput by kind",
    "Throughput by transport and path",
    "Requests by outcome",
    "Submit-to-completion latency",
    "State bytes saved by CP dedup",
    "Bytes/s by rank -> peer",
    "p99 latency by pair",
)
# Grafana's dark theme, near enough.
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d")

# A range query: (PromQL, start, end, step seconds) -> Prometheus' result matrix.
RangeQuery = Callable[[str, float, float, float], list[dict[str, Any]]]


def http_range_query(url: str) -> RangeQuery:
    def query(expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})
        with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"query_range {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    return query


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def scaled(unit: str) -> Callable[[float, object], str]:
    """Axis labels in the panel's Grafana unit."""

    def fmt(value: float, _pos: object = None) -> str:
        if unit in ("Bps", "bytes"):
            suffix = "/s" if unit == "Bps" else ""
            for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
                if abs(value) >= scale:
                    return f"{value / scale:.3g} {name}{suffix}"
            return f"{value:.3g} B{suffix}"
        if unit == "s":
            return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
        if unit == "percentunit":
            return f"{value * 100:.3g}%"
        return f"{value:.3g} {dict(reqps='req/s', ops='ops/s').get(unit, '')}".rstrip()

    return fmt


def render_panel(
    panel: gen_dashboards.Panel,
    query: RangeQuery,
    start: float,
    end: float,
    out: Path,
    *,
    rate: str,
    step: float,
    **variables: str,
) -> int:
    """Plots the panel's queries over [start, end]; returns the number of series drawn."""
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    fig.patch.set_facecolor(BACKGROUND)
    ax.set_facecolor(PANEL)
    drawn = 0
    for expr, fmt in panel.exprs:
        for series in query(gen_dashboards.concrete(expr, rate=rate, **variables), start, end, step):
            points = [(float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=PALETTE[drawn % len(PALETTE)], linewidth=1.6, label=legend(fmt, series["metric"]))
            drawn += 1
    ax.set_title(panel.title, color=TEXT, loc="left", fontsize=11)
    ax.set_xlabel("seconds into the run", color=TEXT, fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(scaled(panel.unit)))
    ax.yaxis.set_major_locator(MaxNLocator(5))
    ax.tick_params(colors=TEXT, labelsize=8)
    ax.grid(color=GRID, linewidth=0.6)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if drawn:
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False, labelcolor=TEXT)
    else:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", color=TEXT)
    fig.tight_layout()
    fig.savefig(out, facecolor=BACKGROUND)
    plt.close(fig)
    return drawn


def render(
    query: RangeQuery,
    start: float,
    end: float,
    out_dir: Path = OUT_DIR,
    *,
    rate: str = "5s",
    step: float = 1,
    **variables: str,
) -> dict[str, int]:
    """Every traffic panel to out_dir/<slug>.png; returns the series drawn per file."""
    panels = {p.title: p for _, ps, _ in gen_dashboards.DASHBOARDS.values() for p in ps}
    missing = [t for t in TRAFFIC_PANELS if t not in panels]
    assert not missing, f"no such panels in hack/gen_dashboards.py: {missing}"
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for title in TRAFFIC_PANELS:
        name = f"panel-{slug(title)}.png"
        drawn[name] = render_panel(panels[title], query, start, end, out_dir / name, rate=rate, step=step, **variables)
    return drawn


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prometheus", help="Prometheus base URL")
    parser.add_argument("--pdcluster", default=".*", help="the PDCluster variable (a regex; All by default)")
    parser.add_argument("--namespace", default=".*", help="the namespace variable (a regex; All by default)")
    parser.add_argument("--last", type=float, default=600, help="seconds back from now")
    parser.add_argument("--rate", default="5s", help="what $__rate_interval becomes")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    end = time.time()
    drawn = render(
        http_range_query(args.prometheus.rstrip("/")),
        end - args.last,
        end,
        args.out,
        rate=args.rate,
        step=max(1.0, args.last / 600),
        pdcluster=args.pdcluster,
        namespace=args.namespace,
    )
    for name, n in drawn.items():
        print(f"  {args.out / name}: {n} series")
    return 0 if all(drawn.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
