"""The harness of ``benchmarks/bench_sglang_backends.py`` keeps working (issue 23): SGLang's own
queues drive SGLang's Mooncake and NIXL backends (loopback tcp) and pdfabric (real agents moving the
bytes with Mooncake, and with NIXL), tiny sizes, and every request of each arrives byte-exact at decode (its KV pages and the first token of its
metadata row). Timings are not asserted. The bench runs in its own process: it publishes SGLang's
process configuration and a gloo group, which must not leak into other tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_every_backend_moves_every_request_byte_exact_under_sglangs_queues(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_sglang_backends.py"), "--repeat", "1",
            "--tokens", "64", "--compute-ms", "5", "--inflight", "6", "--poll-repeat", "3", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"mooncake", "pdfabric", "nixl", "pdfabric-nixl"}
    for backend, res in results.items():
        assert res["errors"] == [], (backend, res["errors"])
        # Every case ran (so its bytes were compared), and every poll row was measured.
        assert set(res["exposed_all_s"]) == {"4-chunk", "1-chunk", "cached-prefix"}, backend
        assert all(len(v) == 1 and v[0] > 0 for v in res["exposed_all_s"].values()), backend
        assert set(res["iteration_s"]["6"]) == {
            "prefill bootstrap queue",
            "prefill inflight, not sent",
            "decode transfer queue",
        }
    assert proc.stdout.count("every request byte-exact") == 4, proc.stdout
    # A table for each pair: pdfabric against SGLang's own backend over the same library.
    assert proc.stdout.count("(a) exposed transfer") == 2 and proc.stdout.count("(b) backend time") == 2
