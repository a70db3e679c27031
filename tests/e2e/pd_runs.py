"""The reference engine's PD runs through real agents (prefill and decode engine processes beside a
LocalFabric), and the colocated answers they must equal; shared by the CPU and GPU tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdfabric_refengine.geometry import SPEC_MODEL

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
REF_MODEL = SPEC_MODEL  # the reference engine's model as spec.model
PROMPTS = [list(range(3, 40)), [7, 1, 5] * 11, list(range(100, 116)), [42] * 5]  # 37, 33, 16, 5 tokens
NEW_TOKENS = 32


def colocated() -> list[list[int]]:
    from pdfabric_refengine import build_model, colocated_generate

    model = build_model(0)
    return [colocated_generate(model, p, NEW_TOKENS) for p in PROMPTS]


def run_pd(
    lc: LocalFabric,
    installed_site: Path,
    tmp: Path,
    prefill: dict[str, int],
    decode: dict[str, int],
    device: str = "cpu",
    backend: str = "sglang",
    module: str = "pdfabric_refengine.pd",  # the engine process (pdfabric_refengine.mla_pd: the MLA model)
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    requests = [{"room": 1000 + i, "prompt": p, "max_new_tokens": NEW_TOKENS} for i, p in enumerate(prompts or PROMPTS)]
    (tmp / "requests.json").write_text(json.dumps(requests))
    agents = {r.rank_id: lc.agents[a.name].address for a in lc.rankmap.agents for r in a.ranks}
    env = {
        **os.environ,
        # The checkout's code, and the installed distribution's metadata (its entry point).
        "PYTHONPATH": os.pathsep.join(
            [*(str(ROOT / d) for d in ("core", "agent", "integrations/sglang", "hack")), str(installed_site)]
        ),
        "PDFABRIC_ENGINE_TOKEN_FILE": str(tmp / "token"),
        "SGLANG_PLUGINS": "pdfabric",
    }
    (tmp / "token").write_text(lc.token)
    bootstrap = f"127.0.0.1:{free_port()}"
    procs = {}
    for role, par in (("prefill", prefill), ("decode", decode)):
        cmd = [sys.executable, "-m", module, "--role", role, "--requests", str(tmp / "requests.json"),
               "--out", str(tmp / f"{role}.json"), "--bootstrap", bootstrap, "--shm-dir", lc.shm_dir,
               "--agents", json.dumps(agents), "--device", device, "--backend", backend, *(x for k, v in par.items() for x in (f"--{k}", str(v)))]  # fmt: skip
        procs[role] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {role: proc.communicate(timeout=240)[0] for role, proc in procs.items()}
    failed = {role: logs[role][-3000:] for role, proc in procs.items() if proc.returncode != 0}
    assert not failed, "\n".join(f"{role} engine failed:\n{log}" for role, log in failed.items())
    return {role: json.loads((tmp / f"{role}.json").read_text()) for role in procs}
