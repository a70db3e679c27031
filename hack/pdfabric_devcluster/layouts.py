"""The agent alone, on six layouts: real agent processes (loopback tcp), one room each, every
byte verified on arrival, the byte counters against the synthetic engine's own count.

Run: ``PYTHONPATH=core:agent:hack python -m pdfabric_devcluster.layouts [case ...] [--pages N]``
"""

from __future__ import annotations

import sys
from typing import Any

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import expected_bytes
from pdfabric_devcluster.transfer import transfer_room

DEMO_MODEL = {
    "layers": 4,
    "kvHeads": 8,
    "headDim": 64,
    "pageSizeTokens": 16,
    "stateBytesPerRequest": 4096,
    "stateLayers": 4,
    "auxRowBytes": [16, 8, 8, 8, 128],
}
DEMO_CASES: dict[str, dict[str, Any]] = {
    "equal-tp2": {"prefill": {"tp": 2}, "decode": {"tp": 2}},
    "prefill-tp2-decode-tp4": {"prefill": {"tp": 2}, "decode": {"tp": 4}},
    "prefill-tp4-decode-tp2": {"prefill": {"tp": 4}, "decode": {"tp": 2}},
    "prefill-cp4-all-ranks": {"prefill": {"cp": 4, "allCpRanksTransfer": True}, "decode": {}},
    "prefill-cp4-layer-split": {"prefill": {"cp": 4, "dsaCacheLayerSplit": True}, "decode": {}},
    "prefill-pp2-decode-pp1": {"prefill": {"pp": 2}, "decode": {}},
}


def demo(cases: list[str], pages: int) -> int:
    """Each case: real agents, one room, every byte verified, counters against the synthetic count."""
    failed = 0
    print(f"{'case':26} {'verified':9} {'kv bytes':>10} {'state':>7} {'aux':>5} {'dedup saved':>12} {'ms':>7}")
    for name in cases:
        raw = {**DEMO_CASES[name], "transfer": {"transport": "tcp"}, "model": DEMO_MODEL}
        with LocalFabric(raw) as lc:
            result = transfer_room(lc, 1, pages=pages, state_slots=1)
            want = expected_bytes(lc.spec, pages=pages, state_slots=1, aux=True)
            got = {
                k: lc.metric_sum("pdfabric_transfer_bytes_total", role="prefill", kind=k)
                for k in ("kv", "state", "aux")
            }
            saved = lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total")
            ok = not any(result.errors.values()) and got == {"kv": want.kv, "state": want.state, "aux": want.aux}
            ok = ok and saved == want.state_skipped
            failed += not ok
            print(
                f"{name:26} {'yes' if ok else 'NO':9} {int(got['kv']):>10} {int(got['state']):>7} {int(got['aux']):>5} "
                f"{int(saved):>12} {result.elapsed_s * 1e3:>7.1f}"
            )
    return 1 if failed else 0


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Run real agents locally (loopback tcp) and move verified rooms.")
    ap.add_argument("cases", nargs="*", help=f"any of {', '.join(DEMO_CASES)} (default: all)")
    ap.add_argument("--pages", type=int, default=12)
    args = ap.parse_args()
    unknown = sorted(set(args.cases) - set(DEMO_CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(DEMO_CASES)}")
    args.cases = args.cases or list(DEMO_CASES)
    sys.exit(demo(args.cases, args.pages))


if __name__ == "__main__":
    main()
