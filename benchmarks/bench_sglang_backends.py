"""pdfabric against SGLang's own backends (the controls), all driven by the same SGLang code:
SGLang's disaggregation queues and scheduler methods from the installed sglang package, with each
backend's manager, sender and receiver from SGLang's ``get_kv_class`` (pdfabric's through its
plugin, with real agents of a LocalFabric; Mooncake's transfer engine and NIXL's UCX on loopback
tcp). Issue 23; NIXL, issue 43: pdfabric's agents on NIXL (``pdfabric-nixl``) against SGLang's own
NIXL backend, as pdfabric on Mooncake against SGLang's Mooncake (``PAIRS``).

    python benchmarks/bench_sglang_backends.py [--repeat 7] [--compute-ms 50] [--json OUT]

(a) Exposed transfer: from the prefill scheduler's last ``send_kv_chunk`` (the last chunk handed
    to the sender) until decode's ``DecodeTransferQueue.pop_transferred`` returns the request (its
    receiver polled Success and the metadata row is in). Requests of 32 MiB of KV (8 layers, 8 KV
    heads of 128, float32, 512 tokens in 32 pages of 16): in 4 chunks of 128 tokens, in 1 chunk,
    and a cached-prefix request (448 tokens already computed, sent early by SGLang's
    ``maybe_send_cached_prefix_chunk`` under SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=1, then
    one new chunk of 64). Between chunks, and before the cached request's new chunk, the scheduler
    loop runs ``--compute-ms`` of iterations (polling both sides every 0.5 ms) in place of the
    chunk's forward. Target: pdfabric at or below the control of its library.
(b) Backend time per scheduler iteration, N requests in flight (tiny KV): the polls SGLang's queues
    make each iteration over every queued request (``poll_and_all_reduce*``): prefill's bootstrap
    queue (decode not yet announced), the inflight queue's poll over senders whose decode is ready
    and whose KV is not yet handed over (SGLang queues a request there with its last chunk; this
    is the state a transfer cannot finish in before the poll is timed), and decode's transfer queue
    (destinations sent, waiting for KV). Target: pdfabric at most 2x its control.
Every request of both parts is checked byte-exact at decode (KV pages and the first token of the
metadata row). Both ranks of a backend run in this one process (each Mooncake rank with its own
transfer engine); two shared cores: read ratios, not microseconds. The backends' requests of (a) are
interleaved (each repetition runs each case on both, who goes first alternating) so that a slow spell
of the machine falls on both; (b) runs one backend after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "1"  # SGLang's early send of a radix hit

from sglang.srt.disaggregation.base.conn import KVPoll

from benchmarks.sglang_queues import backend_pair, fill, same_bytes, wait_until

BACKENDS = ("mooncake", "pdfabric", "nixl", "pdfabric-nixl")
PAIRS = (("mooncake", "pdfabric"), ("nixl", "pdfabric-nixl"))  # (SGLang's own, pdfabric over the same library)
BIG = {"layers": 8, "heads": 8, "head_dim": 128, "page": 16, "pages": 72, "max_tokens": 1024}
TINY = {"layers": 2, "heads": 2, "head_dim": 16, "page": 16, "pages": 600, "max_tokens": 64}
TOKENS, CACHED = 512, 448
CASES = {"4-chunk": (4, 0), "1-chunk": (1, 0), "cached-prefix": (1, CACHED)}


class Loop:
    """Both schedulers' iterations: prefill's inflight poll and decode's pop_transferred."""

    def __init__(self, pre: Any, dec: Any) -> None:
        self.pre, self.dec = pre, dec
        self.transferred: dict[int, float] = {}  # room -> when decode popped it
        self.sent: dict[int, int] = {}  # room -> prefill's final poll

    def step(self) -> None:
        for req, poll in zip(list(self.pre.inflight), self.pre.poll_inflight(), strict=True):
            if poll in (KVPoll.Success, KVPoll.Failed) and req.bootstrap_room not in self.sent:
                self.sent[req.bootstrap_room] = poll
        now = time.perf_counter()
        for req in self.dec.pop_transferred():
            self.transferred[req.bootstrap_room] = now

    def run_for(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.step()
            time.sleep(0.0005)


def bootstrap(pre: Any, dec: Any, rooms: list[int], tokens: int) -> tuple[list[Any], list[Any]]:
    """Decode and prefill take the requests; SGLang's queues run until prefill popped them
    bootstrapped (senders ``init``ed) and decode sent their destinations."""
    ds = [dec.add(room, tokens) for room in rooms]
    rs = [pre.add(room, tokens) for room in rooms]
    popped: list[Any] = []

    def step() -> None:
        popped.extend(pre.pop_bootstrapped())
        dec.step_prealloc()

    wait_until(
        "bootstrap", lambda: len(popped) == len(rs) and not dec.prealloc.queue and not dec.prealloc.pending_reqs, step
    )
    return rs, ds


def settle(loop: Loop, rs: list[Any], ds: list[Any]) -> list[str]:
    """Both sides concluded: check decode's bytes and first token, free the requests."""
    rooms = [r.bootstrap_room for r in rs]
    wait_until("transfer", lambda: all(x in loop.transferred and x in loop.sent for x in rooms), loop.step, 120)
    errors = []
    for r, d in zip(rs, ds, strict=True):
        if loop.sent[r.bootstrap_room] != KVPoll.Success:
            errors.append(f"room {r.bootstrap_room}: prefill poll {loop.sent[r.bootstrap_room]}")
        if not same_bytes(loop.pre.rank, r.bench_pages, loop.dec.rank, d.req.bench_pages):
            errors.append(f"room {r.bootstrap_room}: KV differs at decode")
        if list(d.req.output_ids)[-1:] != r.output_ids:
            errors.append(f"room {r.bootstrap_room}: first token {list(d.req.output_ids)} != {r.output_ids}")
        loop.pre.finish(r)
        loop.dec.release(d.req)
    return errors


def exposed(
    pre: Any, dec: Any, room: int, chunks: int, cached: int, compute_s: float, tokens: int
) -> tuple[float, list[str]]:
    (r,), (d,) = bootstrap(pre, dec, [room], tokens)
    fill(pre.rank, r.bench_pages, room)
    loop = Loop(pre, dec)
    start = 0
    if cached:
        pre.cached_prefix(r, cached)  # before the new chunk's forward
        start = cached
    ends = [start + (tokens - start) * (i + 1) // chunks for i in range(chunks)]
    t0 = 0.0
    for i, end in enumerate(ends):
        loop.run_for(compute_s)  # the chunk's forward
        last = i == chunks - 1
        if last:
            t0 = time.perf_counter()
        pre.chunk(r, end, last)
    errors = settle(loop, [r], [d])
    return loop.transferred[room] - t0, errors


def iteration_costs(pre: Any, dec: Any, n: int, repeat: int, first_room: int) -> tuple[dict[str, float], list[str]]:
    """Median seconds of each queue's per-iteration poll over ``n`` requests in flight."""
    from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

    def median_s(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            time.sleep(0.001)
        return statistics.median(times)

    rooms = list(range(first_room, first_room + n))
    rs = [pre.add(room, 32) for room in rooms]
    group = pre.attn_tp_cpu_group
    senders = [r.disagg_kv_sender for r in rs]
    out = {"prefill bootstrap queue": median_s(lambda: poll_and_all_reduce_attn_cp_tp_group(senders, group, group))}
    ds = [dec.add(room, 32) for room in rooms]
    popped: list[Any] = []

    def step() -> None:
        popped.extend(pre.pop_bootstrapped())
        dec.step_prealloc()

    wait_until("bootstrap", lambda: len(popped) == n and not dec.prealloc.queue and not dec.prealloc.pending_reqs, step)
    pre.inflight.extend(rs)  # as after their forward, KV not yet handed over (WaitingForInput)
    out["prefill inflight, not sent"] = median_s(pre.poll_inflight)
    out["decode transfer queue"] = median_s(dec.poll_transfer)
    pre.inflight.clear()
    for r in rs:
        fill(pre.rank, r.bench_pages, r.bootstrap_room)
        pre.chunk(r, 32, True)
    return out, settle(Loop(pre, dec), rs, ds)


def measure_exposed(backends: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """(a) for every backend, their requests interleaved: each repetition runs each case on every
    backend in turn (who goes first alternates), so a slow spell of the machine falls on both."""
    big = dict(BIG, pages=args.tokens // 16 * 2 + 8)
    res: dict[str, dict[str, Any]] = {b: {"exposed_s": {}, "exposed_all_s": {}, "errors": []} for b in backends}
    room = 1000
    with contextlib.ExitStack() as stack:
        pairs = {b: stack.enter_context(backend_pair(b, big)) for b in backends}
        cases = {k: v for k, v in CASES.items() if k in args.cases}
        for rep in range(args.repeat):
            for case, (chunks, cached) in cases.items():
                cached = min(cached, args.tokens * 7 // 8 // 16 * 16)
                for backend in backends if rep % 2 == 0 else backends[::-1]:
                    room += 1
                    pre, dec = pairs[backend]
                    took, errors = exposed(pre, dec, room, chunks, cached, args.compute_ms / 1e3, args.tokens)
                    res[backend]["exposed_all_s"].setdefault(case, []).append(took)
                    res[backend]["errors"] += [f"{case}: {e}" for e in errors]
    for r in res.values():
        r["exposed_s"] = {k: statistics.median(v) for k, v in r["exposed_all_s"].items()}
    return res


def measure(backend: str, args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """(b) for one backend, into its results of (a)."""
    res["iteration_s"] = {}
    with backend_pair(backend, dict(TINY, pages=max(args.inflight) * 2 + 8)) as (pre, dec):
        for n in args.inflight:
            costs, errors = iteration_costs(pre, dec, n, args.poll_repeat, 100_000 + n * 1000)
            res["iteration_s"][str(n)] = costs
            res["errors"] += [f"{n} in flight: {e}" for e in errors]
    return res


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    mib = args.tokens * BIG["layers"] * 2 * BIG["heads"] * BIG["head_dim"] * 4 / 2**20
    lines = []
    for control, ours in PAIRS:
        if control in results and ours in results:
            lines += pair_table(control, ours, results[control], results[ours], args, mib)
    for name, res in results.items():
        lines.append(
            f"{name}: {'every request byte-exact' if not res['errors'] else 'ERRORS: ' + '; '.join(res['errors'][:5])}"
        )
    return "\n".join(lines)


def pair_table(
    control: str, ours: str, mc: dict[str, Any], pf: dict[str, Any], args: argparse.Namespace, mib: float
) -> list[str]:
    a_name, b_name = f"SGLang {control}", ours
    lines = [
        f"(a) exposed transfer after the last chunk, median of {args.repeat} ({mib:.0f} MiB of KV a request, "
        f"{args.compute_ms:g} ms of scheduler iterations per chunk's forward; the backends' requests "
        f"interleaved); target {b_name} <= {a_name}",
        f"{'request':<16}{a_name:>15}{b_name:>15}{'ratio':>8}  verdict   "
        f"(min {a_name} / {b_name}; median of the paired ratios)",
    ]
    for case in mc["exposed_s"]:
        a, b = mc["exposed_s"][case], pf["exposed_s"][case]
        pairs = zip(mc["exposed_all_s"][case], pf["exposed_all_s"][case], strict=True)
        paired = statistics.median(y / x for x, y in pairs)
        lo = f"({min(mc['exposed_all_s'][case]) * 1e3:.1f} / {min(pf['exposed_all_s'][case]) * 1e3:.1f} ms; {paired:.2f}x)"
        lines.append(
            f"{case:<16}{a * 1e3:>12.1f} ms{b * 1e3:>12.1f} ms{b / a:>7.2f}x  {'PASS' if b <= a else 'FAIL'}      {lo}"
        )
    lines += [
        "",
        f"(b) backend time per scheduler iteration (median of {args.poll_repeat}); target {b_name} <= 2x {a_name}",
        f"{'in flight':<10}{'queue':<26}{a_name:>15}{b_name:>15}{'ratio':>8}  verdict",
    ]
    for n, costs in mc["iteration_s"].items():
        total_a = total_b = 0.0
        for queue, a in costs.items():
            b = pf["iteration_s"][n][queue]
            total_a, total_b = total_a + a, total_b + b
            lines.append(
                f"{n:<10}{queue:<26}{a * 1e6:>12.0f} us{b * 1e6:>12.0f} us{b / a:>7.1f}x  {'PASS' if b <= 2 * a else 'FAIL'}"
            )
        verdict = "PASS" if total_b <= 2 * total_a else "FAIL"
        lines.append(
            f"{n:<10}{'sum of the three':<26}{total_a * 1e6:>12.0f} us{total_b * 1e6:>12.0f} us{total_b / total_a:>7.1f}x  {verdict}"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--tokens", type=int, default=TOKENS)  # a request's tokens for (a), 64 KiB of KV each
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--inflight", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--poll-repeat", type=int, default=50)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    exposed_res = measure_exposed(list(args.backends), args)
    results = {b: measure(b, args, exposed_res[b]) for b in args.backends}
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    print(table(results, args))
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    rc = main()
    # SGLang's KV managers start threads that nothing of theirs ends (its servers end them with the
    # process): with several backends' managers made here, the interpreter's exit waited on one of
    # them for good. Everything is printed and written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
