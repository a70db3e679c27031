"""vLLM's connector worker side (``pdfabric_vllm.worker.WorkerSide``) in processes of its own,
without vLLM: each process builds a KV cache the way vLLM 0.32 does (one backing buffer, a
``[blocks, heads, tokens, K | V]`` view per layer, layer-compact), on the CPU in shared memory (the
connector's ``kv_allocation``) or on a GPU, registers it with its agent, and acts on the orders
vLLM's scheduler side would give it. A prefill rank's pages, filled with seeded bytes, land in the
decode ranks' pages, each decode rank's heads of them, and nothing else changes."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from pdfabric_core.policy.types import Role

LAYERS, HEADS, TOKENS, DIM = 2, 2, 32, 32  # the test model's: float32, head_dim 32, pages of 32
PAGES = 16
SRC_PAGES, DST_PAGES = (3, 1, 5, 9), (0, 2, 4, 15)
ROOM = 7_000_000_001


def spec() -> dict[str, Any]:
    model = {"layers": LAYERS, "kvHeads": HEADS, "headDim": DIM, "dtype": "float32", "pageSizeTokens": TOKENS}
    return {"prefill": {"tp": 1}, "decode": {"tp": 2}, "transfer": {"transport": "tcp", "timeoutSeconds": 20},
            "model": model}  # fmt: skip


def _cache(device: str, heads: int, shm_dir: str) -> tuple[Any, dict[str, Any]]:
    """vLLM's per-layer views of one backing buffer, allocated as vLLM does under the connector
    (inside its ``get_mem_pool_context``)."""
    import contextlib
    import os

    import torch
    from pdfabric_vllm.memory import kv_allocation

    os.environ["PDFABRIC_SHM_DIR"] = shm_dir
    per_layer = PAGES * heads * TOKENS * 2 * DIM
    with kv_allocation(device) or contextlib.nullcontext():
        raw = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8, device=device)
    flat = raw.view(torch.float32)
    views = {f"model.layers.{i}.self_attn.attn": flat[i * per_layer : (i + 1) * per_layer].view(PAGES, heads, TOKENS, 2 * DIM)
             for i in range(LAYERS)}  # fmt: skip
    return raw, views


def rank_process(role: str, tp_rank: int, env: dict[str, str], device: str, out: Any) -> None:
    """One worker rank: register, fill (prefill) or poison (decode), act on its order, report."""
    import torch
    from pdfabric_vllm.orders import Orders, ReceiveOrder, SendOrder
    from pdfabric_vllm.worker import WorkerSide

    try:
        heads = HEADS if role == "prefill" else HEADS // 2
        raw, views = _cache(device, heads, env["PDFABRIC_SHM_DIR"])
        if role == "prefill":
            gen = torch.Generator().manual_seed(11)
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=gen).to(device))
        else:
            raw.fill_(-91)  # 0xA5: what is not addressed must still read it
        side = WorkerSide(Role(role), tp_rank, 0, env=env)
        gpu = 0 if device.startswith("cuda") else None
        side.register(views, gpu)
        if role == "prefill":
            side.take(Orders(sends=[SendOrder("req-p", ROOM, SRC_PAGES, TOKENS)]))
        else:
            side.take(Orders(receives=[ReceiveOrder("req-d", ROOM, 0, 0, DST_PAGES, 0)]))
        deadline = time.monotonic() + 60
        done: tuple[set[str] | None, set[str] | None] = (None, None)
        while time.monotonic() < deadline:
            done = side.finished()
            if done[0] or done[1]:
                break
            time.sleep(0.005)  # vLLM's step
        errors = side.load_errors()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.put((role, tp_rank, done, sorted(errors), raw.cpu().numpy().tobytes(), side.registration.to_json()))
        side.close()
    except BaseException as exc:  # the parent reports it
        out.put((role, tp_rank, None, [], repr(exc).encode(), {}))


def move_a_room(fabric: Any, device: str) -> dict[str, Any]:
    """Run the three ranks in processes of their own; check what landed; the report."""
    import numpy as np
    import torch

    token = Path(fabric.workdir) / "engine-token"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [("prefill", 0, "prefill-0-tp0-cp0"), ("decode", 0, "decode-0-tp0"), ("decode", 1, "decode-0-tp1")]
    procs = []
    started = time.monotonic()
    for role, tp, rank in ranks:
        env = {"PDFABRIC_ENGINE_TOKEN_FILE": str(token), "PDFABRIC_AGENT_ADDRESS": fabric.agents[fabric.agent_of(rank)].address,
               "PDFABRIC_REPLICA": "0", "PDFABRIC_SHM_DIR": fabric.shm_dir, "PDFABRIC_RANK": rank}  # fmt: skip
        p = ctx.Process(target=rank_process, args=(role, tp, env, device, out))
        p.start()
        procs.append(p)
    results = {(r[0], r[1]): r for r in (out.get(timeout=120) for _ in ranks)}
    for p in procs:
        p.join(30)
    elapsed = time.monotonic() - started
    for key, (_, _, done, _, payload, _) in results.items():
        assert done is not None, (key, payload.decode(errors="replace"))
    assert results[("prefill", 0)][2][0] == {"req-p"}
    src = np.frombuffer(results[("prefill", 0)][4], dtype=np.int8).reshape(LAYERS, PAGES, HEADS, TOKENS * 2 * DIM * 4)
    gen = torch.Generator().manual_seed(11)
    assert (
        bytes(src.tobytes()) == torch.randint(-128, 128, (src.size,), dtype=torch.int8, generator=gen).numpy().tobytes()
    )
    for tp in (0, 1):
        _, _, (_, received), errors, payload, reg = results[("decode", tp)]
        assert received == {"req-d"} and errors == [], (received, errors)
        assert len(reg["fused"]) == LAYERS and reg["page_order"] == "head-major"
        # The agent reached the cache where it lives: the shared-memory file, or the GPU by CUDA IPC.
        assert {b["kind"] for b in reg["fused"]} == {"shm" if device == "cpu" else "cuda-ipc"}, reg["fused"]
        dst = np.frombuffer(payload, dtype=np.int8).reshape(LAYERS, PAGES, 1, TOKENS * 2 * DIM * 4)
        for s, d in zip(SRC_PAGES, DST_PAGES, strict=True):
            assert (dst[:, d, 0] == src[:, s, tp]).all(), (tp, s, d)  # its head's K and V, whole
        untouched = [p for p in range(PAGES) if p not in DST_PAGES]
        assert (dst[:, untouched] == -91).all()
    moved = fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
    want = LAYERS * len(SRC_PAGES) * HEADS * TOKENS * 2 * DIM * 4
    assert moved == want, (moved, want)
    kinds = sorted({b["kind"] for r in results.values() for b in r[5]["fused"]})
    return {"device": device, "shared_as": kinds, "ranks": "prefill tp1 -> decode tp2", "pages": len(SRC_PAGES), "kv_bytes_moved": moved,
            "byte_exact": True, "seconds_with_process_starts": round(elapsed, 2)}  # fmt: skip
