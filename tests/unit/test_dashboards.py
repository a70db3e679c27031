"""Shipped Grafana dashboards are generated, current, and query only metrics that exist."""

from __future__ import annotations

import re

import prometheus_client
import pytest

import gen_dashboards
from pdfabric_agent import metrics as agent_metrics
from pdfabric_operator import metrics as operator_metrics  # noqa: F401 - registers the operator metrics

SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def declared_series() -> set[str]:
    names: set[str] = set()
    # the operator registers on prometheus_client's default registry
    for registry in (agent_metrics.REGISTRY, prometheus_client.REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in SERIES_SUFFIXES)
    return names


def test_dashboard_json_is_current() -> None:
    assert gen_dashboards.main(["--check"]) == 0, "run python hack/gen_dashboards.py"


@pytest.mark.parametrize("expr", gen_dashboards.all_exprs())
def test_every_panel_queries_declared_metrics(expr: str) -> None:
    metric_names = {w for w in re.findall(r"\bpdfabric_[a-z_]+\b", expr)}
    assert metric_names, f"panel query names no pdfabric metric: {expr}"
    unknown = metric_names - declared_series()
    assert not unknown, f"{expr} queries undeclared metrics {sorted(unknown)}"


def test_panels_filter_by_the_cluster_variable() -> None:
    for uid, (_, panels, has_cluster_var) in gen_dashboards.DASHBOARDS.items():
        if not has_cluster_var:
            continue
        for panel in panels:
            for expr, _ in panel.exprs:
                assert '$cluster"' in expr, f"{uid}/{panel.title} ignores the PDCluster selector"
