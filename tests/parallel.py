"""How `make test` spreads the suite over pytest-xdist workers (``--dist loadscope``).

A test module is the unit of work: xdist's loadscope sends all of a module's tests to one worker,
which runs them in file order, so a module-scoped fixture (agents, SGLang servers, a fabric) starts
once. (Finer units, such as one per SGLang backend of a module, would need xdist's loadgroup, whose
groups pytest 9 no longer sees: it renames the node id they are written into.) Units are handed out
in collection order (``--no-loadscope-reorder``), which ``longest_first`` makes longest first (the
greedy longest-processing-time rule), from the per-module seconds of the last measured run in
``tests/durations.json`` (``hack/test_durations.py`` rewrites it and docs/testing.md's table from a
run's output); a module not in it counts as ``UNKNOWN_S`` for its tier, so a new slow module is
started early rather than left as the run's tail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
UNKNOWN_S = {"unit": 5.0}  # any other tier: DEFAULT_UNKNOWN_S
DEFAULT_UNKNOWN_S = 60.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.get("modules", {}).items()}


def expected_s(module: str, durations: Mapping[str, float]) -> float:
    if module in durations:
        return durations[module]
    parts = module.split("/")
    tier = parts[1] if len(parts) > 2 else ""
    return UNKNOWN_S.get(tier, DEFAULT_UNKNOWN_S)


def longest_first(nodeids: Sequence[str], durations: Mapping[str, float]) -> list[int]:
    """The indices of ``nodeids`` reordered so that modules come longest first, each module's
    tests together and in their collected order (a module-scoped parametrised fixture relies on it)."""
    members: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        members.setdefault(module_of(nodeid), []).append(i)
    order = sorted(members, key=lambda m: (-expected_s(m, durations), m))
    return [i for m in order for i in members[m]]
