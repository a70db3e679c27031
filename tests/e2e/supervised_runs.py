"""Agents that run their own engines (spec.engine) on a LocalFabric: a supervised prefill and decode
of the reference engine, and the colocated answers they must equal; shared by the CPU and GPU tests."""

from __future__ import annotations

import time
from typing import Any

from pdfabric_refengine.router import PrefillEndpoint, generate

from pdfabric_agent.engines.sandbox import landlock_abi
from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.pd_runs import REF_MODEL

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
