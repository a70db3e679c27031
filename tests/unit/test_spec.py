"""parse_spec: defaults equal the CRD's, and it rejects what the CRD rejects."""

from __future__ import annotations

import copy
import re
from dataclasses import Field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml

from pdfabric_core.policy.transports import MEM_POOLS, TRANSPORTS, Requirement, pool_transports, transport_traits
from pdfabric_core.policy.types import (
    AUTO_TRANSPORT,
    Backend,
    Device,
    FallbackPolicy,
    KvKind,
    KvPacking,
    MemPool,
    Transport,
)
from pdfabric_core.spec import (
    DTYPE_BYTES,
    DecodeEngineSpec,
    EngineSandbox,
    EngineSpec,
    PDClusterSpec,
    PrefillEngineSpec,
    SpecError,
    parse_spec,
)
from pdfabric_core.spec.parse import crd_key, field_default
from tests.builders import ENGINE, INVALID_SPECS, merge, pdcluster

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


def _spec_fields() -> list[tuple[str | None, Field[Any]]]:
    """(section, field) for every leaf field of PDClusterSpec; section None for top-level ones."""
    out: list[tuple[str | None, Field[Any]]] = []
    hints = get_type_hints(PDClusterSpec)
    for f in fields(PDClusterSpec):
        if f.name in ("engine", "router"):
            continue  # optional, without defaults of its own: their own tests below
        if is_dataclass(hints[f.name]):
            out += [(f.name, sub) for sub in fields(hints[f.name])]
        else:
            out.append((None, f))
    return out


SPEC_FIELDS = _spec_fields()


def _field_id(section: str | None, f: Field[Any]) -> str:
    return f"{crd_key(section)}.{crd_key(f.name)}" if section else crd_key(f.name)


@pytest.mark.parametrize(("section", "f"), SPEC_FIELDS, ids=[_field_id(s, f) for s, f in SPEC_FIELDS])
def test_crd_default_of_each_field_parses_to_the_dataclass_default(section: str | None, f: Field[Any]) -> None:
    # The dataclasses hold the defaults; the CRD must say the same, field by field. Fields without
    # a CRD default are the optional maps (nodeSelector, resources), empty in the dataclass too.
    schema = _spec_schema()
    node = schema["properties"][crd_key(section)] if section else schema
    prop = node["properties"].get(crd_key(f.name))
    assert prop is not None, f"the CRD has no {_field_id(section, f)}"
    default = field_default(f)
    if "default" not in prop:
        if (section, f.name) == ("agent", "image"):
            # Left out on purpose: the operator picks the image the transport needs (images.py),
            # which a server-side default would hide.
            assert default == "" and prop["type"] == "string"
            return
        assert default == {} and prop["type"] == "object", f"{_field_id(section, f)} has no CRD default"
        return
    raw = {crd_key(section): {crd_key(f.name): prop["default"]}} if section else {crd_key(f.name): prop["default"]}
    parsed = parse_spec(raw)
    got = getattr(getattr(parsed, section), f.name) if section else getattr(parsed, f.name)
    assert got == default


def test_every_crd_field_is_a_spec_field() -> None:
    schema = _spec_schema()
    crd = {
        f"{key}.{sub}" if sub_node is not None else key
        for key, node in schema["properties"].items()
        if key not in ("engine", "router")
        for sub, sub_node in (node.get("properties", {}).items() if node["type"] == "object" else [(key, None)])
    }
    assert crd == {_field_id(s, f) for s, f in SPEC_FIELDS}


# (CRD field, the vocabulary it must list)
VOCABULARY = [
    ("backend", [b.value for b in Backend]),
    ("transfer.memPool", [m.value for m in MemPool]),
    ("transfer.transport", [AUTO_TRANSPORT, *(t.value for t in Transport)]),
    ("model.kvKind", [k.value for k in KvKind]),
    ("model.kvPacking", [k.value for k in KvPacking]),
    ("model.dtype", list(DTYPE_BYTES)),
    ("placement.fallback", [f.value for f in FallbackPolicy]),
]


@pytest.mark.parametrize(("path", "values"), VOCABULARY, ids=[v[0] for v in VOCABULARY])
def test_crd_enums_equal_the_python_vocabulary(path: str, values: list[str]) -> None:
    node = _spec_schema()
    for key in path.split("."):
        node = node["properties"][key]
    assert node["enum"] == values


def test_every_transport_and_pool_has_a_traits_row() -> None:
    assert set(TRANSPORTS) == set(Transport)
    assert set(MEM_POOLS) == set(MemPool)
    assert all(MEM_POOLS[p].implied_transport in MEM_POOLS[p].transports for p in MemPool)


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


def test_nixl_runs_nvlink_intra_on_the_default_pool() -> None:
    """UCX's CUDA IPC between GPUs of one node: backend nixl, memPool NONE, transport nvlink-intra;
    the node locality of nvlink-intra holds as on the INTRA_NODE_NVLINK pool."""
    spec = parse_spec({"backend": "nixl", "transfer": {"transport": "nvlink-intra"}})
    assert (spec.transfer.mem_pool, spec.transfer.effective_transport) == (MemPool.NONE, Transport.NVLINK_INTRA)
    assert pool_transports(MemPool.NONE, Backend.NIXL) == {
        Transport.TCP,
        Transport.RDMA,
        Transport.NVLINK_INTRA,
        Transport.EFA,
    }
    for backend in (Backend.MOONCAKE, Backend.MORI):
        assert pool_transports(MemPool.NONE, backend) == {Transport.TCP, Transport.RDMA}
    with pytest.raises(SpecError, match=r"decode\.replicas \(3\) must be a multiple"):
        parse_spec({"backend": "nixl", "transfer": {"transport": "nvlink-intra"}, "prefill": {"replicas": 2},
                    "decode": {"replicas": 3}})  # fmt: skip


def test_nixl_runs_efa_on_the_default_pool_and_no_other_backend_does() -> None:
    """EFA through NIXL's LIBFABRIC backend: memPool NONE, an agent requesting the nodes' RDMA
    resource (set to the EFA one), KV in host memory; the agent checks for an EFA device."""
    spec = parse_spec({"backend": "nixl", "transfer": {"transport": "efa"}})
    assert (spec.transfer.mem_pool, spec.transfer.effective_transport) == (MemPool.NONE, Transport.EFA)
    traits = transport_traits(Transport.EFA)
    assert traits.device_resource and traits.backends == {Backend.NIXL}
    assert traits.requires == (Requirement.EFA_DEVICE,) and traits.engine_kv_devices == {Device.CPU}
    with pytest.raises(SpecError, match=r"efa cannot run on memPool NONE with backend mooncake.*or backend nixl"):
        parse_spec({"transfer": {"transport": "efa"}})


def test_a_pair_another_backend_carries_names_that_backend() -> None:
    with pytest.raises(
        SpecError, match=r"nvlink-intra cannot run on memPool NONE with backend mooncake.*or backend nixl"
    ):
        parse_spec({"transfer": {"transport": "nvlink-intra"}})
    with pytest.raises(SpecError, match=r"nvlink cannot run on memPool NONE with backend nixl; use auto or one of: "
                       r"efa, nvlink-intra, rdma, tcp, or change memPool"):  # fmt: skip
        parse_spec({"backend": "nixl", "transfer": {"transport": "nvlink"}})


def test_new_fields_parse() -> None:
    spec = parse_spec({"model": {"expectedPromptTokens": 100}, "placement": {"maxGpusPerNode": 4}})
    assert spec.model.expected_prompt_tokens == 100
    assert spec.placement.max_gpus_per_node == 4


def test_state_bytes_must_split_evenly_over_state_layers() -> None:
    with pytest.raises(SpecError, match=r"must be divisible by model\.stateLayers"):
        parse_spec({"model": {"stateBytesPerRequest": 1000, "stateLayers": 3}})
    assert parse_spec({"model": {"stateBytesPerRequest": 999, "stateLayers": 3}}).model.state_layers == 3


def test_unknown_enum_value_names_the_field_and_the_choices() -> None:
    with pytest.raises(SpecError, match=r"placement.fallback must be one of Fail, TCP, got 'tcp'"):
        parse_spec({"placement": {"fallback": "tcp"}})


def test_enum_fields_parse_to_enum_members() -> None:
    spec = parse_spec({"backend": "mori", "placement": {"fallback": "TCP"}})
    assert spec.backend is Backend.MORI and spec.placement.fallback is FallbackPolicy.TCP


# --- spec.engine ---------------------------------------------------------------------------------


def _engine_schema() -> dict[str, Any]:
    return _spec_schema()["properties"]["engine"]


def test_engine_is_optional_and_fabric_only_without_it() -> None:
    assert PDClusterSpec().engine is None
    assert parse_spec(apply_crd_defaults(_spec_schema(), {})).engine is None
    assert "engine" not in _spec_schema().get("required", [])
    assert "default" not in _engine_schema()


@pytest.mark.parametrize(("role", "cls"), [("prefill", PrefillEngineSpec), ("decode", DecodeEngineSpec)])
def test_engine_role_crd_defaults_equal_the_dataclass(role: str, cls: type[Any]) -> None:
    node = _engine_schema()["properties"][role]
    assert set(node["properties"]) == {crd_key(f.name) for f in fields(cls)}
    defaulted = apply_crd_defaults(_spec_schema(), {"engine": ENGINE})
    got = getattr(parse_spec(defaulted).engine, role)
    assert got == cls(**{f.name: getattr(got, f.name) for f in fields(cls) if f.name in ("command", "args")})
    for f in fields(cls):
        prop = node["properties"][crd_key(f.name)]
        assert ("default" in prop) == (f.name not in ("command", "args", "env", "resources")), f.name


def test_engine_crd_fields_are_spec_fields() -> None:
    assert set(_engine_schema()["properties"]) == {crd_key(f.name) for f in fields(EngineSpec)}
    assert set(_engine_schema()["required"]) == {"image", "prefill", "decode"}


def test_engine_parses_every_field() -> None:
    raw = merge(
        ENGINE,
        {
            "sharedMemory": "8Gi",
            "sandbox": "Required",
            "prefill": {
                "command": ["python3", "-m", "sglang.launch_server"],
                "env": [{"name": "HF_HOME", "value": "/cache"}],
                "resources": {"limits": {"memory": "64Gi"}},
                "port": 40000,
                "bootstrapPort": 41000,
                "healthPath": "/ping",
                "startupSeconds": 60,
            },
            "decode": {"port": 42000},
        },
    )
    engine = parse_spec({"engine": raw}).engine
    assert engine is not None
    assert engine.image == "pdfabric/refengine:test" and engine.shared_memory == "8Gi"
    assert engine.sandbox is EngineSandbox.REQUIRED
    p = engine.prefill
    assert p.command == ("python3", "-m", "sglang.launch_server") and p.args == ("p",)
    assert p.env == ({"name": "HF_HOME", "value": "/cache"},)
    assert (p.port, p.bootstrap_port, p.health_path, p.startup_seconds) == (40000, 41000, "/ping", 60)
    assert p.resources == {"limits": {"memory": "64Gi"}}
    assert engine.decode.port == 42000 and engine.role("decode") is engine.decode


def test_engine_sandbox_defaults_to_best_effort_and_refuses_other_words() -> None:
    engine = parse_spec({"engine": ENGINE}).engine
    assert engine is not None and engine.sandbox is EngineSandbox.BEST_EFFORT
    defaulted = apply_crd_defaults(_spec_schema(), {"engine": ENGINE})
    assert defaulted["engine"]["sandbox"] == "BestEffort"
    assert _engine_schema()["properties"]["sandbox"]["enum"] == [m.value for m in EngineSandbox]
    with pytest.raises(SpecError, match=r"engine.sandbox must be one of Required, BestEffort, Disabled, got False"):
        parse_spec({"engine": merge(ENGINE, {"sandbox": False})})  # what YAML 1.1 makes of an unquoted Off


def test_engine_port_ranges_may_touch() -> None:
    raw = merge(ENGINE, {"prefill": {"port": 30000, "bootstrapPort": 30064}, "decode": {"port": 30128}})
    assert parse_spec({"engine": raw}).engine is not None


def test_engine_gpu_resource_rule_follows_placement_gpu_resource() -> None:
    raw = merge(ENGINE, {"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}})
    with pytest.raises(SpecError, match=r"engine.decode.resources.limits may not name nvidia.com/gpu"):
        parse_spec({"engine": raw})
    # Under another GPU resource name, nvidia.com/gpu is just another extended resource.
    assert parse_spec({"engine": raw, "placement": {"gpuResource": "amd.com/gpu"}}).engine is not None


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_command_is_required_the_entrypoint_is_the_agent(role: str) -> None:
    for without in ({"args": ["x"]}, {"command": [], "args": ["x"]}):
        raw = dict(ENGINE, **{role: without})
        with pytest.raises(SpecError, match=rf"engine\.{role}\.command is required"):
            parse_spec({"engine": raw})
    args_less = parse_spec({"engine": dict(ENGINE, **{role: {"command": ["serve"]}})}).engine
    assert args_less is not None and args_less.role(role).args == ()


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        (
            {"engine": merge(ENGINE, {"decode": {"resources": {"limits": {"memory": "2 GB"}}}})},
            "engine.decode.resources",
        ),
        (
            {"engine": merge(ENGINE, {"prefill": {"resources": {"requests": {"cpu": "two"}}}})},
            "engine.prefill.resources",
        ),
        ({"engine": merge(ENGINE, {"sharedMemory": "8gb"})}, "engine.sharedMemory"),
        ({"agent": {"resources": {"requests": {"memory": "1Gb"}}}}, "agent.resources.requests.memory"),
    ],
)
def test_unparsable_quantities_are_refused_naming_the_field(patch: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecError, match=rf"{re.escape(where)}.*not a quantity"):
        parse_spec(patch)


def test_a_request_above_its_limit_is_refused() -> None:
    raw = merge(ENGINE, {"decode": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}})
    with pytest.raises(SpecError, match=r"engine.decode.resources.requests.cpu must not exceed limits.cpu"):
        parse_spec({"engine": raw})
    equal = merge(ENGINE, {"decode": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1024Mi"}}}})
    assert parse_spec({"engine": equal}).engine is not None


def test_router_crd_fields_and_defaults_are_the_router_specs() -> None:
    from pdfabric_core.spec import RouterSpec

    schema = _spec_schema()["properties"]["router"]
    assert set(schema["properties"]) == {crd_key(f.name) for f in fields(RouterSpec)}
    engine = {"image": "e", "prefill": {"command": ["p"]}, "decode": {"command": ["d"]}}
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    parsed = parse_spec({"engine": engine, "router": {"image": "r", **defaults}}).router
    assert parsed == RouterSpec(image="r")
    with pytest.raises(SpecError, match="router needs engine"):
        parse_spec({"router": {"image": "r"}})
    with pytest.raises(SpecError, match=r"router\.image is required"):
        parse_spec({"engine": engine, "router": {}})


# (id, agent.pod, fragment of the SpecError) — the rules CEL cannot see (fields of volumes).
POD_REFUSALS = [
    (
        "secret-volume-of-a-peer-ca",
        {"volumes": [{"name": "ca", "secret": {"secretName": "other-peer-ca"}}]},
        "mounts Secret other-peer-ca",
    ),
    (
        "projected-agent-certificate",
        {"volumes": [{"name": "p", "projected": {"sources": [{"secret": {"name": "pd-x-peer-tls"}}]}}]},
        "mounts Secret pd-x-peer-tls",
    ),
    ("engine-token", {"volumes": [{"name": "t", "secret": {"secretName": "pd-engine-token"}}]}, "pd-engine-token"),
    ("duplicate-volumes", {"volumes": [{"name": "w", "emptyDir": {}}, {"name": "w", "emptyDir": {}}]}, "unique"),
    ("mount-of-no-volume", {"volumeMounts": [{"name": "w", "mountPath": "/models"}]}, "names no volume"),
    (
        "mount-at-root",
        {"volumes": [{"name": "w", "emptyDir": {}}], "volumeMounts": [{"name": "w", "mountPath": "/"}]},
        "clear of",
    ),
    ("pull-secret-without-name", {"imagePullSecrets": [{}]}, "needs a name"),
    (
        "env-from-the-peer-ca",
        {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "pd-peer-ca", "key": "tls.key"}}}]},
        "reads Secret pd-peer-ca",
    ),
]


def test_engine_env_may_not_read_the_operators_secrets() -> None:
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "pd-engine-token", "key": "token"}}}]
    engine = {"image": "e", "prefill": {"command": ["s"], "env": env}, "decode": {"command": ["s"]}}
    with pytest.raises(SpecError, match="reads Secret pd-engine-token"):
        parse_spec({"engine": engine})
    ok = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    assert parse_spec({"engine": {**engine, "prefill": {"command": ["s"], "env": ok}}}).engine is not None


@pytest.mark.parametrize(("pod", "fragment"), [c[1:] for c in POD_REFUSALS], ids=[c[0] for c in POD_REFUSALS])
def test_pod_overrides_that_would_break_the_contract_are_refused(pod: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        parse_spec({"agent": {"pod": pod}})


def test_pod_overrides_parse_as_written() -> None:
    pod = {
        "labels": {"team": "a"},
        "tolerations": [{"key": "k", "operator": "Exists"}],
        "volumes": [{"name": "w", "persistentVolumeClaim": {"claimName": "w"}}],
        "volumeMounts": [{"name": "w", "mountPath": "/models/llama"}],
        "secretVolumeOfItsOwn": None,
    }
    parsed = parse_spec({"agent": {"pod": pod}}).agent.pod
    assert parsed.labels == {"team": "a"} and parsed.tolerations == ({"key": "k", "operator": "Exists"},)
    assert parsed.volume_mounts == ({"name": "w", "mountPath": "/models/llama"},)
    assert parse_spec({}).agent.pod == parse_spec({"agent": {"pod": {}}}).agent.pod


@pytest.mark.parametrize("section", ["agent", "router"])
def test_pod_override_cel_rules_name_what_parse_spec_reserves(section: str) -> None:
    from pdfabric_core.spec.model import FORBIDDEN_ENGINE_ENV
    from pdfabric_core.spec.pod_overrides import (
        RESERVED_KEY_PREFIX,
        RESERVED_LABELS,
        RESERVED_NODE_ENV,
        RESERVED_PATHS,
        RESERVED_VOLUMES,
    )

    pod = _spec_schema()["properties"][section]["properties"]["pod"]["properties"]

    def rule(node: dict[str, Any]) -> str:
        (only,) = node["x-kubernetes-validations"]
        return str(only["rule"])

    assert all(f"'{k}'" in rule(pod["labels"]) for k in RESERVED_LABELS)
    assert f"'{RESERVED_KEY_PREFIX}'" in rule(pod["labels"]) and f"'{RESERVED_KEY_PREFIX}'" in rule(pod["annotations"])
    assert all(f"'{v}'" in rule(pod["volumes"]["items"]) for v in RESERVED_VOLUMES)
    assert all(f"'{p}'" in rule(pod["volumeMounts"]["items"]) for p in RESERVED_PATHS)
    assert all(f"'{n}'" in rule(pod["env"]["items"]) for n in (*RESERVED_NODE_ENV, *FORBIDDEN_ENGINE_ENV))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dp_groups_count_gpus_and_are_refused_with_the_engine_launch(role: str) -> None:
    spec = parse_spec({role: {"tp": 2, "dp": 2}})
    assert getattr(spec, role).ranks_per_replica == 4
    with pytest.raises(SpecError, match=rf"{role}\.dp 2 with spec\.engine"):
        parse_spec({role: {"dp": 2}, "engine": ENGINE})
    with pytest.raises(SpecError, match=r"dp, tp, cp and pp must each be at least 1"):
        parse_spec({role: {"dp": 0}})
