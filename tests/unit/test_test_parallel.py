"""How make test hands the suite to its workers (tests/parallel.py): a module is one unit, units
longest first, each unit's tests together and in file order."""

from __future__ import annotations

import json
from pathlib import Path

from tests import parallel


def test_modules_go_longest_first_each_kept_whole_and_in_order() -> None:
    nodeids = [
        "tests/unit/test_quick.py::test_1",
        "tests/e2e/test_slow.py::test_1[a]",
        "tests/unit/test_quick.py::test_2",
        "tests/e2e/test_slow.py::test_2",
        "tests/integration/test_mid.py::test_1",
        "tests/e2e/test_slow.py::test_1[b]",
    ]
    durations = {"tests/unit/test_quick.py": 1.0, "tests/e2e/test_slow.py": 300.0}
    order = [nodeids[i] for i in parallel.longest_first(nodeids, durations)]
    # slow (300) before mid (an integration module never measured: 60) before quick (1)
    assert order == [
        "tests/e2e/test_slow.py::test_1[a]",
        "tests/e2e/test_slow.py::test_2",
        "tests/e2e/test_slow.py::test_1[b]",
        "tests/integration/test_mid.py::test_1",
        "tests/unit/test_quick.py::test_1",
        "tests/unit/test_quick.py::test_2",
    ]


def test_a_module_never_measured_counts_by_its_tier() -> None:
    assert parallel.expected_s("tests/unit/test_new.py", {}) == parallel.UNKNOWN_S["unit"]
    assert parallel.expected_s("tests/e2e/test_new.py", {}) == parallel.DEFAULT_UNKNOWN_S
    assert parallel.expected_s("tests/e2e/test_new.py", {"tests/e2e/test_new.py": 7.5}) == 7.5


def test_durations_file_is_read_and_a_broken_one_is_ignored(tmp_path: Path) -> None:
    good = tmp_path / "d.json"
    good.write_text(json.dumps({"modules": {"tests/unit/test_a.py": 2}}))
    assert parallel.load_durations(good) == {"tests/unit/test_a.py": 2.0}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert parallel.load_durations(bad) == {}
    assert parallel.load_durations(tmp_path / "missing.json") == {}


def test_the_committed_durations_name_modules_that_exist() -> None:
    """A stale table would schedule by modules that moved: rewrite it (hack/test_durations.py --write)."""
    root = Path(__file__).resolve().parents[2]
    missing = [m for m in parallel.load_durations() if not (root / m).is_file()]
    assert missing == [], missing
