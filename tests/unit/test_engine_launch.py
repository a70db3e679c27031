"""pdfabric_core.engines: the launch message the operator hands the agent (refusals name the field,
the round trip through the kubelet's $ escaping), $(VAR) expansion and the engine state the
agent reports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdfabric_core.engines.launch import (
    ENGINES_ENV,
    EngineLaunch,
    EnvEntry,
    decode_launches,
    encode_launches,
    expand,
    hoisted_name,
    kubelet_literal,
)
from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role


def prefill(**changes: Any) -> EngineLaunch:
    base: dict[str, Any] = dict(
        name="prefill-0", role=Role.PREFILL, replica=0, rank_ids=("prefill-0-tp0-cp0", "prefill-0-tp1-cp0"),
        gpus=(0, 1), argv=("python3", "-m", "sglang.launch_server", "--port", "$(PDFABRIC_PORT)", "--cost=$$5"),
        env=(EnvEntry("A", "$(HOME)/x"), EnvEntry("LIT", "$$(HOME)"),
             EnvEntry("HF_TOKEN", from_container=hoisted_name(Role.PREFILL, "HF_TOKEN"))),
        port=30000, bootstrap_port=8998, health_path="/health", startup_seconds=600, tp=2, pp=1, cp=1, cp_rank=0,
    )  # fmt: skip
    base.update(changes)
    return EngineLaunch(**base)


def decode() -> EngineLaunch:
    return prefill(name="decode-3", role=Role.DECODE, replica=3, rank_ids=("decode-3-tp0",), gpus=(2,), env=(),
                   bootstrap_port=None, cp_rank=None, tp=1)  # fmt: skip


def test_expand_is_the_kubelets() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING) $(A", env) == "$(MISSING) $(A"  # undefined and unterminated stay
    assert expand("$$(A) $$ $", env) == "$(A) $ $"
    assert expand(kubelet_literal("$(A) costs $5"), env) == "$(A) costs $5"


def test_encode_decode_round_trip_through_the_kubelets_unescaping() -> None:
    launches = [prefill(), decode()]
    text = encode_launches(launches)
    assert "$$(PDFABRIC_PORT)" in text and "$$$$5" in text  # every $ doubled in the pod spec
    seen = expand(text, {"PDFABRIC_PORT": "1", "HOME": "/root"})  # the kubelet, with variables defined
    assert decode_launches(seen) == launches
    got = decode_launches(seen)[0]
    assert got.argv[-2:] == ("$(PDFABRIC_PORT)", "--cost=$$5")  # the agent expands them per engine
    assert expand(got.argv[-1], {}) == "--cost=$5"


def test_contract_env() -> None:
    env = prefill().contract_env("127.0.0.1:7400", "/run/token", "/dev/shm")
    assert env["PDFABRIC_AGENT_ADDRESS"] == "127.0.0.1:7400" and env["PDFABRIC_ENGINE_TOKEN_FILE"] == "/run/token"
    assert (env["PDFABRIC_PORT"], env["PDFABRIC_BOOTSTRAP_PORT"], env["PDFABRIC_GPUS"], env["PDFABRIC_TP"]) == (
        "30000", "8998", "2", "2",
    )  # fmt: skip
    assert env["PDFABRIC_CP_RANK"] == "0" and "PDFABRIC_RANK" not in env  # two ranks: no single rank id
    d = decode().contract_env("127.0.0.1:7400", "/run/token", "/dev/shm")
    assert d["PDFABRIC_RANK"] == "decode-3-tp0" and d["PDFABRIC_ROLE"] == "decode"
    assert not {"PDFABRIC_BOOTSTRAP_PORT", "PDFABRIC_CP", "PDFABRIC_CP_RANK"} & set(d)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": ""}, "engine.name must be a non-empty string"),
        ({"role": "router"}, "engine.role must be prefill or decode"),
        ({"replica": -1}, "engine.replica must be an integer"),
        ({"ranks": []}, "engine.ranks must be a non-empty list of strings"),
        ({"gpus": []}, "engine.gpus must be a non-empty list"),
        ({"gpus": [True]}, "engine.gpus must be a non-empty list"),
        ({"gpus": [-1]}, "engine.gpus must be a non-empty list"),
        ({"argv": "sglang"}, "engine.argv must be a non-empty list of strings"),
        ({"env": "A=1"}, "engine.env must be a list"),
        ({"env": [{"value": "1"}]}, "engine.env[0] needs a name"),
        ({"env": [{"name": "A"}]}, "engine.env[0] needs a value or fromContainer"),
        ({"port": 0}, "engine.port must be an integer in [1, 65535]"),
        ({"port": "30000"}, "engine.port must be an integer"),
        ({"bootstrapPort": 70000}, "engine.bootstrapPort must be an integer"),
        ({"healthPath": "health"}, "engine.healthPath must start with /"),
        ({"startupSeconds": 0}, "engine.startupSeconds must be an integer"),
        ({"tp": False}, "engine.tp must be an integer"),
        ({"cpRank": "0"}, "engine.cpRank must be an integer"),
    ],
)
def test_from_json_refusals_name_the_field(change: dict[str, Any], named: str) -> None:
    body = {**prefill().to_json(), **change}
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        EngineLaunch.from_json(body)


def test_decode_launches_refuses_the_list_naming_the_variable_and_index() -> None:
    with pytest.raises(ValueError, match=f"{ENGINES_ENV} is not JSON"):
        decode_launches("[{")
    with pytest.raises(ValueError, match="must be a list of at most 64 engines"):
        decode_launches("{}")
    bad = [prefill().to_json(), {**decode().to_json(), "port": 0}]
    with pytest.raises(ValueError, match=rf"{ENGINES_ENV}\[1\]\.port"):
        decode_launches(json.dumps(bad))
    twice = [prefill().to_json(), prefill().to_json()]
    with pytest.raises(ValueError, match="engine names must be unique"):
        decode_launches(json.dumps(twice))
    assert decode_launches("[]") == []


def test_engine_state_round_trip_and_malformed_is_none() -> None:
    s = EngineState(
        "decode-3", Role.DECODE, 3, "BackOff", False, restarts=2, pid=0, last_exit="exit code 1", sandboxed=True
    )
    assert EngineState.from_json(s.to_json()) == s
    assert EngineState.from_json(json.loads(json.dumps(s.to_json()))) == s
    # Only a true boolean is a sandbox claim (an older agent's word has no field: not sandboxed).
    for claim in ("yes", 1, None):
        got = EngineState.from_json({**s.to_json(), "sandboxed": claim})
        assert got is not None and got.sandboxed is False
    older = {k: v for k, v in s.to_json().items() if k != "sandboxed"}
    assert EngineState.from_json(older) == EngineState(**{**s.__dict__, "sandboxed": False})
    for bad in ([], {**s.to_json(), "role": "x"}, {**s.to_json(), "restarts": -1}, {**s.to_json(), "pid": True},
                {**s.to_json(), "name": 3}):  # fmt: skip
        assert EngineState.from_json(bad) is None


def test_sglang_router_args_name_each_prefill_with_its_bootstrap_port_and_each_decode() -> None:
    from pdfabric_core.engines.router import sglang_router_args

    endpoints = {
        "prefill": [
            {"url": "http://pd-a.pd-agents.ns.svc:30000", "bootstrapPort": 8998},
            {"url": "http://pd-a.pd-agents.ns.svc:30001", "bootstrapPort": 8999},
        ],
        "decode": [{"url": "http://pd-b.pd-agents.ns.svc:31000"}],
    }
    assert sglang_router_args(endpoints) == [
        "--pd-disaggregation",
        "--prefill", "http://pd-a.pd-agents.ns.svc:30000", "8998",
        "--prefill", "http://pd-a.pd-agents.ns.svc:30001", "8999",
        "--decode", "http://pd-b.pd-agents.ns.svc:31000",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        sglang_router_args({"prefill": endpoints["prefill"], "decode": []})


def test_vllm_router_args_name_each_engine_by_url_and_vllms_pd_protocol() -> None:
    from pdfabric_core.engines.router import router_worker_args
    from pdfabric_core.spec import RouterKind

    endpoints = {
        "prefill": [{"url": "http://pd-a.pd-agents.ns.svc:30000", "bootstrapPort": 8998}],
        "decode": [{"url": "http://pd-b.pd-agents.ns.svc:31000"}, {"url": "http://pd-b.pd-agents.ns.svc:31001"}],
    }
    assert router_worker_args(RouterKind.VLLM, endpoints) == [
        "--vllm-pd-disaggregation",
        "--prefill", "http://pd-a.pd-agents.ns.svc:30000",  # no bootstrap server in vLLM
        "--decode", "http://pd-b.pd-agents.ns.svc:31000",
        "--decode", "http://pd-b.pd-agents.ns.svc:31001",
        "--kv-connector", "nixl",
    ]  # fmt: skip
    assert router_worker_args(RouterKind.SGLANG, endpoints)[:4] == [
        "--pd-disaggregation", "--prefill", "http://pd-a.pd-agents.ns.svc:30000", "8998"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        router_worker_args(RouterKind.VLLM, {"prefill": [], "decode": endpoints["decode"]})


@pytest.mark.parametrize(
    ("mem_pool", "user_env", "want"),
    [
        ("INTRA_NODE_NVLINK", [], "INTRA_NODE_NVLINK"),  # SGLang's metadata rows on the GPU, as the seed
        ("INTRA_NODE_NVLINK", [{"name": "SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "value": "NONE"}], "NONE"),  # theirs stands
        ("NONE", [], None),  # private CPU rows: they travel inline
    ],
    ids=["intra-node-nvlink", "users-own-value", "none"],
)
def test_the_launcher_sets_sglangs_pool_variable_for_intra_node_nvlink(
    mem_pool: str, user_env: list[dict[str, str]], want: str | None
) -> None:
    from pdfabric_core.engines.groups import engine_launches
    from pdfabric_core.rankmap import Rank
    from tests.builders import pdcluster

    builder = pdcluster().transfer(memPool=mem_pool, transport="nvlink-intra" if mem_pool != "NONE" else "tcp")
    spec = builder.engine(prefill={"env": user_env}).spec()
    (launch,) = engine_launches(spec, [Rank(Role.PREFILL, 0, 0)])
    got = {e.name: e.value for e in launch.env}.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
    assert got == want
