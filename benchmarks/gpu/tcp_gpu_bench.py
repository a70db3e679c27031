"""Engine GPU KV over tcp (issue 24), on one GPU machine, loopback, in one run:

- agent, GPU KV staged: two real agents on tcp, the engines' K/V buffers on cuda:0 registered with
  them (CUDA IPC), a room timed from the prefill engine's `send` to the decode room's Success; the
  sender gathers GPU sources into its pinned host slots, pipelined (transfer/staging.py);
- agent, GPU KV direct: the same with PDFABRIC_TCP_STAGING=0 (Mooncake copies device memory itself);
- agent, host pools: the same agents, the same rooms, from and to their own host (shared-memory)
  pools, before the engine memory is registered;
- Mooncake, GPU memory: Mooncake's own TCP transport through its Python API, two engines in this
  process, source and destination tensors on cuda:0, the same blocks in batches of the same size;
- Mooncake, host memory: the same with host buffers (context: Mooncake's own device/host ratio).

Geometry per page size: 4 layers, K and V, 16-token pages of bf16 heads of dim 128 (heads = page /
4 KiB), random pages (one block per page per layer and K/V: coalescing off, so every column moves
identical blocks), rooms of 16 MiB (4 KiB pages) or 64 MiB, batches of 1024 blocks (the spec's
maxBatchEntries). Medians of 5 rooms after one warm-up room. Targets: agent GPU (staged) >= 0.9 of
agent host and >= 1.0 of Mooncake GPU.

Run on the GPU machine from the repo root with the Mooncake CUDA engine loaded (run.sh):
python3 benchmarks/gpu/tcp_gpu_bench.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "agent", "operator", "hack")]
os.environ["MC_FORCE_TCP"] = "1"  # this process's own engines (the raw columns) run tcp

from pdfabric_agent.client.api import AgentRefused  # noqa: E402
from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.gpu_engine import GpuEngineRank  # noqa: E402

LAYERS, PAGE_TOKENS, HEAD_BYTES, BATCH = 4, 16, 256, 1024
PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10)
REPS = 5
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


def geometry(page: int) -> tuple[int, int, int]:
    """(heads, pages per room, pool pages) for one page size."""
    heads = page // (PAGE_TOKENS * HEAD_BYTES)
    room_bytes = (16 << 20) if page <= 4 << 10 else (64 << 20)
    per_room = room_bytes // (LAYERS * 2 * page)
    return heads, per_room, 4 * per_room


def waiting(lc: LocalFabric, room: int) -> bool:
    try:
        return lc.client(P).poll(P, room).state is RoomState.WAITING_FOR_INPUT
    except AgentRefused:  # 404: the prefill agent knows nothing of the room yet
        return False


def agent_rooms(
    lc: LocalFabric, per_room: int, pool: int, first: int, rng: random.Random, ranks: dict[str, Any] | None = None
) -> list[float]:
    """Seconds from send to the decode room's Success, one warm-up room then REPS; with the engine
    ranks, each room's last page of the last V buffer is checked on arrival (the tests check all)."""
    out = []
    for k in range(first, first + REPS + 1):
        src, dst = rng.sample(range(pool), per_room), rng.sample(range(pool), per_room)
        lc.client(D).receive(D, k, dst, aux_index=k % 8)
        deadline = time.monotonic() + 10
        while not waiting(lc, k):  # decode bootstrapped first, as in serving
            if time.monotonic() > deadline:
                raise RuntimeError(f"room {k}: decode room info did not reach the prefill agent")
            time.sleep(0.001)
        t0 = time.monotonic()
        lc.client(P).send(P, k, src, aux_index=(k * 7) % 8)
        view = lc.client(D).wait(D, k, 300)
        dt = time.monotonic() - t0
        if view.state is not RoomState.SUCCESS or lc.client(P).wait(P, k, 60).state is not RoomState.SUCCESS:
            raise RuntimeError(f"room {k}: {view}")
        if ranks is not None:
            import torch

            if not torch.equal(ranks[D].v[-1][dst[-1]], ranks[P].v[-1][src[-1]]):
                raise RuntimeError(f"room {k}: a page differs on arrival")
        if k > first:
            out.append(dt)
    return out


def raw_rooms(page: int, per_room: int, pool: int, devices: tuple[str, str], rng: random.Random) -> list[float]:
    """Mooncake's TCP transport alone: two engines here, `pool` pages per layer and K/V, the source
    on ``devices[0]``, the destination on ``devices[1]``."""
    import torch
    from mooncake.engine import TransferEngine

    nbytes = LAYERS * 2 * pool * page
    engines, bufs = [], []
    for device in devices:
        e = TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=False)
        if device == "cpu":
            buf.fill_(0)  # touch the pages: host pools are touched before they move too
        if e.register_memory(buf.data_ptr(), nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        engines.append(e)
        bufs.append(buf)
    bufs[0].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=devices[0]))
    peer = f"127.0.0.1:{engines[1].get_rpc_port()}"
    s0, d0 = bufs[0].data_ptr(), bufs[1].data_ptr()
    out = []
    try:
        for k in range(REPS + 1):
            sp, dp = rng.sample(range(pool), per_room), rng.sample(range(pool), per_room)
            blocks = [
                (s0 + (b * pool + s) * page, d0 + (b * pool + d) * page)
                for b in range(LAYERS * 2)
                for s, d in zip(sp, dp, strict=True)
            ]
            t0 = time.monotonic()
            for i in range(0, len(blocks), BATCH):
                chunk = blocks[i : i + BATCH]
                rc = engines[0].batch_transfer_sync_write(
                    peer, [s for s, _ in chunk], [d for _, d in chunk], [page] * len(chunk)
                )
                if rc != 0:
                    raise RuntimeError(f"Mooncake batch write returned {rc}")
            dt = time.monotonic() - t0
            b, s, d = LAYERS * 2 - 1, sp[-1], dp[-1]
            src_page = bufs[0][(b * pool + s) * page : (b * pool + s + 1) * page]
            dst_page = bufs[1][(b * pool + d) * page : (b * pool + d + 1) * page]
            if not torch.equal(src_page.cpu(), dst_page.cpu()):
                raise RuntimeError("raw Mooncake write did not land")
            if k:
                out.append(dt)
    finally:
        for e, buf in zip(engines, bufs, strict=True):
            e.unregister_memory(buf.data_ptr())
    return out


def one_size(page: int, rng: random.Random) -> dict[str, Any]:
    import torch

    heads, per_room, pool = geometry(page)
    room_bytes = LAYERS * 2 * per_room * page
    spec = {
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": {"transport": "tcp", "timeoutSeconds": 120},
        "model": {"layers": LAYERS, "kvHeads": heads, "headDim": HEAD_BYTES // 2, "dtype": "bfloat16",
                  "pageSizeTokens": PAGE_TOKENS, "auxRowBytes": [64]},
    }  # fmt: skip
    env = {
        "PDFABRIC_KV_PAGES": str(pool),
        "PDFABRIC_COALESCE": "0",
        "PDFABRIC_STATE_SLOTS": "1",
        "PDFABRIC_AUX_SLOTS": "8",
    }
    row: dict[str, Any] = {
        "page": page,
        "pages_per_room": per_room,
        "blocks": LAYERS * 2 * per_room,
        "room_bytes": room_bytes,
    }
    for key, staging in (("", "1"), ("_direct", "0")):
        with LocalFabric(spec, env={**env, "PDFABRIC_TCP_STAGING": staging}, decode_gpu=0) as lc:
            if staging == "1":
                row["agent_host_s"] = agent_rooms(lc, per_room, pool, 1000, rng)
            ranks = {}
            try:
                for r in (P, D):
                    ranks[r] = GpuEngineRank(r, layers=LAYERS, heads=heads, head_bytes=HEAD_BYTES, page_tokens=PAGE_TOKENS,
                                             pages=pool, aux_row_bytes=[64], aux_slots=8, shm_dir=lc.shm_dir)  # fmt: skip
                    ranks[r].register(lc.client(r))
                for t in (*ranks[P].k, *ranks[P].v):
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
                torch.cuda.synchronize()
                row[f"agent_gpu{key}_s"] = agent_rooms(lc, per_room, pool, 2000, rng, ranks)
                row[f"bytes_by_path{key}"] = lc.bytes_by_path()
            finally:
                for rank in ranks.values():
                    rank.close()
    row["mooncake_gpu_s"] = raw_rooms(page, per_room, pool, ("cuda:0", "cuda:0"), rng)
    row["mooncake_host_s"] = raw_rooms(page, per_room, pool, ("cpu", "cpu"), rng)
    # Where Mooncake's device path loses: a host source (the sender's side staged) and a host
    # destination (the receiver's side staged), one at a time.
    row["mooncake_host_to_gpu_s"] = raw_rooms(page, per_room, pool, ("cpu", "cuda:0"), rng)
    row["mooncake_gpu_to_host_s"] = raw_rooms(page, per_room, pool, ("cuda:0", "cpu"), rng)
    for key in (
        "agent_host",
        "agent_gpu",
        "agent_gpu_direct",
        "mooncake_gpu",
        "mooncake_host",
        "mooncake_host_to_gpu",
        "mooncake_gpu_to_host",
    ):
        row[f"{key}_gbps"] = room_bytes / statistics.median(row[f"{key}_s"]) / 1e9
    row["gpu_over_host"] = row["agent_gpu_gbps"] / row["agent_host_gbps"]
    row["gpu_over_mooncake"] = row["agent_gpu_gbps"] / row["mooncake_gpu_gbps"]
    row["direct_over_host"] = row["agent_gpu_direct_gbps"] / row["agent_host_gbps"]
    return row


def main() -> None:
    import torch

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    head = (
        "| page | blocks/room | MiB/room | agent, GPU KV staged GB/s | agent, GPU KV direct GB/s "
        "| agent, host pools GB/s | Mooncake tcp, GPU GB/s "
        "| Mooncake tcp, host GB/s | Mooncake host -> GPU | Mooncake GPU -> host "
        "| staged / agent host | staged / Mooncake GPU | direct / agent host |"
    )
    lines = [f"Engine GPU KV over tcp, loopback, {torch.cuda.get_device_name(0)}, medians of {REPS} rooms", "", head,
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = []
    for page in PAGE_SIZES:
        r = one_size(page, rng)
        rows.append(r)
        lines.append(
            f"| {page >> 10} KiB | {r['blocks']} | {r['room_bytes'] >> 20} | {r['agent_gpu_gbps']:.3f} "
            f"| {r['agent_gpu_direct_gbps']:.3f} | {r['agent_host_gbps']:.3f} "
            f"| {r['mooncake_gpu_gbps']:.3f} | {r['mooncake_host_gbps']:.3f} | {r['mooncake_host_to_gpu_gbps']:.3f} "
            f"| {r['mooncake_gpu_to_host_gbps']:.3f} | {r['gpu_over_host']:.2f} | {r['gpu_over_mooncake']:.2f} "
            f"| {r['direct_over_host']:.2f} |"
        )
        print(
            lines[-1], json.dumps({k: v for k, v in r.items() if k.endswith("_s") or k == "bytes_by_path"}), flush=True
        )
    text = "\n".join(lines)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tcp_gpu_bench.md"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(out, "tcp_gpu_bench.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
