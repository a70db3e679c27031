"""What the SGLang server tests share for the whole session: the test model's directory, pdfabric
installed as a user installs it, and one SGLang server serving the model alone (the answers every
PD shape must equal). Each costs a minute or more and a server holds about 3 GB, so each is made
once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdfabric_sglangserver.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pdfabric installed as a user installs it (its ``sglang.srt.plugins`` entry point with it)."""
    if os.environ.get("PDFABRIC_INSTALLED_SITE"):
        return Path(os.environ["PDFABRIC_INSTALLED_SITE"])
    target = tmp_path_factory.mktemp("site")
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*argv, str(target), str(ROOT)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="session")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One SGLang server serving the model alone: the answers PD must equal."""
    from pdfabric_devcluster.procs import free_port
    from pdfabric_sglangserver.servers import server_argv, server_env, start_server

    logs = tmp_path_factory.mktemp("single")
    port = free_port()
    server = start_server(
        "single", server_argv(model_dir, port), server_env(dict(os.environ)), logs / "single.log", port
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
