"""How make test hands the suite to its workers (tests/parallel.py): a module is one unit, a split
module one unit per value of its fixture, units longest first, each unit's tests in file order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import parallel

SERVERS = "tests/e2e/test_sglang_servers.py"


@pytest.mark.parametrize(
    ("nodeid", "indices", "want"),
    [
        ("tests/unit/test_a.py::test_x", None, "tests/unit/test_a.py"),
        ("tests/unit/test_a.py::TestK::test_x[1]", {"case": 1}, "tests/unit/test_a.py"),
        (f"{SERVERS}::test_pd_moves[pdfabric]", {"pd": 1}, f"{SERVERS}#1"),
        (f"{SERVERS}::test_pd_moves[mooncake]", {"pd": 0}, f"{SERVERS}#0"),
        (f"{SERVERS}::test_the_models_tokens_depend_on_the_kv", None, SERVERS),  # no server set
    ],
    ids=["module", "parametrised-not-split", "split-1", "split-0", "split-module-without-the-fixture"],
)
def test_a_test_runs_in_its_modules_unit_or_its_split_value(
    nodeid: str, indices: dict[str, int] | None, want: str
) -> None:
    assert parallel.group_of(nodeid, indices) == want


def test_a_split_unit_is_a_group_xdist_reads() -> None:
    """xdist's loadgroup takes what follows the last "@" as the group only when no "]" comes after
    it (a parameter value may hold "@"): a group name ending in "]" silently ran every test of a
    split module as a unit of its own, and both workers started the same SGLang servers."""
    group = parallel.group_of(f"{SERVERS}::test_pd_moves[mooncake]", {"pd": 0})
    nodeid = f"{SERVERS}::test_pd_moves[mooncake]@{group}"
    assert nodeid.rfind("@") > nodeid.rfind("]")


def test_units_go_longest_first_each_kept_whole_and_in_order() -> None:
    nodeids = [
        "tests/unit/test_quick.py::test_1",
        "tests/e2e/test_slow.py::test_1",
        "tests/unit/test_quick.py::test_2",
        "tests/e2e/test_slow.py::test_2",
        "tests/integration/test_mid.py::test_1",
        f"{SERVERS}::test_a[mooncake]",
        f"{SERVERS}::test_a[pdfabric]",
    ]
    groups = [parallel.group_of(n) for n in nodeids[:5]] + [f"{SERVERS}#0", f"{SERVERS}#1"]
    durations = {"tests/unit/test_quick.py": 1.0, "tests/e2e/test_slow.py": 300.0, SERVERS: 500.0}
    order = [nodeids[i] for i in parallel.longest_first(nodeids, groups, durations)]
    # slow (300) before each servers half (250 each) before mid (unknown integration: 60) before quick (1)
    assert order == [
        "tests/e2e/test_slow.py::test_1",
        "tests/e2e/test_slow.py::test_2",
        f"{SERVERS}::test_a[mooncake]",
        f"{SERVERS}::test_a[pdfabric]",
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
