"""pdfabric on NIXL against pdfabric on Mooncake and against raw NIXL, in one run, 4 KiB to 4 MiB
pages (loopback tcp, real agent processes).

Run: ``python benchmarks/bench_nixl.py [--page-kib 4 64 1024 4096] [--mib 32 128] [--repeat 9]``

Rooms of 32 and 128 MiB (the KV of about 250 and 1,000 tokens of a Llama-3-8B-sized model: 32
layers, 8 KV heads of 128, bf16): an agent room pays a fixed cost the raw run does not (the
client's send, the done report and decode's acknowledgement, about 2 ms here), which the smaller
rooms show.

- agent on NIXL / agent on Mooncake: a room through real agent processes with ``backend: nixl``
  or ``mooncake``, timed by the client from ``send`` to the prefill room's Success (every batch
  landed and the decode agent acknowledged), and its write phase alone (the room's phases: from
  Transferring to the target written), coalescing off so the agents move exactly the raw run's
  blocks (source every other page, destination reversed: one block per page);
- raw NIXL: the same blocks between the same two pool files (the agents' own, mapped here and in
  a receiver process of its own), written by NIXL's Python API directly: one ``initialize_xfer``
  per chunk of at most ``maxBatchEntries`` blocks, waited for by polling ``check_xfer_state``; its
  NIXL agents made as the backend makes them (``waiting_agent``: a progress thread that waits for
  events; NIXL's own default polls without waiting and would slow everything on two cores).
Medians over ``--repeat`` rooms. The raw and the agent rooms on NIXL alternate (who goes first
alternating too), so that a slow spell of the machine falls on both, and their ratio is the median
of the paired ratios; Mooncake's rooms run after them, in a fabric of their own. Two cores are
shared by everything here: read the ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]

from pdfabric_agent.memory.plan import Bases, Block, TransferSide, decode_targets, plan_transfer, sender_duties  # noqa: E402
from pdfabric_agent.protocol.info import PoolInfo  # noqa: E402
from pdfabric_agent.transfer.nixl_setup import ucx_env, waiting_agent  # noqa: E402
from pdfabric_core.policy.chunking import chunk_batch  # noqa: E402
from pdfabric_core.policy.types import Transport  # noqa: E402
from pdfabric_core.spec import PDClusterSpec  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_agent  # noqa: E402  (its room, pool mapping and page order: the same as its own table's)
from bench_agent import map_pool, scattered  # noqa: E402

PREFILL, DECODE = "prefill-0-tp0-cp0", "decode-0-tp0"
BATCH = 1024  # the spec's default maxBatchEntries


def spec_for(backend: str, page_kib: int) -> dict[str, Any]:
    return {**bench_agent.spec_for(page_kib), "backend": backend}


def raw_receiver(handle: str, size: int, conn: Connection) -> None:
    """A NIXL agent of its own process on the decode pool file: it sends its metadata and base
    address, then waits until told to stop (a WRITE needs nothing of the receiver)."""
    from nixl._api import nixl_agent

    m, addr = map_pool(PoolInfo(addr=0, size=size, device="cpu", handle=handle))
    agent = waiting_agent(nixl_agent, "raw-decode")
    agent.register_memory(agent.get_reg_descs([(addr, size, 0, "kv")], "DRAM"))
    conn.send((bytes(agent.get_agent_metadata()), addr))
    conn.recv()
    del agent, m


class RawNixl:
    """This process's NIXL agent on the prefill pool file, writing to the raw receiver."""

    def __init__(self, lc: LocalFabric) -> None:
        from nixl._api import nixl_agent

        pinfo = lc.client(PREFILL).info().rank(PREFILL)
        dinfo = lc.client(DECODE).info().rank(DECODE)
        self.src_map, self.src_addr = map_pool(pinfo.pools["kv"])
        self.pinfo, self.dinfo = pinfo, dinfo
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=raw_receiver, args=(dinfo.pools["kv"].handle, dinfo.pools["kv"].size, child)
        )
        self.proc.start()
        metadata, self.dst_addr = self.conn.recv()
        self.agent = waiting_agent(nixl_agent, "raw-prefill")
        self.agent.register_memory(self.agent.get_reg_descs([(self.src_addr, pinfo.pools["kv"].size, 0, "kv")], "DRAM"))
        self.remote = self.agent.add_remote_agent(metadata)

    def blocks(self, spec: PDClusterSpec, src: list[int], dst: list[int]) -> list[Block]:
        duties = sender_duties(spec, decode_targets(spec, 0)[0], 0, len(dst))
        assert duties is not None
        src_side = TransferSide(self.pinfo.layout, Bases(self.src_addr, 0, 0), src, [], None)
        dst_side = TransferSide(self.dinfo.layout, Bases(self.dst_addr, 0, 0), dst, [], None)
        return list(plan_transfer(duties, src_side, dst_side, coalesce=False).kv)

    def room(self, blocks: list[Block]) -> float:
        agent = self.agent
        start = time.perf_counter()
        for chunk in chunk_batch(blocks, BATCH):
            local = agent.get_xfer_descs([(b.src, b.length, 0) for b in chunk], "DRAM")
            remote = agent.get_xfer_descs([(b.dst, b.length, 0) for b in chunk], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote)
            state = agent.transfer(handle)
            while state == "PROC":
                time.sleep(50e-6)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL transfer ended {state}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)
        del self.agent


def measure(page_kib: int, mib: int, repeat: int) -> dict[str, float]:
    pages = max(1, mib * 1024 // (2 * page_kib))  # K and V pages of the one layer
    src, dst = scattered(pages)
    nbytes = pages * 2 * page_kib * 1024
    env = {"PDFABRIC_KV_PAGES": str(2 * pages), "PDFABRIC_COALESCE": "0"}
    out: dict[str, float] = {"pages": pages, "MiB": nbytes / 2**20}
    for backend in ("nixl", "mooncake"):
        spec = spec_for(backend, page_kib)
        with LocalFabric(spec, env=env) as lc:
            bench_agent.agent_room(lc, 0, src, dst)  # warm: sessions, metadata, page faults
            rooms: list[tuple[float, float]] = []
            raws: list[float] = []
            raw = RawNixl(lc) if backend == "nixl" else None
            try:
                blocks = raw.blocks(lc.spec, src, dst) if raw is not None else []
                if raw is not None:
                    raw.room(blocks)  # warm
                    out["blocks"] = len(blocks)
                for i in range(repeat):
                    if raw is not None and i % 2:
                        raws.append(raw.room(blocks))
                    rooms.append(bench_agent.agent_room(lc, i + 1, src, dst))
                    if raw is not None and not i % 2:
                        raws.append(raw.room(blocks))
            finally:
                if raw is not None:
                    raw.close()
            out[f"{backend}_GBps"] = nbytes / statistics.median(total for total, _ in rooms) / 1e9
            out[f"{backend}_write_GBps"] = nbytes / statistics.median(write for _, write in rooms) / 1e9
            if raws:
                out["raw_GBps"] = nbytes / statistics.median(raws) / 1e9
                out["paired"] = statistics.median(r / total for r, (total, _) in zip(raws, rooms, strict=True))
                out["paired_write"] = statistics.median(r / w for r, (_, w) in zip(raws, rooms, strict=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-kib", type=int, nargs="+", default=[4, 64, 1024, 4096])
    ap.add_argument("--mib", type=int, nargs="+", default=[32, 128], help="KV MiB per room, each a row per page size")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    for key, value in ucx_env(Transport.TCP, "127.0.0.1").items():
        os.environ.setdefault(key, value)  # the raw side runs UCX as the agents do
    print("| page | blocks/room | MiB/room | raw NIXL GB/s | pdfabric on NIXL GB/s (write phase) "
          "| pdfabric on Mooncake GB/s (write phase) | NIXL agent / raw NIXL, paired (write phase) "
          "| NIXL agent / Mooncake agent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for kib, mib in ((kib, mib) for mib in args.mib for kib in args.page_kib):
        r = measure(kib, mib, args.repeat)
        raw, nixl, mooncake = r["raw_GBps"], r["nixl_GBps"], r["mooncake_GBps"]
        print(
            f"| {kib} KiB | {int(r['blocks'])} | {r['MiB']:.0f} | {raw:.2f} | {nixl:.2f} ({r['nixl_write_GBps']:.2f}) "
            f"| {mooncake:.2f} ({r['mooncake_write_GBps']:.2f}) | {r['paired']:.2f} ({r['paired_write']:.2f}) "
            f"| {nixl / mooncake:.2f} |"
        )


if __name__ == "__main__":
    main()
