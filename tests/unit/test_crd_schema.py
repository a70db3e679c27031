"""The CRD file itself: names, printer columns, every CEL rule explains itself, chart copy identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.unit.charts import schema_nodes

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
CHART_CRD_DIR = ROOT / "charts" / "pdfabric" / "crds"


def _crd() -> dict[str, Any]:
    return yaml.safe_load((CRD_DIR / "pdcluster.yaml").read_text())


def test_names_scope_and_subresource() -> None:
    crd = _crd()
    assert crd["spec"]["group"] == "pdfabric.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["pdc"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    (version,) = _crd()["spec"]["versions"]
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols == {
        "Backend": ".spec.backend",
        "Transport": ".status.transport",
        "Prefill": ".status.prefillReady",
        "Decode": ".status.decodeReady",
        "Prefill-Engines": ".status.prefillEnginesReady",
        "Decode-Engines": ".status.decodeEnginesReady",
        "Router": ".status.router.ready",
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Reason": '.status.conditions[?(@.type=="Placed")].reason',
        "Age": ".metadata.creationTimestamp",
    }


def test_every_cel_rule_has_a_message() -> None:
    (version,) = _crd()["spec"]["versions"]
    rules = [
        (path, rule)
        for path, node in schema_nodes(version["schema"]["openAPIV3Schema"])
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 10
    for path, rule in rules:
        assert rule.get("message") or rule.get("messageExpression"), f"rule at {path} has no message"


def test_structural_schema_has_types() -> None:
    (version,) = _crd()["spec"]["versions"]
    for path, node in schema_nodes(version["schema"]["openAPIV3Schema"]):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_chart_ships_identical_crds() -> None:
    ours = sorted(p.name for p in CRD_DIR.glob("*.yaml"))
    assert ours, "crds/ is empty"
    assert sorted(p.name for p in CHART_CRD_DIR.glob("*.yaml")) == ours
    for name in ours:
        assert (CHART_CRD_DIR / name).read_bytes() == (CRD_DIR / name).read_bytes(), (
            f"{name} differs; copy it: cp crds/*.yaml charts/pdfabric/crds/"
        )


def test_api_reference_is_generated_from_the_crd() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "hack" / "gen_api_docs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "api.md").read_text() == gen.render(), "docs/api.md is stale; run hack/gen_api_docs.py"


def test_every_field_has_a_description_for_kubectl_explain() -> None:
    (version,) = _crd()["spec"]["versions"]
    missing = [
        path
        for path, node in schema_nodes(version["schema"]["openAPIV3Schema"])
        # .metadata: the API server allows nothing there but name and generateName (explain shows ObjectMeta's).
        if path not in ("", ".metadata") and not path.endswith("[]") and not str(node.get("description") or "").strip()
    ]
    assert not missing, f"fields without a description (kubectl explain shows nothing): {missing}"


SCHEMA_KEYWORDS = {
    "type", "description", "properties", "items", "required", "default", "enum", "format", "minimum", "maximum",
    "exclusiveMinimum",
    "minLength", "maxLength", "minItems", "maxItems", "maxProperties", "pattern", "additionalProperties", "anyOf",
    "x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "nullable",
}  # fmt: skip


def test_every_schema_node_holds_only_schema_keywords() -> None:
    # An unquoted ", " in a flow-style description splits it into a stray key the API server refuses.
    (version,) = _crd()["spec"]["versions"]
    for path, node in schema_nodes(version["schema"]["openAPIV3Schema"]):
        assert set(node) <= SCHEMA_KEYWORDS, f"{path}: {sorted(set(node) - SCHEMA_KEYWORDS)}"
