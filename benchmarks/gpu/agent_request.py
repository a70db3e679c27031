"""Whole request through the agent API on a 2-GPU NVLink machine: real agent processes (prefill
on GPU 0, decode on GPU 1, INTRA_NODE_NVLINK), the serving engine's client calls, timed from
`send` to confirmed completion on the decode side.

The headline is send -> the decode room's Success as the decode agent reports it (a client long
poll on the decode agent): with the kernel path, the decode agent sees completion on the sender's
completion board itself. The prefill room's Success (send -> prefill) is printed beside it.

Geometry: 70B-class KV for one rank of TP 2 (80 layers, 8 KV heads / 2 = 4 per rank, head dim
128, bf16, 16-token pages = 16 KiB per page per layer per K/V), a 32768-token prompt = 2048 pages,
plus one aux row of 8 items x 4 KiB. Two page patterns: contiguous (a fresh cache: pages coalesce
into one block per layer and K/V) and scattered (random pages: one block per page per layer).
Fresh random pages every room. Before timing a room, the decode side's room info has reached the
prefill agent (its room view says WaitingForInput), as in serving, where decode bootstraps first.

Ceiling: a 1 GiB contiguous GPU 0 -> GPU 1 copy through the copy engines (torch copy_, peer),
median of 20 CUDA-event-timed copies, measured by this script in the same run before the agents
start; the target is send -> decode Success at >= 0.8 of it.

Run on the GPU machine from the repo root: python3 benchmarks/gpu/agent_request.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "agent", "hack")]

from pdfabric_agent.client.api import AgentRefused  # noqa: E402
from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS, TOKENS = 80, 4, 128, 16, 32768
PAGES = TOKENS // PAGE_TOKENS
POOL_PAGES = PAGES + PAGES // 4
SPEC = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"memPool": "INTRA_NODE_NVLINK", "transport": "nvlink-intra", "timeoutSeconds": 60},
    "model": {
        "layers": LAYERS,
        "kvHeads": HEADS,
        "headDim": HEAD_DIM,
        "pageSizeTokens": PAGE_TOKENS,
        "auxRowBytes": [4096] * 8,
    },
}


def bulk_ceiling(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """GB/s of one contiguous GPU 0 -> GPU 1 copy (copy engines, peer), median of `reps`."""
    import torch

    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    with torch.cuda.device(0):
        for i in range(reps + 3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a, non_blocking=True)
            e1.record()
            e1.synchronize()
            if i >= 3:
                times.append(e0.elapsed_time(e1) / 1e3)
    ok = bool(torch.equal(a[: 1 << 20].cpu(), b[: 1 << 20].cpu()))
    del a, b
    torch.cuda.empty_cache()
    if not ok:
        raise RuntimeError("ceiling copy did not arrive")
    return nbytes / statistics.median(times) / 1e9


def room(lc, k: int, src: list[int], dst: list[int]) -> dict[str, float]:
    """One room; seconds from `send` to the decode room's Success (the decode agent's own view:
    what a decode engine waits for) and to the prefill room's Success, and where the time went
    (agents and this script read one node-wide monotonic clock, so their marks line up)."""
    p, d = "prefill-0-tp0-cp0", "decode-0-tp0"
    lc.client(d).receive(d, k, dst, aux_index=k % 64)
    deadline = time.monotonic() + 10
    while True:  # until decode's room info has reached the prefill agent
        try:
            if lc.client(p).poll(p, k).state is RoomState.WAITING_FOR_INPUT:
                break
        except AgentRefused:  # 404: nothing known about the room yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"room {k}: decode room info did not reach the prefill agent")
        time.sleep(0.001)
    t0 = time.monotonic()
    lc.client(p).send(p, k, src, aux_index=(k * 7) % 64)
    dview = lc.client(d).wait(d, k, 120)
    t_decode = time.monotonic()
    view = lc.client(p).wait(p, k, 30)
    t_prefill = time.monotonic()
    for v in (dview, view):
        if not v.succeeded:
            raise RuntimeError(f"room {k}: {v.rank} {v.state.title} {v.reason}")
    if dview.moved != view.moved:
        raise RuntimeError(f"room {k}: decode counted {dview.moved}, prefill sent {view.moved}")
    ph, dph = view.phases_s, dview.phases_s
    room.last_phases = {"prefill": ph, "decode": dph}  # type: ignore[attr-defined]
    sub, dsub = view.submitted_at or 0.0, dview.submitted_at or 0.0
    arrived = dsub + dph[f"arrived:{p}"]
    launched = ph.get(f"launched:{d}", ph[f"planned:{d}"])  # the engine path has no launch of its own
    return {
        "decode": t_decode - t0,
        "prefill": t_prefill - t0,
        "confirmed": ph[f"acknowledged:{d}"],
        "b_send_in": sub - t0,
        "b_plan": ph[f"planned:{d}"],
        "b_launch": launched - ph[f"planned:{d}"],
        "b_kernel_seen": arrived - (sub + launched),
        "b_answer": t_decode - arrived,
    }


BREAKDOWN = (
    ("b_send_in", "client send -> prefill room created"),
    ("b_plan", "room planned"),
    ("b_launch", "kernels launched"),
    ("b_kernel_seen", "launch -> decode agent saw the completion word"),
    ("b_answer", "-> client's long poll answered"),
)


def run_modes(lc, nbytes: int, rng: random.Random, lines: list[str], result: dict, modes: list[str]) -> None:
    k = 0
    for mode, reps in (("contiguous", 9), ("scattered", 9)):
        if mode not in modes:
            continue
        rows: list[dict[str, float]] = []
        for i in range(reps + 1):
            if mode == "contiguous":
                s0, d0 = rng.randrange(0, POOL_PAGES - PAGES), rng.randrange(0, POOL_PAGES - PAGES)
                src, dst = list(range(s0, s0 + PAGES)), list(range(d0, d0 + PAGES))
            else:
                src, dst = rng.sample(range(POOL_PAGES), PAGES), rng.sample(range(POOL_PAGES), PAGES)
            r = room(lc, k, src, dst)
            k += 1
            if i:  # the first room of each mode warms sessions and mappings
                rows.append(r)
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        decodes = [r["decode"] for r in rows]
        t = med["decode"]
        ceiling = result.get("ceiling_gbps")

        def ratio(sec: float, ceiling: float | None = ceiling) -> str:
            return f" = {nbytes / sec / 1e9 / ceiling:.3f} of the ceiling" if ceiling else ""

        result[mode] = {
            "send_to_decode_success_ms": t * 1e3,
            "send_to_prefill_success_ms": med["prefill"] * 1e3,
            "medians_ms": {key: v * 1e3 for key, v in med.items()},
            "all_decode_ms": [x * 1e3 for x in decodes],
        }
        lines.append(
            f"- {mode} pages: send -> decode Success median {t * 1e3:.2f} ms = {nbytes / t / 1e9:.1f} GB/s{ratio(t)} "
            f"(min {min(decodes) * 1e3:.2f}, max {max(decodes) * 1e3:.2f} ms; {reps} rooms)"
        )
        lines.append(
            f"  send -> prefill Success median {med['prefill'] * 1e3:.2f} ms{ratio(med['prefill'])}; prefill agent's "
            f"clock, room submitted -> decode confirmed {med['confirmed'] * 1e3:.2f} ms{ratio(med['confirmed'])}"
        )
        lines.append(
            "  where the time goes (medians, ms): "
            + "; ".join(f"{label} {med[key] * 1e3:.2f}" for key, label in BREAKDOWN)
        )
        print(
            "\n".join(lines[-3:]),
            "phases of the last room (s):",
            json.dumps(getattr(room, "last_phases", {})),
            flush=True,
        )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="contiguous,scattered")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the bulk-copy ceiling")
    args = ap.parse_args()
    env = {
        "PDFABRIC_KV_PAGES": str(POOL_PAGES),
        "PDFABRIC_STATE_SLOTS": "1",
        "PDFABRIC_AUX_SLOTS": "64",
        "PDFABRIC_FASTPATH_TRACE": "1",
    }
    nbytes = LAYERS * 2 * PAGES * PAGE_TOKENS * HEADS * HEAD_DIM * 2 + 8 * 4096
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    lines = [f"Whole request through the agent API: {nbytes} bytes ({nbytes / 1e9:.3f} GB) per room."]
    result: dict = {"bytes": nbytes}
    if not args.no_ceiling:
        result["ceiling_gbps"] = bulk_ceiling()
        lines.append(
            f"- bulk ceiling, this run (1 GiB GPU0 -> GPU1 copy engines, median of 20): "
            f"{result['ceiling_gbps']:.1f} GB/s; 0.8 of it = {0.8 * result['ceiling_gbps']:.1f} GB/s "
            f"= {nbytes / (0.8 * result['ceiling_gbps'] * 1e9) * 1e3:.2f} ms per room"
        )
        print(lines[-1], flush=True)
    lc = LocalFabric(SPEC, env=env, decode_gpu=1)
    try:
        lc.start(wait_s=120)
        run_modes(lc, nbytes, rng, lines, result, args.modes.split(","))
        paths = {
            p: lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", path=p)
            for p in ("nvlink-kernel", "mooncake")
        }
        result["bytes_by_path"] = paths
        lines.append(f"- bytes by metrics label path (prefill): {json.dumps(paths)}")
        seen = {
            how: lc.metric_sum("pdfabric_decode_completions_total", how=how)
            for how in ("completion-board", "done-report")
        }
        result["decode_completions"] = seen
        lines.append(f"- how the decode agent learned each source's completion: {json.dumps(seen)}")
        trace = [ln for name in lc.agents for ln in lc.log(name).splitlines() if "fastpath batch" in ln]
        result["trace_tail"] = trace[-12:]
        print("\n".join(trace[-12:]), flush=True)
    except Exception:
        for name in lc.agents:
            print(f"--- {name} log ---\n{lc.log(name)}", flush=True)
        raise
    finally:
        lc.close()
    text = "\n".join(lines)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "agent_request.md"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(out, "agent_request.json"), "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
