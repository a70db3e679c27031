"""Exposed transfer after the last chunk, one tree against another in the same run: a refactor's
no-regression check (issue 42). Runs ``bench_sglang_backends.py`` part (a) in each checkout in
turn, ``--rounds`` times, alternating which goes first, and prints, per case, pdfabric's median
in each tree and new / old, with SGLang's Mooncake backend of the same runs as the control (its
ratio says how much the machine itself drifted between the trees' turns).

    python benchmarks/ab_exposed.py --old /tmp/old --new . [--rounds 2] [--repeat 7]

Each checkout runs its own code (the benchmark puts its tree's packages first on sys.path).
Part (b) is cut to its smallest (8 in flight, 5 polls): it is not what this compares.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_tree(tree: Path, repeat: int, out: Path) -> dict[str, dict[str, list[float]]]:
    """One run of part (a) in ``tree``: backend -> case -> exposed seconds."""
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_sglang_backends.py"), "--repeat", str(repeat)]
    cmd += ["--inflight", "8", "--poll-repeat", "5", "--json", str(out)]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    results = json.loads(out.read_text())
    for backend, res in results.items():
        if res["errors"]:
            raise RuntimeError(f"{tree}: {backend}: {res['errors'][:3]}")
    return {backend: res["exposed_all_s"] for backend, res in results.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for which in order:
                got = run_tree(getattr(args, which).resolve(), args.repeat, Path(tmp) / f"{which}-{r}.json")
                for backend, cases in got.items():
                    for case, xs in cases.items():
                        samples[which].setdefault(backend, {}).setdefault(case, []).extend(xs)
    print("| case | backend | old median ms | new median ms | new / old | samples each |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for case in samples["old"]["pdfabric"]:
        for backend in ("pdfabric", "mooncake"):
            old, new = samples["old"][backend][case], samples["new"][backend][case]
            mo, mn = statistics.median(old), statistics.median(new)
            print(
                f"| {case} | {backend} | {mo * 1e3:.1f} | {mn * 1e3:.1f} | {mn / mo:.2f}x | {min(len(old), len(new))} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
