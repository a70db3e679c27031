"""Metrics: one declaration each, pdfabric_ names, closed label sets pre-created at zero, and
docs/metrics.md generated from the module (fails when stale)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from pdfabric_agent import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_docs_metrics_md_is_current() -> None:
    assert DOC.read_text() == metrics.render_markdown(), (
        "docs/metrics.md is stale: run `python -m pdfabric_agent.metrics > docs/metrics.md`"
    )


def test_names_follow_the_rule() -> None:
    for m in metrics.ALL_METRICS:
        assert m._name.startswith("pdfabric_"), m._name
        assert m._documentation
        if m._type == "gauge" or m._type == "histogram":
            assert not m._name.endswith("_total"), m._name
    names = [m._name for m in metrics.ALL_METRICS]
    assert len(names) == len(set(names))


def test_precreate_exposes_every_outcome_kind_and_reason_at_zero() -> None:
    metrics.precreate("unit-cluster", "prefill", "mooncake", "tcp", ("mooncake", "tcp-side-channel"))
    text = generate_latest(metrics.REGISTRY).decode()
    for outcome in metrics.Outcome:
        assert f'pdfabric_requests_total{{cluster="unit-cluster",outcome="{outcome.value}",role="prefill"}} 0.0' in text
    for kind in metrics.Kind:
        line = (
            f'pdfabric_transfer_bytes_total{{backend="mooncake",cluster="unit-cluster",kind="{kind.value}",'
            f'path="tcp-side-channel",role="prefill",transport="tcp"}} 0.0'
        )
        assert line in text
    for reason in metrics.Refusal:
        assert f'pdfabric_api_refusals_total{{cluster="unit-cluster",reason="{reason.value}"}} 0.0' in text
