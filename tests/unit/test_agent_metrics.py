"""Metrics: one declaration each, pdfabric_ names, closed label sets pre-created at zero, and
docs/metrics.md generated from the agent's and the operator's registries (fails when stale)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

import gen_metrics_docs
from pdfabric_agent.runtime import metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
GENERATOR = ROOT / "hack" / "gen_metrics_docs.py"


def test_docs_metrics_md_is_current() -> None:
    # A fresh process: this one's registries hold whatever series earlier tests created.
    gen = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=120, check=False
    )
    assert gen.returncode == 0, gen.stderr


def test_every_registered_metric_is_in_the_reference() -> None:
    # The reference walks the registry: a metric nobody listed anywhere still gets its row.
    registry = CollectorRegistry()
    Counter("pdfabric_unlisted_total", "Declared, registered, listed nowhere.", ["outcome"], registry=registry)
    assert "| `pdfabric_unlisted_total` | counter | `outcome` | Declared, registered, listed nowhere. |" in (
        gen_metrics_docs.table(registry)
    )
    text = DOC.read_text()
    for registry in (metrics.REGISTRY, prometheus_client.REGISTRY):
        for m in gen_metrics_docs.declared(registry):
            assert f"| `{gen_metrics_docs.series_name(m)}` |" in text


@pytest.mark.parametrize(
    ("registry", "prefix"),
    [(metrics.REGISTRY, "pdfabric_"), (prometheus_client.REGISTRY, "pdfabric_operator_")],
    ids=["agent", "operator"],
)
def test_names_follow_the_rule(registry: CollectorRegistry, prefix: str) -> None:
    declared = gen_metrics_docs.declared(registry)
    assert declared
    for m in declared:
        assert m._name.startswith(prefix), m._name
        assert m._documentation
        if m._type == "gauge" or m._type == "histogram":
            assert not m._name.endswith("_total"), m._name
    names = [m._name for m in declared]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("registry", [metrics.REGISTRY, prometheus_client.REGISTRY], ids=["agent", "operator"])
def test_no_metric_has_a_cluster_label(registry: CollectorRegistry) -> None:
    # `cluster` is the Kubernetes cluster in multi-cluster Prometheus setups (external labels,
    # relabelling): a PDCluster's name in it would collide. Ours is `pdcluster`.
    for m in gen_metrics_docs.declared(registry):
        assert "cluster" not in m._labelnames, m._name
        assert "namespace" not in m._labelnames, f"{m._name}: namespace comes from the scrape"


def test_precreate_exposes_every_outcome_kind_and_reason_at_zero() -> None:
    metrics.precreate("unit-cluster", "prefill", "mooncake", "tcp", ("mooncake", "tcp-side-channel"))
    text = generate_latest(metrics.REGISTRY).decode()
    for outcome in metrics.Outcome:
        assert (
            f'pdfabric_requests_total{{outcome="{outcome.value}",pdcluster="unit-cluster",role="prefill"}} 0.0' in text
        )
    for kind in metrics.Kind:
        line = (
            f'pdfabric_transfer_bytes_total{{backend="mooncake",kind="{kind.value}",path="tcp-side-channel",'
            f'pdcluster="unit-cluster",role="prefill",transport="tcp"}} 0.0'
        )
        assert line in text
    for reason in metrics.Refusal:
        assert f'pdfabric_api_refusals_total{{pdcluster="unit-cluster",reason="{reason.value}"}} 0.0' in text
