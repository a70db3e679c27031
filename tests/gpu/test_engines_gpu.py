"""The one-container node pod on a GPU (issue 12): each agent runs its node's engines itself
(PDFABRIC_ENGINES, as the operator writes it for spec.engine) with CUDA_VISIBLE_DEVICES naming
their ranks' GPU; the engines keep their KV pools on that GPU, the agent opens them by CUDA IPC
(it sees the GPU: same container) and moves them with the fast path's kernels. Prompts come back
equal to colocated generation; a SIGKILLed decode engine fails its requests, is restarted by its
agent, registers its new GPU memory and serves again (tests/e2e/test_engines_local.py runs the
same on CPU). Results go to $PDFABRIC_GPU_RESULTS when set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.e2e.supervised_runs import run_supervised  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.slow,
]


def test_agents_run_their_engines_on_the_gpu_and_cuda_ipc_carries_the_kv() -> None:
    report = run_supervised({"memPool": "INTRA_NODE_NVLINK"}, "cuda:0")
    paths = report["bytes_by_path"]
    assert paths and all(k.startswith("nvlink-kernel/") for k in paths), paths  # every byte by the kernels
    report["case"] = "prefill tp1 -> decode tp1, engines run by their agents (one GPU, INTRA_NODE_NVLINK)"
    report["device"] = torch.cuda.get_device_name(0)
    target = os.environ.get("PDFABRIC_GPU_RESULTS")
    if target:
        (Path(target) / "engines-supervised.json").write_text(json.dumps(report, indent=1))
