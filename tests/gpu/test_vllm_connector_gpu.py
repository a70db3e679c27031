"""vLLM's connector worker side with its KV cache on a GPU (issue 41): three processes (prefill TP 1,
decode TP 2) build vLLM 0.32's cache layout on ``cuda:0`` (one backing buffer, a
``[blocks, heads, tokens, K | V]`` view per layer), register it with their agents through CUDA IPC
as fused K and V buffers, and move one room over the agents' tcp: each decode rank gets its head's
K and V of every page byte-exact, nothing else changes (tests/e2e/vllm_worker_ranks.py; the same on
CPU in tests/e2e/test_vllm_worker_ranks.py). Results go to $PDFABRIC_GPU_RESULTS when set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from tests.e2e.vllm_worker_ranks import move_a_room, spec  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"), pytest.mark.slow]


def test_worker_ranks_move_a_room_of_vllms_gpu_cache_byte_exact() -> None:
    with LocalFabric(spec(), decode_gpu=0) as fabric:
        report = move_a_room(fabric, "cuda:0")
        report["paths"] = fabric.bytes_by_path()
    report["gpu"] = torch.cuda.get_device_name(0)
    assert report["byte_exact"]
    target = os.environ.get("PDFABRIC_GPU_RESULTS")
    if target:
        (Path(target) / "vllm-connector-gpu.json").write_text(json.dumps(report, indent=1))
