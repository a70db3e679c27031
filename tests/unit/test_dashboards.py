"""Shipped Grafana dashboards are generated, current, and query only metrics that exist."""

from __future__ import annotations

import json
import re
from typing import Any

import prometheus_client
import pytest

import gen_dashboards
from pdfabric_agent.runtime import metrics as agent_metrics
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


def test_panels_filter_by_the_namespace_and_pdcluster_variables() -> None:
    for uid, (_, panels, fabric) in gen_dashboards.DASHBOARDS.items():
        if not fabric:
            continue
        for panel in panels:
            for expr, _ in panel.exprs:
                for var in ("namespace", "pdcluster"):
                    assert f'{var}=~"${var}"' in expr, f"{uid}/{panel.title} ignores the {var} selector"


def test_no_query_names_a_cluster_label() -> None:
    # The PDCluster label is pdcluster; `cluster` belongs to multi-cluster Prometheus setups.
    for expr in gen_dashboards.all_exprs():
        assert not re.search(r"(?<![a-z_])cluster\b\s*(=|!=|=~|!~)|\$cluster\b", expr), expr
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
            assert "cluster" not in re.split(r"\s*,\s*", group.strip()), expr


def test_peer_panels_filter_by_the_peer_variable() -> None:
    peer_panels = [p for p in gen_dashboards.PEER_PANELS if p.kind != "row"]
    assert peer_panels
    for panel in peer_panels:
        for expr, _ in panel.exprs:
            assert 'peer=~"$peer"' in expr, f"{panel.title} ignores the peer selector"


def dashboard(uid: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((gen_dashboards.OUT_DIR / f"{uid}.json").read_text())
    return out


def test_fabric_dashboard_variables() -> None:
    variables = {v["name"]: v for v in dashboard("pdfabric-transfer")["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "pdcluster", "peer"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "pdcluster", "peer"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"]["uid"] == "${datasource}"
        assert var["query"].startswith("label_values(")
        assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"
    # each narrows by the ones before it
    assert '$namespace"' in variables["pdcluster"]["query"]
    assert '$pdcluster"' in variables["peer"]["query"]
    assert [v["name"] for v in dashboard("pdfabric-operator")["templating"]["list"]] == ["datasource"]


@pytest.mark.parametrize("uid", list(gen_dashboards.DASHBOARDS))
def test_panels_tile_the_grid(uid: str) -> None:
    taken: set[tuple[int, int]] = set()
    panels = dashboard(uid)["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{p['title']} overflows the grid"
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


@pytest.mark.parametrize("expr", gen_dashboards.all_exprs())
def test_concrete_queries_name_no_variable(expr: str) -> None:
    assert "$" not in gen_dashboards.concrete(expr, pdcluster="pd", namespace="ns", peer="pd-decode-0")
