"""The chart's alert rules (charts/pdfabric/files/alerts.yaml, rendered by helm with the default
thresholds): `promtool check rules` accepts them and `promtool test rules` (tests/alerts/) shows
each alert firing in one case and staying silent in another. Every alert has a runbook section."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.charts import ROOT, render

TESTS = ROOT / "tests" / "alerts"
RUNBOOK = ROOT / "docs" / "alerts.md"


def _promtool() -> str:
    """promtool from hack/prometheus.sh (Debian's prometheus package unpacked in a cache)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "hack" / "prometheus.sh")], capture_output=True, text=True, timeout=300, check=False
    )
    lines = proc.stdout.strip().splitlines()
    path = os.path.join(lines[-1], "promtool") if proc.returncode == 0 and lines else ""
    if not os.access(path, os.X_OK):
        pytest.skip(f"promtool cannot be fetched (hack/prometheus.sh: {proc.stderr.strip()[-300:]})")
    return path


def _rule_spec(*args: str) -> dict[str, Any]:
    # With the operator's ServiceMonitor, which PDFabricOperatorDown needs (it is rendered only with it).
    sets = ("--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    docs = [d for d in render(*sets, *args) if d["kind"] == "PrometheusRule"]
    (rule,) = docs
    spec: dict[str, Any] = rule["spec"]
    return spec


def _alerts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in spec["groups"] for r in g["rules"]}


@pytest.fixture(scope="module")
def promtool() -> str:
    return _promtool()


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rule_spec(), sort_keys=False))
    for path in TESTS.glob("*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_promtool_check_rules(promtool: str, rules_dir: Path) -> None:
    proc = subprocess.run(
        [promtool, "check", "rules", str(rules_dir / "rules.yaml")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(_alerts(_rule_spec()))} rules found" in proc.stdout


def test_promtool_test_rules(promtool: str, rules_dir: Path) -> None:
    tests = sorted(p.name for p in TESTS.glob("*.yaml"))
    assert tests
    proc = subprocess.run(
        [promtool, "test", "rules", *tests], capture_output=True, text=True, timeout=120, cwd=rules_dir
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for path in TESTS.glob("*.yaml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = set(_alerts(_rule_spec()))
    assert names - fires == set(), "alerts with no firing case"
    assert names - silent == set(), "alerts with no silent case"


def test_every_alert_has_a_runbook_section() -> None:
    text = RUNBOOK.read_text()
    headings = {m.group(1) for m in re.finditer(r"^### (\w+)$", text, re.MULTILINE)}
    for name, rule in _alerts(_rule_spec()).items():
        assert name in headings, f"docs/alerts.md has no '### {name}'"
        assert rule["annotations"]["runbook"] == f"docs/alerts.md#{name.lower()}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}


def test_thresholds_come_from_values() -> None:
    alerts = _alerts(
        _rule_spec(
            "--set",
            "metrics.prometheusRule.alerts.transferLatencyP99.thresholdSeconds=3",
            "--set",
            "metrics.prometheusRule.alerts.peerBlacklisted.for=42m",
            "--set",
            "metrics.prometheusRule.alerts.servingEngineRestarting.threshold=5",
            "--set",
            "metrics.prometheusRule.alerts.servingEngineNotReady.for=40m",
            "--set",
            "metrics.prometheusRule.runbookBaseURL=https://runbooks.example/pdfabric",
        )
    )
    assert alerts["PDFabricTransferLatencyP99High"]["expr"].rstrip().endswith("> 3")
    assert alerts["PDFabricPeerBlacklisted"]["for"] == "42m"
    assert alerts["PDFabricServingEngineRestarting"]["expr"].rstrip().endswith("> 5")
    assert alerts["PDFabricServingEngineNotReady"]["for"] == "40m"
    assert alerts["PDFabricAgentNotReady"]["annotations"]["runbook_url"] == (
        "https://runbooks.example/pdfabric#pdfabricagentnotready"
    )
    assert "runbook_url" not in _alerts(_rule_spec())["PDFabricAgentNotReady"]["annotations"]


def test_cp_dedup_lookback_is_optional(promtool: str, tmp_path: Path) -> None:
    """The default keeps clusters that never dedup (dsaCacheLayerSplit) silent; lookback "" drops that."""
    default = _alerts(_rule_spec())["PDFabricCPDedupNotHappening"]
    assert "increase(pdfabric_state_dedup_skipped_bytes_total[1d])" in default["expr"]
    spec = _rule_spec("--set", "metrics.prometheusRule.alerts.cpDedupNotHappening.lookback=")
    without = _alerts(spec)["PDFabricCPDedupNotHappening"]
    assert "increase(" not in without["expr"] and "within" not in without["annotations"]["description"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_operator_down_needs_the_operator_scraped() -> None:
    docs = render("--set", "metrics.prometheusRule.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "PDFabricOperatorDown" not in names and "PDFabricPlacementFailing" in names
    assert "PDFabricOperatorDown" in _alerts(_rule_spec())


def test_no_alert_names_a_cluster_label() -> None:
    # The PDCluster label is pdcluster: `cluster` is the Kubernetes cluster in multi-cluster setups.
    label_use = re.compile(r"(?<![a-z_])cluster\b\s*(=|!=|=~|!~)|\$labels\.cluster\b")
    for name, rule in _alerts(_rule_spec()).items():
        assert not label_use.search(rule["expr"]), name
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", rule["expr"]):
            assert "cluster" not in re.split(r"\s*,\s*", group.strip()), name
        for text in rule.get("annotations", {}).values():
            assert not label_use.search(text), name
