"""Where a test run's time went, from its output: ``python hack/test_durations.py run.log``.

Reads the ``slowest durations`` section that ``pytest --durations=0`` prints (setup, call and
teardown of every test, also under pytest-xdist) and the run's own summary lines (tests/conftest.py:
wall time, the cores' load, what the harness started), then

- writes ``tests/durations.json``: seconds per test module, which tests/parallel.py uses to hand the
  longest modules out first (``--write``);
- prints docs/testing.md's duration table: per tier and per module, setup (fixtures: control
  planes, agents, SGLang servers), call and teardown, and the largest single setups.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)")
# The run's own summary lines, without the "=" rules around some of them.
SUMMARY = re.compile(
    r"^(pytest took \d+ s.*|the machine's cores were busy.*|[a-z][\w ()-]*: \d+ x, \d+ s in all|\d+ (passed|failed)\b.* in [\d.]+s.*)$"
)


@dataclass
class Module:
    tests: set[str] = field(default_factory=set)
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def parse(text: str) -> tuple[dict[str, Module], list[tuple[float, str]], list[str]]:
    """(modules, the ten largest setups, the run's summary lines)."""
    modules: dict[str, Module] = defaultdict(Module)
    setups: list[tuple[float, str]] = []
    summary: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if m := LINE.match(line):
            seconds, phase, nodeid = float(m[1]), m[2], m[3]
            module = modules[nodeid.split("::", 1)[0]]
            module.tests.add(nodeid)
            module.phases[phase] += seconds
            if phase == "setup":
                setups.append((seconds, nodeid))
        elif SUMMARY.match(bare := line.strip("= ")):
            summary.append(bare)
    return modules, sorted(setups, reverse=True)[:10], summary


def tier(module: str) -> str:
    parts = module.split("/")
    return parts[1] if len(parts) > 2 else "other"


def table(modules: dict[str, Module], setups: list[tuple[float, str]], summary: list[str]) -> str:
    out = [*(f"- {s}" for s in summary), ""]
    tiers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, mod in modules.items():
        tiers[tier(name)][0] += mod.total
        tiers[tier(name)][1] += len(mod.tests)
    out += ["| tier | timed tests | seconds (sum over workers) |", "| --- | ---: | ---: |"]
    for name, (seconds, count) in sorted(tiers.items(), key=lambda kv: -kv[1][0]):
        out.append(f"| {name} | {int(count)} | {seconds:.0f} |")
    out += [
        "",
        "| module | timed tests | setup s | call s | teardown s | total s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, mod in sorted(modules.items(), key=lambda kv: -kv[1].total):
        if mod.total < 5:
            continue
        p = mod.phases
        out.append(
            f"| `{name}` | {len(mod.tests)} | {p['setup']:.0f} | {p['call']:.0f} | {p['teardown']:.0f} | {mod.total:.0f} |"
        )
    small = [m for m in modules.values() if m.total < 5]
    out.append(
        f"| {len(small)} modules under 5 s each | {sum(len(m.tests) for m in small)} | | | | {sum(m.total for m in small):.0f} |"
    )
    out += ["", "The largest single setups (a module's or the session's fixtures, paid by its first test):", ""]
    out += [f"- {seconds:.0f} s `{nodeid}`" for seconds, nodeid in setups]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path, help="the output of a pytest run with --durations=0")
    ap.add_argument("--write", action="store_true", help=f"rewrite {DURATIONS.relative_to(ROOT)}")
    args = ap.parse_args()
    modules, setups, summary = parse(args.log.read_text(errors="replace"))
    if not modules:
        print(f"{args.log}: no durations found (run pytest with --durations=0)", file=sys.stderr)
        return 2
    if args.write:
        doc = {
            "about": "seconds per test module of the last measured run (hack/test_durations.py); tests/parallel.py reads it",
            "modules": {name: round(mod.total, 1) for name, mod in sorted(modules.items())},
        }
        DURATIONS.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(modules, setups, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
