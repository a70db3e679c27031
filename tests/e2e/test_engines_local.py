"""The one-container node pod without a control plane (issue 12): each agent runs its node's
engines itself from PDFABRIC_ENGINES (the launch message the operator writes for spec.engine,
built by the same core function), and the engines register their memory through its engine
door. Prompts sent as SGLang's router sends them come back equal to colocated generation; a
SIGKILLed decode engine fails its requests, is restarted by its agent, registers its memory anew
and serves again. ``run_supervised`` is shared with the GPU test (tests/gpu/test_engines_gpu.py:
the pools on the GPU, opened by CUDA IPC, moved by the fast path's kernels)."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.pd_runs import REF_MODEL
from tests.e2e.supervised_runs import NEW_TOKENS, PROMPTS, SERVER, colocated, run_supervised

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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
