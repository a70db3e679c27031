"""Agent throughput next to the raw Mooncake engine on the same buffers and blocks, the effect of
page coalescing, and the cost of the metrics.

Run: ``python benchmarks/bench_agent.py [--pages 256] [--repeat 5]`` (loopback tcp, real agents).

- agent: a room through real agent processes, timed by the client from ``send`` to the prefill
  room's Success (all batches confirmed and the decode agent acknowledged), coalescing off so
  the agent moves exactly the raw run's blocks;
- raw: this process registers the prefill pool file (mapped from /dev/shm) with an engine of its
  own and writes the same block list with ``batch_transfer_sync_write``, chunked alike, (1) into
  the decode pool file mapped and registered here, and (2) into the decode agent's own engine and
  pool, the receiver the agent path uses;
- coalescing: the same room through agents with PDFABRIC_COALESCE=1 vs 0, consecutive pages;
- metrics: the per-batch cost of the counter updates the agent makes, against the batch time.
Medians over ``--repeat`` runs. Two cores are shared by everything here: read ratios, not GB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]
os.environ.setdefault("MC_FORCE_TCP", "1")

from pdfabric_agent.memory.plan import Bases, TransferSide, decode_targets, plan_transfer, sender_duties  # noqa: E402
from pdfabric_agent.protocol.info import PoolInfo  # noqa: E402
from pdfabric_agent.runtime import metrics  # noqa: E402
from pdfabric_core.policy.chunking import chunk_batch  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402


def spec_for(page_kib: int) -> dict[str, Any]:
    # One layer, 8 KV heads x 128 dims x bf16: page_kib KiB per page means page_kib/2 tokens.
    model = {"layers": 1, "kvHeads": 8, "headDim": 128, "pageSizeTokens": page_kib // 2, "auxRowBytes": [8]}
    return {
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": {"transport": "tcp", "timeoutSeconds": 60},
        "model": model,
    }


def agent_room(lc: LocalFabric, room: int, src: list[int], dst: list[int]) -> tuple[float, float]:
    """(client-timed submit to confirmed completion, the agent's own write phase) in seconds."""
    p, d = "prefill-0-tp0-cp0", "decode-0-tp0"
    lc.client(d).receive(d, room, dst)
    start = time.perf_counter()
    lc.client(p).send(p, room, src)
    view = lc.client(p).wait(p, room, 60)
    elapsed = time.perf_counter() - start
    if not view.succeeded:
        raise RuntimeError(f"room {room} failed: {view.reason}")
    lc.client(d).wait(d, room, 10)
    phases = view.phases_s
    return elapsed, phases["written:decode-0-tp0"] - phases["transferring"]


def map_pool(info: PoolInfo) -> tuple[mmap.mmap, int]:
    fd = os.open(info.handle, os.O_RDWR)
    try:
        m = mmap.mmap(fd, info.size)
    finally:
        os.close(fd)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def raw_blocks(
    lc: LocalFabric, src: list[int], dst: list[int], *, coalesce: bool
) -> tuple[Any, Any, str, list[Any], Any]:
    """Two engines of this process on the agents' own pool files, and the room's block list."""
    from mooncake.engine import TransferEngine

    pinfo = lc.client("prefill-0-tp0-cp0").info().rank("prefill-0-tp0-cp0")
    dinfo = lc.client("decode-0-tp0").info().rank("decode-0-tp0")
    (sm, sa), (dm, da) = map_pool(pinfo.pools["kv"]), map_pool(dinfo.pools["kv"])
    a, b = TransferEngine(), TransferEngine()
    for eng, addr, size in ((a, sa, pinfo.pools["kv"].size), (b, da, dinfo.pools["kv"].size)):
        if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0 or eng.register_memory(addr, size) != 0:
            raise RuntimeError("raw engine setup failed")
    layout = pinfo.layout
    duties = sender_duties(lc.spec, decode_targets(lc.spec, 0)[0], 0, len(dst))
    assert duties is not None

    def blocks(dst_base: int) -> list[Any]:
        plan = plan_transfer(duties, TransferSide(layout, Bases(sa, 0, 0), src, [], None), TransferSide(dinfo.layout, Bases(dst_base, 0, 0), dst, [], None), coalesce=coalesce)  # fmt: skip
        return plan.kv

    # Receiver in this process (b, the decode pool file mapped here) and receiver in the decode
    # agent itself (its engine, its own address of the same pool): the latter is what the agent
    # path pays too, a second process on the same two cores.
    local = (f"127.0.0.1:{b.get_rpc_port()}", blocks(da))
    in_agent = (dinfo.endpoint, blocks(dinfo.pools["kv"].addr))
    return a, (sm, dm, b), local, in_agent


def raw_room(engine: Any, peer: str, blocks: list[Any], limit: int) -> float:
    start = time.perf_counter()
    for chunk in chunk_batch(blocks, limit):
        rc = engine.batch_transfer_sync_write(
            peer, [x.src for x in chunk], [x.dst for x in chunk], [x.length for x in chunk]
        )
        if rc != 0:
            raise RuntimeError(f"raw batch returned {rc}")
    return time.perf_counter() - start


def scattered(n: int) -> tuple[list[int], list[int]]:
    # Source every other page, destination reversed: no run survives, one block per page.
    return [2 * i for i in range(n)], [2 * n - 1 - 2 * i for i in range(n)]


def compare_raw(pages: int, page_kib: int, repeat: int) -> dict[str, float]:
    env = {"PDFABRIC_KV_PAGES": str(2 * pages), "PDFABRIC_COALESCE": "0"}
    with LocalFabric(spec_for(page_kib), env=env) as lc:
        src, dst = scattered(pages)
        nbytes = pages * 2 * page_kib * 1024
        engine, keep, (peer, blocks), (agent_peer, agent_blocks) = raw_blocks(lc, src, dst, coalesce=False)
        agent_t, write_t, raw_t, raw_agent_t = [], [], [], []
        agent_room(lc, 0, src, dst)  # warm every path (sessions, page faults)
        raw_room(engine, peer, blocks, 1024)
        raw_room(engine, agent_peer, agent_blocks, 1024)
        for i in range(repeat):
            total, writes = agent_room(lc, i + 1, src, dst)
            agent_t.append(total)
            write_t.append(writes)
            raw_t.append(raw_room(engine, peer, blocks, 1024))
            raw_agent_t.append(raw_room(engine, agent_peer, agent_blocks, 1024))
        med = statistics.median
        del engine, keep
        return {
            "blocks": len(blocks),
            "MiB": nbytes / 2**20,
            "agent_GBps": nbytes / med(agent_t) / 1e9,
            "write_GBps": nbytes / med(write_t) / 1e9,
            "raw_GBps": nbytes / med(raw_t) / 1e9,
            "raw_agent_GBps": nbytes / med(raw_agent_t) / 1e9,
        }


def coalescing(pages: int, page_kib: int, repeat: int) -> dict[str, float]:
    out: dict[str, float] = {}
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    nbytes = pages * 2 * page_kib * 1024
    for flag in ("1", "0"):
        with LocalFabric(
            spec_for(page_kib), env={"PDFABRIC_KV_PAGES": str(2 * pages), "PDFABRIC_COALESCE": flag}
        ) as lc:
            agent_room(lc, 0, src, dst)
            t = statistics.median(agent_room(lc, i + 1, src, dst)[0] for i in range(repeat))
            blocks = lc.metric_sum("pdfabric_transfer_blocks_total", role="prefill") / (repeat + 1)
            out[f"coalesce={flag}"] = nbytes / t / 1e9
            out[f"blocks={flag}"] = blocks
    return out


def metrics_cost(batches: int = 20000) -> float:
    """Seconds per batch of the counter updates the agent makes after each confirmed batch."""
    labels = ("bench", "prefill", "mooncake", "tcp", "mooncake")
    start = time.perf_counter()
    for _ in range(batches):
        metrics.transfer_bytes.labels(*labels, "kv").inc(65536)
        metrics.transfer_blocks.labels(*labels).inc(1024)
        metrics.transfer_batches.labels(*labels).inc()
    return (time.perf_counter() - start) / batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--page-kib", type=int, nargs="+", default=[64, 16])
    args = ap.parse_args()
    print("| page | pages/room | blocks | MiB/room | raw GB/s, receiver in-process | raw GB/s, receiver = decode agent "
          "| agent GB/s, submit to confirmed | agent / raw (agent receiver) | agent write phase / raw |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    batch_times = {}
    for kib in args.page_kib:
        for pages in args.pages:
            r = compare_raw(pages, kib, args.repeat)
            batch_times[kib] = r["MiB"] * 2**20 / (r["raw_agent_GBps"] * 1e9) / max(1, -(-int(r["blocks"]) // 1024))
            print(
                f"| {kib} KiB | {pages} | {int(r['blocks'])} | {r['MiB']:.0f} | {r['raw_GBps']:.2f} "
                f"| {r['raw_agent_GBps']:.2f} | {r['agent_GBps']:.2f} | {r['agent_GBps'] / r['raw_agent_GBps']:.2f} "
                f"| {r['write_GBps'] / r['raw_agent_GBps']:.2f} |"
            )
    c = coalescing(args.pages[0], 4, args.repeat)
    print()
    print("| 4 KiB pages, consecutive | blocks/room | agent GB/s |")
    print("|---|---|---|")
    print(f"| coalescing on | {c['blocks=1']:.0f} | {c['coalesce=1']:.2f} |")
    print(f"| coalescing off | {c['blocks=0']:.0f} | {c['coalesce=0']:.2f} |")
    per_batch = metrics_cost()
    print()
    print("| metrics per confirmed batch | cost | share of one 64 KiB-page batch |")
    print("|---|---|---|")
    print(f"| 3 counter updates | {per_batch * 1e6:.1f} us | {per_batch / batch_times[args.page_kib[0]] * 100:.3f} % |")


if __name__ == "__main__":
    main()
