"""Engine GPU memory on tcp (issue 24): engines keep their KV on ``cuda:0``, their agents run tcp on
loopback, map the engines' GPU buffers by CUDA IPC and move them with Mooncake's TCP transport:
the sender gathers GPU sources into its own pinned host slots first (transfer/staging.py), a GPU
destination is written by Mooncake's CUDA build itself. The reference engine's greedy
generation through PD equals colocated generation token for token, also when the agents run tcp
as the declared fallback of an nvlink PDCluster this GPU cannot carry (no fabric memory); and a
room of an engine's GPU KV, state and aux lands byte-exact on a TP-mismatched decode (head
slices), checksummed (``spec.transfer.verify``), touching nothing else. Results go to
$PDFABRIC_GPU_RESULTS when set."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.gpu_engine import GpuEngineRank  # noqa: E402
from tests.e2e.pd_runs import PROMPTS, REF_MODEL, colocated, run_pd  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.slow,
]

# SGLang's MetadataBuffers stay on the CPU unless its pool is INTRA_NODE_NVLINK.
AUX_CPU = {"aux-device": "cpu"}


def save(name: str, report: dict[str, Any]) -> None:
    target = os.environ.get("PDFABRIC_GPU_RESULTS")
    if target:
        (Path(target) / name).write_text(json.dumps(report, indent=1))


def generate_through(
    lc: LocalFabric, site: Path, tmp: Path, prefill: dict[str, Any], decode: dict[str, Any], aux_path: str = "mooncake"
) -> dict[str, Any]:
    out = run_pd(lc, site, tmp, {**prefill, **AUX_CPU}, {**decode, **AUX_CPU}, device="cuda:0", backend="direct")
    for side in ("prefill", "decode"):
        assert [r["state"] for r in out[side]["results"]] == ["Success"] * len(PROMPTS), out[side]
    assert [r["tokens"] for r in out["decode"]["results"]] == colocated()
    paths = lc.bytes_by_path()
    # Mooncake's tcp moved the KV; the aux rows went its way too, or inside the done report where
    # the pool says so (NVLINK: the TCP side channel, policy/aux_path.py).
    assert set(paths) == {"mooncake/kv", f"{aux_path}/aux"}, paths
    return {"prompts": len(PROMPTS), "tokens_equal_colocated": True, "bytes_by_path": paths}


@pytest.mark.parametrize(
    ("prefill", "decode"), [({"tp": 1}, {"tp": 1}), ({"tp": 2}, {"tp": 4})], ids=["tp1-tp1", "tp2-tp4"]
)
def test_gpu_kv_through_tcp_agents_equals_colocated(
    installed_site: Path, tmp_path: Path, prefill: dict[str, int], decode: dict[str, int]
) -> None:
    spec = {
        "prefill": prefill,
        "decode": decode,
        "transfer": {"transport": "tcp", "timeoutSeconds": 20},
        "model": REF_MODEL,
    }
    with LocalFabric(spec, decode_gpu=0) as lc:
        report = generate_through(lc, installed_site, tmp_path, prefill, decode)
        for name in lc.agents:
            assert lc.readyz(name)[1]["transport"] == "tcp"
    report["case"] = f"prefill tp{prefill['tp']} -> decode tp{decode['tp']}, KV on cuda:0, agents on tcp"
    report["device"] = torch.cuda.get_device_name(0)
    save(f"tcp-gpu-{prefill['tp']}-{decode['tp']}.json", report)


def test_the_declared_tcp_fallback_serves_gpu_engines(installed_site: Path, tmp_path: Path) -> None:
    """An nvlink (multi-node NVLink) PDCluster with placement.fallback TCP on a GPU without fabric
    memory: the agents run tcp, say so, and serve the GPU engines."""
    from pdfabric_agent.memory import cuda

    if cuda.fabric_memory(0)[0]:
        pytest.skip("this GPU has fabric memory: the nvlink transport would not fall back")
    one = {"tp": 1}
    spec = {"prefill": one, "decode": one, "transfer": {"memPool": "NVLINK", "transport": "nvlink", "timeoutSeconds": 20},
            "placement": {"fallback": "TCP"}, "model": REF_MODEL}  # fmt: skip
    with LocalFabric(spec, decode_gpu=0) as lc:
        for name in lc.agents:
            body = lc.readyz(name)[1]
            assert (body["transport"], body["requested"]) == ("tcp", "nvlink"), body
        report = generate_through(lc, installed_site, tmp_path, one, one, aux_path="tcp-side-channel")
    report["case"] = "nvlink PDCluster, placement.fallback TCP, no fabric memory: agents on tcp, KV on cuda:0"
    save("tcp-fallback-gpu.json", report)


LAYERS, HEADS, HEAD_BYTES, PAGE_TOKENS = 3, 4, 128, 16  # float32 head dim 32
POOL_PAGES, STATE_SLOTS, AUX_SLOTS, STATE_BYTES = 256, 4, 8, 2 * 1024
AUX_ROWS = [64, 4096]
BYTES_MODEL = {"layers": LAYERS, "kvHeads": HEADS, "headDim": HEAD_BYTES // 4, "dtype": "float32",
               "pageSizeTokens": PAGE_TOKENS, "stateBytesPerRequest": STATE_BYTES, "stateLayers": 2,
               "auxRowBytes": AUX_ROWS}  # fmt: skip


def engine_rank(lc: LocalFabric, rank_id: str, heads: int) -> GpuEngineRank:
    rank = GpuEngineRank(
        rank_id, layers=LAYERS, heads=heads, head_bytes=HEAD_BYTES, page_tokens=PAGE_TOKENS, pages=POOL_PAGES,
        aux_row_bytes=AUX_ROWS, aux_slots=AUX_SLOTS, shm_dir=lc.shm_dir, state_layers=2,
        state_slot_bytes=STATE_BYTES // 2, state_slots=STATE_SLOTS,
    )  # fmt: skip
    answer = rank.register(lc.client(rank_id))
    assert answer.devices == ("cpu", "cuda"), answer
    return rank


def test_a_room_of_engine_gpu_memory_moves_byte_exact_over_tcp() -> None:
    spec = {"prefill": {"tp": 1}, "decode": {"tp": 2},
            "transfer": {"transport": "tcp", "timeoutSeconds": 30, "verify": True}, "model": BYTES_MODEL}  # fmt: skip
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    with LocalFabric(spec, decode_gpu=0) as lc:
        p, decodes = "prefill-0-tp0-cp0", ["decode-0-tp0", "decode-0-tp1"]
        src = engine_rank(lc, p, HEADS)
        dst = {d: engine_rank(lc, d, HEADS // 2) for d in decodes}
        try:
            for t in (*src.k, *src.v, *src.state):
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
            for a in src.aux:
                a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8))
            for room, n in enumerate((100, 7, 200), start=1):
                for rank in dst.values():  # poison: what is not addressed must still read 0xA5
                    for t in (*rank.k, *rank.v, *rank.state, *rank.aux):
                        t.fill_(0xA5)
                torch.cuda.synchronize()
                sp, dp = rng.sample(range(POOL_PAGES), n), rng.sample(range(POOL_PAGES), n)
                ss, ds = rng.randrange(STATE_SLOTS), rng.randrange(STATE_SLOTS)
                sa, da = rng.randrange(AUX_SLOTS), rng.randrange(AUX_SLOTS)
                for d in decodes:
                    lc.client(d).receive(d, room, dp, state_indices=[ds], aux_index=da)
                lc.client(p).send(p, room, sp, state_indices=[ss], aux_index=sa)
                for d in decodes:
                    assert lc.client(d).wait(d, room, 60).state is RoomState.SUCCESS
                assert lc.client(p).wait(p, room, 60).state is RoomState.SUCCESS
                for i, (d, rank) in enumerate(dst.items()):
                    heads = slice(i * HEADS // 2, (i + 1) * HEADS // 2)  # this decode rank's KV heads
                    for got_buf, want_buf in zip((*rank.k, *rank.v), (*src.k, *src.v), strict=True):
                        got, want = rank.page_view(got_buf), src.page_view(want_buf)
                        expect = torch.full_like(got, 0xA5)
                        expect[dp] = want[sp][:, :, heads]
                        assert torch.equal(got, expect), f"room {room}: KV differs on {d}"
                    for got_s, want_s in zip(rank.state, src.state, strict=True):
                        expect = torch.full_like(got_s, 0xA5)
                        expect[ds] = want_s[ss]
                        assert torch.equal(got_s, expect), f"room {room}: state differs on {d}"
                    for got_a, want_a in zip(rank.aux, src.aux, strict=True):
                        expect = torch.full_like(got_a, 0xA5)
                        expect[da] = want_a[sa]
                        assert torch.equal(got_a, expect), f"room {room}: aux differs on {d}"
            checks = lc.metric_sum("pdfabric_integrity_checks_total", result="match")
            assert checks == 3 * len(decodes), checks
            paths = lc.bytes_by_path()
            assert set(paths) == {"mooncake/kv", "mooncake/state", "mooncake/aux"}, paths
        finally:
            src.close()
            for rank in dst.values():
                rank.close()
    save("tcp-gpu-bytes.json", {"case": "prefill tp1 -> decode tp2, engine GPU KV and state, aux in shm, verify on",
                                "rooms": 3, "byte_exact": True, "integrity_matches": checks, "bytes_by_path": paths,
                                "device": torch.cuda.get_device_name(0)})  # fmt: skip
