"""The cost of spec.transfer.verify: the same rooms through real agents with and without end-to-end
checksums, measured in the same run (loopback tcp, CPU pools; the GPU path sums on the device).

Run: ``python benchmarks/bench_verify.py [--repeat 5]``. Each room is timed by the client from
``send`` to the decode room's Success (with verify, that includes the sender's sum and the
receiver's sum of every byte). Two cores are shared by everything here: read the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]
os.environ.setdefault("MC_FORCE_TCP", "1")

from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.transfer import scattered_pages  # noqa: E402

P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


def spec(page_kib: int, verify: bool) -> dict[str, Any]:
    model = {"layers": 2, "kvHeads": 8, "headDim": 128, "pageSizeTokens": page_kib // 2, "auxRowBytes": [8]}
    return {
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": {"transport": "tcp", "timeoutSeconds": 60, "verify": verify},
        "model": model,
    }


def rooms(lc: LocalFabric, pages: int, repeat: int, first_room: int) -> list[float]:
    src = scattered_pages(pages, lc.kv_pages)
    times = []
    for i in range(repeat + 1):  # the first room warms the engines' sessions up
        room = first_room + i
        lc.client(D).receive(D, room, src)
        start = time.perf_counter()
        lc.client(P).send(P, room, src)
        view = lc.client(D).wait(D, room, 60)
        if not view.succeeded:
            raise RuntimeError(f"room {room}: {view.state.title} {view.reason}")
        if i:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    env = {"PDFABRIC_KV_PAGES": "640"}
    print("| page | pages/room | MiB/room | plain ms | verify ms | verify / plain time | verify GB/s |")
    print("|---|---|---|---|---|---|---|")
    for page_kib, pages in ((16, 128), (64, 128), (64, 384)):
        result = {}
        for verify in (False, True):
            with LocalFabric(spec(page_kib, verify), env=env) as lc:
                result[verify] = statistics.median(rooms(lc, pages, args.repeat, 1))
        mib = pages * page_kib * 2 * 2 / 1024  # pages x K/V x 2 layers
        plain, checked = result[False], result[True]
        print(
            f"| {page_kib} KiB | {pages} | {mib:.0f} | {plain * 1e3:.1f} | {checked * 1e3:.1f} | "
            f"{checked / plain:.2f} | {mib / 1024 / checked:.2f} |"
        )


if __name__ == "__main__":
    main()
