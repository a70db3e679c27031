"""GPU memory between two processes on ONE GPU (issue 43): pdfabric on NIXL (UCX's CUDA IPC)
beside Mooncake and raw NIXL, in one run, 4 KiB to 4 MiB pages, 64 MiB to 1 GiB rooms.

Columns, per page size (one block per page per layer and K/V: coalescing off, random pages each
room, so every column moves the same number of blocks of the same size):

- raw NIXL: NIXL's Python API alone between this process and a receiver process of its own, each
  writing from / into a cuMemAlloc'd buffer of its own on cuda:0, every batch of at most 1024
  blocks posted before the first is waited for; UCX set up as the agents set it up
  (``ucx_env(nvlink-intra)``: cuda_ipc, cuda_copy, tcp);
- pdfabric on NIXL: two real agent processes, ``backend: nixl``, memPool NONE, transport
  nvlink-intra, their KV pools on cuda:0 (the agent's own cuMemAlloc), filled and checked by this
  process through the client's CUDA IPC mapping; a room timed by the client from ``send`` to the
  decode room's Success (the decode room announced, and known to the prefill agent, first), and its
  write phase alone (the prefill room's phases: Transferring to written);
- Mooncake nvlink_intra: the same rooms on memPool INTRA_NODE_NVLINK with the agents' GPU kernels
  off (PDFABRIC_FASTPATH=0): Mooncake's own intra-node NVLink transport moves them;
- pdfabric kernels: the same with the kernels on (on one GPU they copy between the processes'
  CUDA IPC mappings: the path Mooncake's backend takes there, ``nvlink-kernel``);
- Mooncake tcp, engine GPU KV: the path an engine's GPU KV takes today on one GPU with Mooncake
  (transport tcp, the engine's buffers registered by CUDA IPC, the sender's GPU sources staged
  through pinned host memory; benchmarks/gpu/tcp_gpu_bench.py).

Every timed room is checked: the destination pages are poisoned before it and must equal their
sources after it (every layer, K and V). Medians of ``--repeat`` rooms after one warm-up room.

Last, three raw NIXL probes of what UCX does with memory it did not allocate itself, each in
processes of their own (a minute at most each): ``own`` (both buffers cuMemAlloc'd by the process
that registers them: the agents' case), ``imported`` (each process registers a buffer the other
allocated and it opened by CUDA IPC: an engine's buffers, as an agent registers them) and ``pidns``
(``own``, the receiver in a PID namespace of its own: agents in two pods). Each says whether
registration and the write worked, byte-exact or not, and the processes run with
``UCX_PROTO_INFO=y``, so the log shows which UCX transport each protocol chose.

Run on the GPU machine from the repo root with NIXL and the Mooncake CUDA engine importable
(benchmarks/gpu/run.sh nixl): python3 benchmarks/gpu/nixl_gpu_bench.py [--page-kib 4 64 1024 4096]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "agent", "operator", "hack")]

from pdfabric_agent.client.api import AgentRefused  # noqa: E402
from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_agent.transfer.nixl_setup import ucx_env, waiting_agent  # noqa: E402
from pdfabric_core.policy.types import Transport  # noqa: E402
from pdfabric_devcluster.ucx_tables import ucx_tables  # noqa: E402

LAYERS, HEADS, TOKEN_HEAD_BYTES, BATCH = 4, 8, 256, 1024  # bf16 heads of dim 128
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"
POISON = 0xA5
CASES = ("nixl", "mooncake-engine", "kernels", "mooncake-tcp")
LABELS = {
    "nixl": "pdfabric on NIXL, cuda_ipc",
    "mooncake-engine": "Mooncake nvlink_intra",
    "kernels": "pdfabric kernels",
    "mooncake-tcp": "Mooncake tcp, engine GPU KV",
}
MARK = "@@"  # the receiver's answers on its stdout; UCX prints there too


def room_bytes(page: int) -> int:
    return min(1 << 30, max(64 << 20, page * 4096))


def geometry(page: int) -> tuple[int, int, int]:
    """(tokens per page, pages per room, pool pages) for one page size."""
    per_room = room_bytes(page) // (LAYERS * 2 * page)
    return page // (HEADS * TOKEN_HEAD_BYTES), per_room, 2 * per_room


def log(*args: Any) -> None:
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------- agents
def spec_for(case: str, page: int) -> dict[str, Any]:
    tokens, _, _ = geometry(page)
    transfer: dict[str, Any] = {"timeoutSeconds": 120}
    if case == "nixl":
        transfer["transport"] = "nvlink-intra"
    elif case in ("mooncake-engine", "kernels"):
        transfer["memPool"] = "INTRA_NODE_NVLINK"
    else:
        transfer["transport"] = "tcp"
    return {
        "backend": "nixl" if case == "nixl" else "mooncake",
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": transfer,
        "model": {"layers": LAYERS, "kvHeads": HEADS, "headDim": TOKEN_HEAD_BYTES // 2, "dtype": "bfloat16",
                  "pageSizeTokens": tokens, "auxRowBytes": [64]},
    }  # fmt: skip


def prefill_knows(lc: Any, room: int) -> bool:
    try:
        return lc.client(P).poll(P, room).state is RoomState.WAITING_FOR_INPUT
    except AgentRefused:  # 404: the prefill agent knows nothing of the room yet
        return False


class Pages:
    """The KV pages of both ranks as (layer x K/V, pool pages, page bytes) uint8 views on cuda:0,
    whatever holds them (the agents' pools mapped here, or an engine's buffers)."""

    def __init__(self, src: Any, dst: Any) -> None:
        self.src, self.dst = src, dst

    def poison(self, pages: list[int]) -> None:
        for view in self.dst:
            view[pages] = POISON

    def equal(self, sp: list[int], dp: list[int]) -> bool:
        return all(bool((d[dp] == s[sp]).all()) for s, d in zip(self.src, self.dst, strict=True))


def agent_rooms(lc: Any, pages: Pages, per_room: int, pool: int, rng: random.Random, repeat: int) -> dict[str, Any]:
    import torch

    total, write = [], []
    for k in range(repeat + 1):
        room = 1000 + k
        sp, dp = rng.sample(range(pool), per_room), rng.sample(range(pool), per_room)
        pages.poison(dp)
        torch.cuda.synchronize()
        lc.client(D).receive(D, room, dp, aux_index=k % 8)
        deadline = time.monotonic() + 20
        while not prefill_knows(lc, room):
            if time.monotonic() > deadline:
                raise RuntimeError(f"room {room}: the decode room did not reach the prefill agent")
            time.sleep(0.001)
        t0 = time.perf_counter()
        lc.client(P).send(P, room, sp, aux_index=(7 * k) % 8)
        view = lc.client(D).wait(D, room, 60)
        dt = time.perf_counter() - t0
        pview = lc.client(P).wait(P, room, 60)
        if view.state is not RoomState.SUCCESS or pview.state is not RoomState.SUCCESS:
            raise RuntimeError(f"room {room}: decode {view}, prefill {pview}")
        torch.cuda.synchronize()
        if not pages.equal(sp, dp):
            raise RuntimeError(f"room {room}: a page differs on arrival")
        if k:
            total.append(dt)
            phases = pview.phases_s
            if f"written:{D}" in phases and "transferring" in phases:
                write.append(phases[f"written:{D}"] - phases["transferring"])
    return {"total_s": total, **({"write_s": write} if len(write) == len(total) else {})}


def agent_case(case: str, page: int, rng: random.Random, repeat: int) -> dict[str, Any]:
    import torch

    from pdfabric_devcluster.fabric import LocalFabric
    from pdfabric_devcluster.gpu_engine import GpuEngineRank

    tokens, per_room, pool = geometry(page)
    env = {
        "PDFABRIC_KV_PAGES": str(8 if case == "mooncake-tcp" else pool),  # tcp: the engine's buffers hold the KV
        "PDFABRIC_COALESCE": "0",
        "PDFABRIC_STATE_SLOTS": "1",
        "PDFABRIC_AUX_SLOTS": "8",
        "UCX_PROTO_INFO": "y",
    }
    if case == "mooncake-engine":
        env["PDFABRIC_FASTPATH"] = "0"
    out: dict[str, Any] = {}
    with LocalFabric(spec_for(case, page), env=env, decode_gpu=0) as lc:
        if case == "mooncake-tcp":
            ranks = {}
            try:
                for r in (P, D):
                    ranks[r] = GpuEngineRank(r, layers=LAYERS, heads=HEADS, head_bytes=TOKEN_HEAD_BYTES,
                                             page_tokens=tokens, pages=pool, aux_row_bytes=[64], aux_slots=8,
                                             shm_dir=lc.shm_dir)  # fmt: skip
                    ranks[r].register(lc.client(r))
                src, dst = ranks[P], ranks[D]
                for t in (*src.k, *src.v):
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
                pages = Pages([*src.k, *src.v], [*dst.k, *dst.v])
                out.update(agent_rooms(lc, pages, per_room, pool, rng, repeat))
            finally:
                for rank in ranks.values():
                    rank.close()
        else:
            src_pools, dst_pools = lc.client(P).map_pools(P), lc.client(D).map_pools(D)
            try:
                s = torch.as_tensor(src_pools.kv, device="cuda:0")
                d = torch.as_tensor(dst_pools.kv, device="cuda:0")
                s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda:0"))
                views = [t.view(LAYERS * 2, pool, page) for t in (s, d)]
                pages = Pages(list(views[0].unbind(0)), list(views[1].unbind(0)))
                out.update(agent_rooms(lc, pages, per_room, pool, rng, repeat))
            finally:
                src_pools.close()
                dst_pools.close()
        out["bytes_by_path"] = lc.bytes_by_path()
        if case == "nixl":
            tables = ucx_tables(lc.agents[lc.agent_of(P)].log_path.read_text("utf-8", "replace"))
            out["ucx_gpu_write_protocols"] = [f"{head}: {'; '.join(rows)}" for head, rows in tables]
    return out


# ---------------------------------------------------------------------------------------- raw NIXL
def send_msg(doc: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(doc) + "\n")
    sys.stdout.flush()


def receiver_main(mode: str) -> None:
    """The receiving process of a raw pair: one NIXL agent, one buffer registered (its own, or the
    sender's opened by CUDA IPC in ``imported`` mode), then it waits to be told to stop."""
    import torch
    from nixl._api import nixl_agent

    from pdfabric_agent.memory import cuda, ipc
    from pdfabric_agent.memory.pools import DeviceBuffer

    msg = json.loads(sys.stdin.readline())
    size = int(msg["size"])
    cuda.primary_context(0)
    torch.zeros(1, device="cuda:0")
    agent = waiting_agent(nixl_agent, f"raw-recv-{os.getpid()}-{mode}")
    own: list[int] = []
    maps = ipc.PeerMappings(0)
    extra: dict[str, Any] = {}
    if mode == "imported":
        dst = maps.map(ipc.PoolExport.from_json(msg["dst_export"]))
        src = cuda.mem_alloc(size)  # the sender's source, allocated here and opened there
        own.append(src)
        t = torch.as_tensor(DeviceBuffer(src, size), device="cuda:0")
        t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize()
        extra["src_export"] = dict(ipc.export_pool(src, size, 0).to_json())
    else:
        dst = cuda.mem_alloc(size)
        own.append(dst)
        torch.as_tensor(DeviceBuffer(dst, size), device="cuda:0").fill_(0)
        torch.cuda.synchronize()
        extra["dst_export"] = dict(ipc.export_pool(dst, size, 0).to_json())
    error = ""
    try:
        agent.register_memory(agent.get_reg_descs([(dst, size, 0, "dst")], "VRAM"))
    except Exception as exc:  # what UCX/NIXL say about memory it did not allocate
        error = repr(exc)
    send_msg({"metadata": base64.b64encode(bytes(agent.get_agent_metadata())).decode(), "addr": dst,
              "register_error": error, "pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid"), **extra})  # fmt: skip
    sys.stdin.readline()  # stop
    del agent
    maps.close()
    torch.cuda.synchronize()
    for ptr in own:
        cuda.mem_free(ptr)
    send_msg({"stopped": True})


class RawPair:
    """This process's NIXL agent writing into a receiver process's registered buffer."""

    count = 0

    def __init__(self, mode: str, size: int) -> None:
        import torch
        from nixl._api import nixl_agent

        from pdfabric_agent.memory import cuda, ipc
        from pdfabric_agent.memory.pools import DeviceBuffer

        self.mode, self.size = mode, size
        self.maps = ipc.PeerMappings(0)
        self.own: list[int] = []
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        prefix = ["unshare", "--pid", "--fork", "--kill-child"] if mode == "pidns" else []
        argv = [*prefix, sys.executable, os.path.abspath(__file__), "--receiver", mode]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        cuda.primary_context(0)
        msg: dict[str, Any] = {"size": size}
        if mode == "imported":
            self.dst_own = cuda.mem_alloc(size)  # the receiver's destination, allocated here
            self.own.append(self.dst_own)
            torch.as_tensor(DeviceBuffer(self.dst_own, size), device="cuda:0").fill_(0)
            torch.cuda.synchronize()
            msg["dst_export"] = dict(ipc.export_pool(self.dst_own, size, 0).to_json())
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        answer = self.answers.get(timeout=45)
        self.receiver = answer
        RawPair.count += 1
        self.agent = waiting_agent(nixl_agent, f"raw-send-{os.getpid()}-{mode}-{RawPair.count}")
        if mode == "imported":
            self.src = self.maps.map(ipc.PoolExport.from_json(answer["src_export"]))
            self.src_view = torch.as_tensor(DeviceBuffer(self.src, size), device="cuda:0")
            self.dst_view = torch.as_tensor(DeviceBuffer(self.dst_own, size), device="cuda:0")
        else:
            self.src = cuda.mem_alloc(size)
            self.own.append(self.src)
            self.src_view = torch.as_tensor(DeviceBuffer(self.src, size), device="cuda:0")
            self.src_view.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0"))
            torch.cuda.synchronize()
            self.dst_view = None
            try:  # to check what landed: the receiver's buffer opened here
                ptr = self.maps.map(ipc.PoolExport.from_json(answer["dst_export"]))
                self.dst_view = torch.as_tensor(DeviceBuffer(ptr, size), device="cuda:0")
            except Exception as exc:
                self.receiver["check_error"] = repr(exc)
        self.register_error = ""
        try:
            self.agent.register_memory(self.agent.get_reg_descs([(self.src, size, 0, "src")], "VRAM"))
        except Exception as exc:
            self.register_error = repr(exc)
        self.remote = self.agent.add_remote_agent(base64.b64decode(answer["metadata"]))
        self.dst = int(answer["addr"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK) :]))
            else:
                print(f"[receiver {self.mode}] {line}", end="", flush=True)

    def write(self, blocks: list[tuple[int, int, int]], deadline_s: float = 60.0) -> float:
        """Every block (src offset, dst offset, length) written; seconds from the first post to the
        last DONE."""
        agent = self.agent
        start = time.perf_counter()
        handles = []
        for i in range(0, len(blocks), BATCH):
            chunk = blocks[i : i + BATCH]
            local = agent.get_xfer_descs([(self.src + s, n, 0) for s, _, n in chunk], "VRAM")
            remote = agent.get_xfer_descs([(self.dst + d, n, 0) for _, d, n in chunk], "VRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("raw NIXL transfer failed when posted")
            handles.append(handle)
        end = time.monotonic() + deadline_s
        while handles:
            still = []
            for handle in handles:
                state = agent.check_xfer_state(handle)
                if state == "PROC" and time.monotonic() < end:
                    still.append(handle)
                    continue
                agent.release_xfer_handle(handle)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL transfer ended {state}")
            handles = still
            if handles:
                time.sleep(20e-6)
        return time.perf_counter() - start

    def landed(self, blocks: list[tuple[int, int, int]]) -> bool | None:
        """Every block's bytes at the destination equal its source's; None: not checkable here."""
        import torch

        if self.dst_view is None:
            return None
        torch.cuda.synchronize()
        return all(torch.equal(self.dst_view[d : d + n], self.src_view[s : s + n]) for s, d, n in blocks)

    def landed_pages(self, page: int, pool: int, sp: list[int], dp: list[int]) -> bool | None:
        """``landed`` for a room of ``room_blocks``, compared page-wise on the GPU."""
        import torch

        if self.dst_view is None:
            return None
        torch.cuda.synchronize()
        src, dst = (v.view(LAYERS * 2, pool, page) for v in (self.src_view, self.dst_view))
        return bool((dst[:, dp] == src[:, sp]).all())

    def close(self) -> None:
        import torch

        from pdfabric_agent.memory import cuda

        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(self.remote)
        del self.agent
        self.src_view = self.dst_view = None
        self.maps.close()
        torch.cuda.synchronize()
        for ptr in self.own:
            cuda.mem_free(ptr)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def room_blocks(page: int, pool: int, sp: list[int], dp: list[int]) -> list[tuple[int, int, int]]:
    """The agent's blocks of one room over pools laid out [layer][K/V][page]."""
    return [
        ((b * pool + s) * page, (b * pool + d) * page, page)
        for b in range(LAYERS * 2)
        for s, d in zip(sp, dp, strict=True)
    ]


def raw_case(page: int, rng: random.Random, repeat: int) -> dict[str, Any]:
    _, per_room, pool = geometry(page)
    pair = RawPair("own", LAYERS * 2 * pool * page)
    try:
        times = []
        for k in range(repeat + 1):
            sp, dp = rng.sample(range(pool), per_room), rng.sample(range(pool), per_room)
            dt = pair.write(room_blocks(page, pool, sp, dp))
            if pair.landed_pages(page, pool, sp, dp) is False:
                raise RuntimeError("raw NIXL: a block differs on arrival")
            if k:
                times.append(dt)
        return {"total_s": times}
    finally:
        pair.close()


def probe(mode: str) -> dict[str, Any]:
    """One raw pair in ``mode``: registrations, one 8 MiB room of 1 MiB blocks, what landed."""
    log(f"== raw NIXL probe {mode}: UCX's protocol tables for it follow")
    page, pool = 1 << 20, 16
    out: dict[str, Any] = {"mode": mode}
    pair = None
    try:
        pair = RawPair(mode, pool * page)
        out.update(sender_register_error=pair.register_error, receiver_register_error=pair.receiver["register_error"],
                   receiver_pidns=pair.receiver["pidns"], sender_pidns=os.readlink("/proc/self/ns/pid"),
                   check_error=pair.receiver.get("check_error", ""))  # fmt: skip
        blocks = [(s * page, d * page, page) for s, d in zip(range(0, 16, 2), range(15, 0, -2), strict=True)]
        try:
            out["write_s"] = pair.write(blocks, deadline_s=30)
            out["byte_exact"] = pair.landed(blocks)
        except Exception as exc:
            out["write_error"] = repr(exc)
    except Exception as exc:
        out["error"] = repr(exc)
    finally:
        if pair is not None:
            with contextlib.suppress(Exception):
                pair.close()
    log(f"== raw NIXL probe {mode}: {json.dumps(out)}")
    return out


def ucx_version() -> str:
    """The version of the UCX this process loaded (NIXL's bundled one), read from the library."""
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if "libucp" in line and "/" in line}
    for path in paths:
        with contextlib.suppress(OSError, AttributeError):
            fn = ctypes.CDLL(path).ucp_get_version_string
            fn.restype = ctypes.c_char_p
            return f"{fn().decode()} ({os.path.basename(path)})"
    return "unknown"


def copy_ceiling() -> float:
    """One process's device-to-device copy of 1 GiB on cuda:0, GB/s of bytes copied (not read + written)."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return (1 << 30) / statistics.median(times) / 1e9


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-kib", type=int, nargs="+", default=[4, 64, 1024, 4096])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--no-probes", action="store_true")
    ap.add_argument("--receiver", choices=("own", "imported", "pidns"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        receiver_main("own" if args.receiver == "pidns" else args.receiver)
        return
    import torch

    # This process's raw NIXL agents and the receivers run UCX as the agents' backend sets it up.
    os.environ.update(ucx_env(Transport.NVLINK_INTRA, "127.0.0.1"))
    os.environ["UCX_PROTO_INFO"] = "y"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "ucx_env": ucx_env(Transport.NVLINK_INTRA, "127.0.0.1"),
    }
    report["copy_ceiling_gbps"] = copy_ceiling()
    log(f"== {report['device']}; one-process device copy of 1 GiB: {report['copy_ceiling_gbps']:.0f} GB/s")
    rows = []
    for kib in args.page_kib:
        page = kib << 10
        _, per_room, _ = geometry(page)
        row: dict[str, Any] = {"page": page, "blocks": LAYERS * 2 * per_room, "room_bytes": room_bytes(page)}
        log(f"== {kib} KiB pages: {row['blocks']} blocks, {row['room_bytes'] >> 20} MiB a room")
        try:
            row["raw"] = raw_case(page, rng, args.repeat)
        except Exception as exc:
            row["raw"] = {"error": repr(exc)}
        log(f"   raw: {json.dumps(row['raw'])[:600]}")
        for case in args.cases:
            try:
                row[case] = agent_case(case, page, rng, args.repeat)
            except Exception as exc:
                row[case] = {"error": repr(exc)}
            log(f"   {case}: {json.dumps(row[case])[:600]}")
        for key in ("raw", *args.cases):
            for what in ("total", "write"):
                if f"{what}_s" in row[key]:
                    row[key][f"{what}_gbps"] = row["room_bytes"] / statistics.median(row[key][f"{what}_s"]) / 1e9
        rows.append(row)
    report["rows"] = rows
    report["ucx_version"] = ucx_version()  # loaded with this process's first NIXL agent
    log(f"== UCX {report['ucx_version']}")
    dump(report, args)  # before the probes: the table survives a timeout there
    if not args.no_probes:
        report["probes"] = [probe(mode) for mode in ("own", "imported", "pidns")]
        dump(report, args)


def dump(report: dict[str, Any], args: argparse.Namespace) -> None:
    table = render(report, args.cases, args.repeat)
    log(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "nixl_gpu_bench.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(out, "nixl_gpu_bench.json"), "w") as fh:
            json.dump(report, fh, indent=1)


def render(report: dict[str, Any], cases: list[str], repeat: int) -> str:
    def gbps(cell: dict[str, Any], what: str = "total") -> str:
        return f"{cell[f'{what}_gbps']:.2f}" if f"{what}_gbps" in cell else "failed"

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
        return f"{a['total_gbps'] / b['total_gbps']:.2f}" if "total_gbps" in a and "total_gbps" in b else "-"

    head = ["page", "blocks/room", "MiB/room", "raw NIXL GB/s", "pdfabric on NIXL GB/s (write phase)"]
    head += [f"{LABELS[c]} GB/s" for c in cases if c != "nixl"]
    head += ["NIXL agent / raw NIXL", *(f"NIXL agent / {LABELS[c]}" for c in cases if c != "nixl")]
    lines = [f"GPU memory between two processes on one {report['device']}, medians of {repeat} rooms "
             f"(device copy ceiling {report['copy_ceiling_gbps']:.0f} GB/s)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in report["rows"]:
        nixl = r.get("nixl", {})
        cells = [f"{r['page'] >> 10} KiB", str(r["blocks"]), str(r["room_bytes"] >> 20), gbps(r["raw"])]
        cells.append(f"{gbps(nixl)} ({gbps(nixl, 'write')})" if "nixl" in cases else "-")
        cells += [gbps(r[c]) for c in cases if c != "nixl"]
        cells += [ratio(nixl, r["raw"]), *(ratio(nixl, r[c]) for c in cases if c != "nixl")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
