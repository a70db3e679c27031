"""The one-container node pod without a control plane (issue 12): each agent runs its node's
engines itself from PDFABRIC_ENGINES (the launch message the operator writes for spec.engine,
built by the same core function), and the engines register their memory through its engine
door. Prompts sent as SGLang's router sends them come back equal to colocated generation; a
SIGKILLed decode engine fails its requests, is restarted by its agent, registers its memory anew
and serves again. ``run_supervised`` is shared with the GPU test (tests/gpu/test_engines_gpu.py:
the pools on the GPU, opened by CUDA IPC, moved by the fast path's kernels)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pdfabric_refengine.router import PrefillEndpoint, generate

from pdfabric_agent.engines.sandbox import landlock_abi
from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.test_sglang_pd import REF_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVER = ["python", "-m", "pdfabric_refengine.server"]
ARGS = ["--backend", "direct", "--timeout-s", "15"]
PROMPTS = [[1, 5, 9, 200, 31, 7, 7, 64], list(range(3, 40)), [11, 12, 13], list(range(100, 116))]
NEW_TOKENS = 12


def colocated(prompts: list[list[int]]) -> list[list[int]]:
    from pdfabric_refengine import build_model, colocated_generate

    model = build_model(0)
    return [colocated_generate(model, p, NEW_TOKENS) for p in prompts]


def run_supervised(transfer: dict[str, Any], device: str) -> dict[str, Any]:
    """Engines run by their agents: tokens equal colocated, then a decode engine killed and back."""
    args = [*ARGS, "--device", device]
    spec = {
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": {"timeoutSeconds": 20, **transfer},
        "model": REF_MODEL,
        "engine": {
            "image": "pdfabric/refengine:local",
            "prefill": {"command": SERVER, "args": ["--role", "prefill", *args]},
            "decode": {"command": SERVER, "args": ["--role", "decode", *args]},
        },
    }
    env = {"PDFABRIC_ENGINE_BACKOFF_S": "1", "PDFABRIC_ENGINE_BACKOFF_MAX_S": "2"}
    with LocalFabric(spec, decode_gpu=0, env=env) as lc:
        lc.start(wait_s=240)  # Ready: the agents' fabric and their engines
        (pe,) = [e for (_, name), e in lc.engines.items() if name == "prefill-0"]
        (de,) = [e for (_, name), e in lc.engines.items() if name == "decode-0"]
        prefill = PrefillEndpoint(pe.url, "127.0.0.1", pe.bootstrap_port)
        want = colocated(PROMPTS)
        t0 = time.monotonic()
        answers = [generate(prefill, de.url, p, NEW_TOKENS, timeout_s=60) for p in PROMPTS]
        first_s = time.monotonic() - t0
        assert [a.error for a in answers] == [""] * len(PROMPTS)
        assert [a.tokens for a in answers] == want
        paths = lc.bytes_by_path()
        assert paths

        pid = de.kill()
        failed = generate(prefill, de.url, PROMPTS[0], NEW_TOKENS, timeout_s=30)
        assert not failed.ok
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = de.state()
            if st is not None and st.ready and st.restarts >= 1 and st.pid != pid:
                break
            time.sleep(0.5)
        st = de.state()
        assert st is not None and st.ready and st.restarts == 1 and "signal 9" in st.last_exit, st
        again = [generate(prefill, de.url, p, NEW_TOKENS, timeout_s=60) for p in PROMPTS]
        assert [a.error for a in again] == [""] * len(PROMPTS)
        assert [a.tokens for a in again] == want
        # Both agents started their engines in the sandbox that hides the peer key, where the
        # kernel has Landlock (BestEffort, the default): CUDA IPC and the pools work from inside it.
        sandboxed = lc.metric_sum("pdfabric_serving_engine_sandboxed")
        assert sandboxed == (len(lc.agents) if landlock_abi()[0] >= 1 else 0), sandboxed
        return {
            "prompts": len(PROMPTS),
            "tokens_equal_colocated": True,
            "engines_sandboxed": sandboxed == len(lc.agents),
            "bytes_by_path": lc.bytes_by_path(),
            "first_round_s": round(first_s, 3),
            "decode_engine_restarts": st.restarts,
            "decode_last_exit": st.last_exit,
            "after_restart_tokens_equal": True,
        }


def test_agents_run_their_engines_and_restart_a_killed_one() -> None:
    report = run_supervised({"transport": "tcp"}, "cpu")
    kinds = {k.split("/")[1] for k in report["bytes_by_path"]}
    assert {"kv", "aux"} <= kinds, report


def test_sglangs_own_router_pairs_prompts_across_two_prefill_engines(tmp_path: Any, installed_site: Any) -> None:
    """The real sglang-router, pointed at the engines' endpoints as docs/engines.md says
    (``sglang_router_args``: each prefill engine by its URL and bootstrap port), takes plain
    /generate requests, pairs each with one of two prefill engines (round robin) and the decode
    engine, and answers tokens equal to colocated generation; both prefill engines' agents moved
    KV, so decode asked the right prefill (its bootstrap server, SGLang's pdfabric classes) each
    time."""
    from pdfabric_devcluster.sglang_router import sglang_router

    args = ["--timeout-s", "15", "--device", "cpu"]  # SGLang's classes (--backend sglang, the default)
    spec = {
        "prefill": {"tp": 1, "replicas": 2},
        "decode": {"tp": 1},
        "transfer": {"timeoutSeconds": 20, "transport": "tcp"},
        "model": REF_MODEL,
        "engine": {
            "image": "pdfabric/refengine:local",
            "prefill": {"command": SERVER, "args": ["--role", "prefill", *args]},
            "decode": {"command": SERVER, "args": ["--role", "decode", *args]},
        },
    }
    with LocalFabric(spec, engine_pythonpath=[str(installed_site)]) as lc:
        lc.start(wait_s=240)
        prefills = sorted((name, agent, e) for (agent, name), e in lc.engines.items() if name.startswith("prefill"))
        decodes = [e for (_, name), e in lc.engines.items() if name.startswith("decode")]
        assert [name for name, _, _ in prefills] == ["prefill-0", "prefill-1"] and len(decodes) == 1
        endpoints = {
            "prefill": [{"url": e.url, "bootstrapPort": e.bootstrap_port} for _, _, e in prefills],
            "decode": [{"url": e.url} for e in decodes],
        }
        prompts = PROMPTS * 2
        want = colocated(prompts)
        with sglang_router(endpoints, tmp_path / "router.log", extra=["--policy", "round_robin"]) as router:
            answers = [
                router.generate({"input_ids": p, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
                for p in prompts
            ]
        assert [status for status, _ in answers] == [200] * len(prompts), answers
        assert [a["output_ids"] for _, a in answers] == want
        for _, agent, _ in prefills:
            sent = lc.metric_sum("pdfabric_transfer_bytes_total", names=[agent], role="prefill", kind="kv")
            assert sent > 0, f"{agent}'s prefill engine got no request from the router"
