"""Shared fixtures: the real local control plane (session-wide) and a fresh namespace per test.

Tests under tests/integration and tests/e2e are marked automatically by directory. The cluster's
logs are kept (path printed) when any test of the session failed, and removed otherwise.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO_ROOT).parts
        if len(parts) > 1 and parts[1] in ("integration", "e2e"):
            item.add_marker(getattr(pytest.mark, parts[1]))


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
