"""The transfer a chunked prefill leaves exposed on the time to first token (issue 23), through
the agent API: real agent processes, the agents' own pools, the engine's calls as SGLang's
pdfabric sender makes them (``SendChunk`` per chunk, ``POST /v1/send/chunk``).

Exposed transfer: from the moment the last chunk is handed to the agent until the decode room's
Success (the decode agent's own view: what a decode engine waits for). Four ways a request goes,
each timed in the same run:

- ``gathered``: the request's pages handed in one send after the last forward (what the plugin
  did before chunks streamed: the whole room moves after the last chunk). The baseline.
- ``streamed``: the same pages in ``--chunks`` chunks, one after each forward; the agent moves
  each at once, so after the last forward only the last chunk is left.
- ``one-chunk``: a request of a single chunk (the same pages): nothing to overlap.
- ``cached-prefix``: a radix-cache hit of ``--cached`` of the request sent before the forward
  (SGLang's early cached-prefix send), then one forward and the new pages as the final chunk.

Between chunks the script sleeps ``--forward-ms`` in place of a chunk's forward (longer than a
chunk's transfer, as a prefill forward of thousands of tokens is). Geometry: a 70B-class TP2 rank
(80 layers, 4 KV heads of 128, bf16, 16-token pages: 16 KiB a page per layer and K or V),
``--tokens`` tokens. Both agents on one GPU (prefill and decode in two processes: CUDA IPC and
the kernels), INTRA_NODE_NVLINK; ``--transport tcp`` runs the same on host memory (a smoke run
on a CPU machine, small ``--tokens``).

Run on the GPU machine from the repo root: python3 benchmarks/gpu/chunk_exposed.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]

from pdfabric_agent.client.api import AgentRefused  # noqa: E402
from pdfabric_agent.protocol.chunks import SendChunk  # noqa: E402
from pdfabric_agent.protocol.views import RoomState  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 80, 4, 128, 16
PREFILL, DECODE = "prefill-0-tp0-cp0", "decode-0-tp0"


def spec(transport: str, layers: int) -> dict:
    transfer = {"timeoutSeconds": 60}
    transfer |= {"memPool": "INTRA_NODE_NVLINK", "transport": "nvlink-intra"} if transport != "tcp" else {}
    return {
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": transfer,
        "model": {"layers": layers, "kvHeads": HEADS, "headDim": HEAD_DIM, "pageSizeTokens": PAGE_TOKENS},
    }


def announce(lc: LocalFabric, room: int, dst: list[int]) -> None:
    """Decode bootstraps first, as in serving: its room info reaches the prefill agent."""
    lc.client(DECODE).receive(DECODE, room, dst)
    deadline = time.monotonic() + 10
    while True:
        try:
            if lc.client(PREFILL).poll(PREFILL, room).state is RoomState.WAITING_FOR_INPUT:
                return
        except AgentRefused:  # 404 until decode's room info arrived
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"room {room}: decode's room info did not reach the prefill agent")
        time.sleep(0.001)


def run_request(lc: LocalFabric, room: int, src: list[int], dst: list[int], cuts: list[int], forward_s: float,
                early: bool) -> tuple[float, dict[str, float]]:  # fmt: skip
    """Hand ``src`` in chunks ending at ``cuts``, a forward's sleep before each (none before the
    first when ``early``: a cached prefix sent before the forward); seconds from the last chunk
    handed over until the decode room's Success, and where the time after that hand-over went:
    each room phase of both agents (their node-wide monotonic clock, which this process shares)
    after the hand-over, the phase's name without its rank (``launched``, ``notified``,
    ``arrived``...), with ``answered`` (the last chunk's call returned) and ``seen`` (decode's
    Success read here)."""
    announce(lc, room, dst)
    prefill = lc.client(PREFILL)
    start = 0
    answered = 0.0
    for i, end in enumerate(cuts):
        if i or not early:
            time.sleep(forward_s)
        final = end == len(src)
        handed = time.monotonic()
        prefill.submit(SendChunk(PREFILL, room, src[start:end], [], None, 0, page_offset=start, final=final))
        answered = time.monotonic()
        start = end
    view = lc.client(DECODE).wait(DECODE, room, 120)
    seen = time.monotonic()
    exposed = seen - handed
    sent = prefill.wait(PREFILL, room, 30)
    for v in (view, sent):
        if not v.succeeded:
            raise RuntimeError(f"room {room}: {v.rank} {v.state.title} {v.reason}")
    if view.moved != sent.moved:
        raise RuntimeError(f"room {room}: decode counted {view.moved}, prefill sent {sent.moved}")
    phases = {"answered": answered - handed, "seen": exposed}
    for side, v in (("prefill", sent), ("decode", view)):
        for name, at in v.phases_s.items():
            when = (v.submitted_at or 0.0) + at - handed
            if when >= 0:  # what happened after the last chunk was handed over
                phases[f"{side} {name.split(':')[0]}"] = when
    return exposed, phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="nvlink-intra", choices=("nvlink-intra", "tcp"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--cached", type=float, default=0.875, help="share of the request already cached")
    ap.add_argument("--forward-ms", type=float, default=100.0)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    pages = args.tokens // PAGE_TOKENS
    pool = pages * 2 + 8
    lc = LocalFabric(spec(args.transport, args.layers), env={"PDFABRIC_KV_PAGES": str(pool)}, decode_gpu=0)
    nbytes = args.layers * 2 * pages * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    step = pages // args.chunks
    cached = int(pages * args.cached)
    cases = {
        "gathered": ([pages], False, args.chunks),
        "streamed": ([step * (i + 1) for i in range(args.chunks - 1)] + [pages], False, 1),
        "one-chunk": ([pages], False, 1),
        "cached-prefix": ([cached, pages], True, 1),
    }
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    times: dict[str, list[float]] = {name: [] for name in cases}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    room = 0
    try:
        lc.start(wait_s=120)
        for rep in range(args.repeat + 1):
            for name, (cuts, early, forwards) in cases.items():
                src, dst = rng.sample(range(pool), pages), rng.sample(range(pool), pages)
                # "gathered" sleeps every chunk's forward before its one send
                exposed, when = run_request(lc, room, src, dst, cuts, args.forward_ms / 1e3 * forwards, early)
                room += 1
                if rep:  # the first round warms sessions and mappings
                    times[name].append(exposed)
                    for phase, t in when.items():
                        phases[name].setdefault(phase, []).append(t)
        paths = {p: lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", path=p)
                 for p in ("nvlink-kernel", "mooncake")}  # fmt: skip
    except Exception:
        for name in lc.agents:
            print(f"--- {name} log ---\n{lc.log(name)[-4000:]}", flush=True)
        raise
    finally:
        lc.close()
    base = statistics.median(times["gathered"])
    print(f"exposed transfer after the last chunk is handed over: {nbytes / 1e9:.3f} GB a request "
          f"({args.tokens} tokens, {pages} scattered pages of {args.layers} layers), {args.chunks} chunks, "
          f"{args.forward_ms:g} ms a forward, {args.transport}, median of {args.repeat}")  # fmt: skip
    print(f"{'request':<15}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'vs gathered':>13}")
    result: dict = {"bytes": nbytes, "args": vars(args), "bytes_by_path": paths, "cases": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<15}{med * 1e3:>11.2f}{min(ts) * 1e3:>9.2f}{max(ts) * 1e3:>9.2f}{med / base:>12.2f}x")
        result["cases"][name] = {"median_ms": med * 1e3, "all_ms": [t * 1e3 for t in ts]}
    print(f"bytes by path (prefill agent): {json.dumps(paths)}")
    print("after the last chunk was handed over (ms, median; phases seen in every repeat, in order):")
    for name, by_phase in phases.items():
        meds = {k: statistics.median(v) * 1e3 for k, v in by_phase.items() if len(v) == len(times[name])}
        print(f"  {name:<14}" + ", ".join(f"{k} {t:.2f}" for k, t in sorted(meds.items(), key=lambda kv: kv[1])))
        result["cases"][name]["phases_ms"] = meds
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
