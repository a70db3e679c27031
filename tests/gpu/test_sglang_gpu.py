"""Engine-owned GPU memory on one GPU (issue 11): prefill and decode engine processes keep their KV
pools on the one H200, the agent maps them by CUDA IPC and moves them with the intra-node NVLink
path's kernels (every rank on GPU 0: the fastest path one GPU allows), and greedy generation
through PD equals colocated generation token for token. The engines talk to the agent through
SGLang's classes (``sglang``: needs SGLang's GPU kernels, ``sgl_kernel``, which SGLang imports once
CUDA is up) or its engine API alone (``direct``). Results go to $PDFABRIC_GPU_RESULTS when set."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from tests.e2e.pd_runs import PROMPTS, REF_MODEL, colocated, run_pd  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.slow,
]


def sglang_gpu_ready() -> bool:
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("backend", ["direct", "sglang"])
@pytest.mark.parametrize(
    ("prefill", "decode"), [({"tp": 1}, {"tp": 1}), ({"tp": 2}, {"tp": 4})], ids=["tp1-tp1", "tp2-tp4"]
)
def test_greedy_generation_through_pd_on_one_gpu_equals_colocated(
    backend: str,
    installed_site: Path,
    tmp_path: Path,
    prefill: dict[str, int],
    decode: dict[str, int],
) -> None:
    if backend == "sglang" and not sglang_gpu_ready():
        pytest.skip("SGLang on a GPU imports its GPU kernels (sgl_kernel), which this machine lacks")
    spec = {"prefill": prefill, "decode": decode, "transfer": {"memPool": "INTRA_NODE_NVLINK", "timeoutSeconds": 20},
            "model": REF_MODEL}  # fmt: skip
    with LocalFabric(spec, decode_gpu=0) as lc:
        out = run_pd(lc, installed_site, tmp_path, prefill, decode, device="cuda:0", backend=backend)
        for side in ("prefill", "decode"):
            assert [r["state"] for r in out[side]["results"]] == ["Success"] * len(PROMPTS), out[side]
        tokens = [r["tokens"] for r in out["decode"]["results"]]
        assert tokens == colocated()
        paths = lc.bytes_by_path()
        latencies = [m["latency_s"] for r in out["prefill"]["results"] for m in r["metrics"].values()]
        report: dict[str, Any] = {
            "case": f"prefill tp{prefill['tp']} -> decode tp{decode['tp']} ({backend})",
            "device": torch.cuda.get_device_name(0),
            "prompts": len(PROMPTS),
            "tokens_equal_colocated": True,
            "bytes_by_path": paths,
            "sender_latency_s": {"min": min(latencies), "max": max(latencies)},
        }
        target = os.environ.get("PDFABRIC_GPU_RESULTS")
        if target:
            with open(
                Path(target) / f"engine-memory-{backend}-{prefill['tp']}-{decode['tp']}.json", "w", encoding="utf-8"
            ) as fh:
                json.dump(report, fh, indent=1)
        assert paths  # the agents counted what moved
