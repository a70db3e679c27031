"""parse_spec: defaults equal the CRD's, and it rejects what the CRD rejects."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdfabric_core.policy.types import MemPool, Transport
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from tests.builders import INVALID_SPECS, merge, pdcluster

CRD = Path(__file__).resolve().parents[2] / "crds" / "pdcluster.yaml"


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_crd_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to `value` (objects only; enough here)."""
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_crd_defaults(sub, out[key])
    return out


def test_crd_defaults_equal_spec_defaults() -> None:
    defaulted = apply_crd_defaults(_spec_schema(), {})
    assert parse_spec(defaulted) == parse_spec({}) == PDClusterSpec()


def _leaf_defaults(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = {}
    for key, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            out.update(_leaf_defaults(sub, f"{path}{key}."))
        elif "default" in sub:
            out[f"{path}{key}"] = sub["default"]
    return out


def test_every_scalar_field_has_a_crd_default() -> None:
    # Fields without a default in the CRD must be optional maps (nodeSelector, resources).
    leaves = _leaf_defaults(_spec_schema())
    assert "transfer.transport" in leaves and leaves["transfer.transport"] == "auto"
    assert leaves["placement.nvlinkDomainKey"] == "nvidia.com/gpu.clique"
    # backend 1 + transfer 5 + prefill 6 + decode 4 + model 9 + placement 5 + agent 3
    assert len(leaves) == 33


@pytest.mark.parametrize(("patch", "fragment"), [c[1:] for c in INVALID_SPECS], ids=[c[0] for c in INVALID_SPECS])
def test_parse_spec_rejects_what_the_crd_rejects(patch: dict[str, Any], fragment: str) -> None:
    raw = apply_crd_defaults(_spec_schema(), merge(pdcluster().raw_spec(), patch))
    with pytest.raises(SpecError):
        parse_spec(raw)


# (id, transfer section, effective transport)
TRANSPORT_CASES = [
    ("default-pool-is-tcp", {}, Transport.TCP),
    ("default-pool-rdma", {"transport": "rdma"}, Transport.RDMA),
    ("nvlink-pool-implies-nvlink", {"memPool": "NVLINK"}, Transport.NVLINK),
    ("intra-pool-implies-intra", {"memPool": "INTRA_NODE_NVLINK"}, Transport.NVLINK_INTRA),
    ("barex-implies-rdma", {"memPool": "BAREX", "transport": "auto"}, Transport.RDMA),
]


@pytest.mark.parametrize(
    ("transfer", "expected"), [c[1:] for c in TRANSPORT_CASES], ids=[c[0] for c in TRANSPORT_CASES]
)
def test_effective_transport(transfer: dict[str, Any], expected: Transport) -> None:
    assert parse_spec({"transfer": transfer}).transfer.effective_transport is expected


def test_intra_node_group_counts_fed_decodes() -> None:
    spec = pdcluster().transport("nvlink-intra").prefill(replicas=2, tp=2).decode(replicas=4, tp=1).spec()
    assert spec.transfer.mem_pool is MemPool.INTRA_NODE_NVLINK
    assert spec.decode_per_prefill == 2
    assert spec.intra_node_group_gpus == 4


def test_new_fields_parse() -> None:
    spec = parse_spec({"model": {"expectedPromptTokens": 100}, "placement": {"maxGpusPerNode": 4}})
    assert spec.model.expected_prompt_tokens == 100
    assert spec.placement.max_gpus_per_node == 4
