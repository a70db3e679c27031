"""How `make test` spreads the suite over pytest-xdist workers (``--dist loadgroup``).

A test module is the unit of work (an xdist group): its tests run on one worker, in file order, so
a module-scoped fixture (agents, SGLang servers, a fabric) starts once. ``SPLIT`` names modules
whose module-scoped fixture is parametrised over independent server sets: each value is a unit of
its own (SGLang's servers over Mooncake and over pdfabric start on different workers, side by side).
Units are handed out longest first (the greedy longest-processing-time rule), from the per-module
seconds of the last measured run in ``tests/durations.json`` (``hack/test_durations.py`` rewrites it
and docs/testing.md's table from a run's output), a split module's seconds shared evenly by its
units; a module not in it counts as ``UNKNOWN_S`` for its tier, so a new slow module is started early
rather than left as the run's tail.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
UNKNOWN_S = {"unit": 5.0}  # any other tier: DEFAULT_UNKNOWN_S
DEFAULT_UNKNOWN_S = 60.0
# module -> its module-scoped fixture whose parameters are independent units of work
SPLIT: Mapping[str, str] = {
    "tests/e2e/test_sglang_servers.py": "pd",
    "tests/e2e/test_sglang_shapes.py": "shape",
}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def group_of(nodeid: str, param_indices: Mapping[str, int] | None = None) -> str:
    """The unit of work of a test: its module, or for a ``SPLIT`` module the module and which value
    of its split fixture the test runs with (``param_indices``: pytest's ``callspec.indices``)."""
    module = module_of(nodeid)
    fixture = SPLIT.get(module)
    if fixture is None or not param_indices or fixture not in param_indices:
        return module
    # Not "[...]": xdist reads a node id ending in "]" after its "@group" as one without a group.
    return f"{module}#{param_indices[fixture]}"


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


def longest_first(nodeids: Sequence[str], groups: Sequence[str], durations: Mapping[str, float]) -> list[int]:
    """The indices of ``nodeids`` (whose units are ``groups``) reordered so that units come longest
    first, each unit's tests together and in their collected order (a module-scoped parametrised
    fixture relies on it)."""
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    units_of: dict[str, int] = {}
    for idx in members.values():
        module = module_of(nodeids[idx[0]])
        units_of[module] = units_of.get(module, 0) + 1
    cost = {
        g: expected_s(module_of(nodeids[idx[0]]), durations) / units_of[module_of(nodeids[idx[0]])]
        for g, idx in members.items()
    }
    order = sorted(members, key=lambda g: (-cost[g], g))
    return [i for g in order for i in members[g]]
