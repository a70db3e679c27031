"""The chart rendered as the unit tests read it: helm (built by make binaries) on charts/pdfabric;
the operator's grants in it, and every node of a CRD schema."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdfabric"


def helm() -> str:
    candidates = [os.path.join(os.environ.get("PDFABRIC_BIN_DIR", ""), "helm")]
    cache = os.environ.get("PDFABRIC_CACHE", os.path.expanduser("~/.cache/pdfabric"))
    candidates += sorted(glob.glob(os.path.join(cache, "controlplane-*", "bin", "helm")))
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    pytest.skip("helm is not built yet (make binaries)")


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60, check=False)


def render(*args: str) -> list[dict[str, Any]]:
    proc = run_helm("template", "pdfabric", str(CHART), "-n", "pdfabric-system", *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def operator_grants() -> dict[tuple[str, str], set[str]]:
    """The verbs the chart's operator ClusterRole grants, by (API group, resource)."""
    (role,) = [d for d in render() if d["kind"] == "ClusterRole"]
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def schema_nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every node of an OpenAPI schema with its path (.spec.prefill.tp, .spec.x[] for items)."""
    out = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        out += schema_nodes(sub, f"{path}.{key}")
    if "items" in schema:
        out += schema_nodes(schema["items"], f"{path}[]")
    return out
