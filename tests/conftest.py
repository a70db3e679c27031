"""Shared fixtures: the real local control plane (session-wide) and a fresh namespace per test.

Tests under tests/integration and tests/e2e are marked automatically by directory. The cluster's
logs are kept (path printed) when any test of the session failed, and removed otherwise.

Run by `make test`, the suite is spread over pytest-xdist workers (tests/parallel.py says how) and
held to a wall-clock budget, ``pdfabric_pytest_budget_s`` in pyproject.toml: the run prints its
total against it and fails when over, so growth shows the day it happens (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / ".artifacts"


BUDGET_INI = "pdfabric_pytest_budget_s"
_STARTED = pytest.StashKey[float]()
_TOOK = pytest.StashKey[float]()
_CPU = pytest.StashKey[tuple[int, int]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        BUDGET_INI, "pytest's own wall-clock seconds a run may take; over it the run fails (0: none)", default="0"
    )


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, all) jiffies of the machine's cores so far (/proc/stat), or zeros."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTED] = time.monotonic()
    if not hasattr(config, "workerinput"):
        from pdfabric_devcluster.timings import TIMINGS_ENV

        config.stash[_CPU] = _cpu_jiffies()
        timings = ARTIFACTS / "pytest" / f"timings-{os.getpid()}.jsonl"
        timings.parent.mkdir(parents=True, exist_ok=True)
        timings.unlink(missing_ok=True)
        os.environ[TIMINGS_ENV] = str(timings)  # the workers inherit it
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count:
        # Each worker picks loopback ports from its own slice (procs.free_port).
        from pdfabric_devcluster.procs import PORT_SLICE_ENV

        os.environ[PORT_SLICE_ENV] = f"{worker[2:]}/{count}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO_ROOT).parts
        if len(parts) > 1 and parts[1] in ("integration", "e2e"):
            item.add_marker(getattr(pytest.mark, parts[1]))
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.controlplane)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order xdist hands the modules out in
        from tests import parallel

        order = parallel.longest_first([item.nodeid for item in items], parallel.load_durations())
        items[:] = [items[i] for i in order]


def _budget_s(config: pytest.Config) -> float:
    return float(str(config.getini(BUDGET_INI)) or 0)


def _took_s(config: pytest.Config) -> float:
    """The run's wall time, taken once (at sessionfinish): the verdict and the summary use the same."""
    if _TOOK not in config.stash:
        config.stash[_TOOK] = time.monotonic() - config.stash[_STARTED]
    return config.stash[_TOOK]


def _over_budget(config: pytest.Config) -> tuple[float, float] | None:
    if hasattr(config, "workerinput") or _STARTED not in config.stash:  # a worker: the controller judges
        return None
    took, budget = _took_s(config), _budget_s(config)
    return (took, budget) if budget and took > budget else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _STARTED not in config.stash:
        return
    from pdfabric_devcluster.timings import TIMINGS_ENV, totals

    took, budget = _took_s(config), _budget_s(config)
    terminalreporter.write_sep("=", f"pytest took {took:.0f} s" + (f" of its {budget:.0f} s budget" if budget else ""))
    (busy0, all0), (busy1, all1) = config.stash.get(_CPU, (0, 0)), _cpu_jiffies()
    if all1 > all0:
        terminalreporter.write_line(f"the machine's cores were busy {100 * (busy1 - busy0) / (all1 - all0):.0f}% of it")
    for kind, (count, seconds) in sorted(totals(Path(os.environ.get(TIMINGS_ENV, "/nonexistent"))).items()):
        terminalreporter.write_line(f"{kind}: {count} x, {seconds:.0f} s in all")
    if (over := _over_budget(config)) is not None:
        terminalreporter.write_line(
            f"FAILED: the suite took {over[0]:.0f} s, over its budget of {over[1]:.0f} s ({BUDGET_INI} in "
            "pyproject.toml). Find what grew in the slowest durations above and docs/testing.md's table; "
            "make it cheaper, or raise the budget in the same commit with the reason.",
            red=True,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tails of the servers and agents it used: any of its
    fixtures with ``failure_logs()`` (CI keeps the output, not the logs' folders)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for fixture, value in getattr(item, "funcargs", {}).items():
        logs = getattr(value, "failure_logs", None)
        if callable(logs) and not isinstance(value, type):
            for title, text in logs().items():
                report.sections.append((f"{fixture}: {title} (log tail)", text))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _over_budget(session.config) is not None and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pdfabric installed as a user installs it (its ``sglang.srt.plugins`` entry point with it)."""
    if os.environ.get("PDFABRIC_INSTALLED_SITE"):
        return Path(os.environ["PDFABRIC_INSTALLED_SITE"])
    target = tmp_path_factory.mktemp("site")
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*argv, str(target), str(REPO_ROOT)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[object]:
    from pdfabric_devcluster import ClusterConfig, LocalCluster

    workdir = ARTIFACTS / "pytest" / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    local = LocalCluster(ClusterConfig(workdir=workdir))
    try:
        local.start()
    except Exception:
        print(f"\ncontrol plane failed to start; logs kept in {local.log_dir}")
        raise
    yield local
    local.stop()
    if request.session.testsfailed:
        print(f"\ncontrol-plane logs kept for the failed tests: {local.log_dir}")
    else:
        local.remove_data()


@pytest.fixture
def namespace(cluster: object, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (the garbage collector removes the rest)."""
    name = f"t-{request.node.name[:40].lower().replace('_', '-').strip('-')}-{uuid.uuid4().hex[:6]}"
    name = "".join(c if c.isalnum() or c == "-" else "-" for c in name)
    cluster.kubectl("create", "namespace", name)  # type: ignore[attr-defined]
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)  # type: ignore[attr-defined]
