"""What the SGLang server tests share for the whole session: the test model's directory and one
SGLang server serving the model alone (the answers every PD shape must equal; a server costs a
minute or more and holds about 3 GB, so it is started once). pdfabric installed as a user installs
it (``installed_site``) is in tests/conftest.py. And where a test keeps the engine token for the
SGLang classes it drives by hand (``token_file``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdfabric_sglangserver.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One SGLang server serving the model alone: the answers PD must equal."""
    from pdfabric_sglangserver.servers import reference_server

    with reference_server("single", model_dir, tmp_path_factory.mktemp("single")) as server:
        yield server


@pytest.fixture
def token_file(tmp_path: Path) -> Iterator[Path]:
    """Where the engine token of a test's LocalFabric is written for SGLang's classes to read."""
    yield tmp_path / "token"
