"""What the vLLM test modules share: the vLLM environment's python, the model directory, a single
vLLM server (the answers PD must equal, remembered per prompt)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric_vllmserver.pd import VllmPD
from pdfabric_vllmserver.servers import MODEL, VllmServer, completion, start_server, token_ids, vllm_python
from tests.e2e.prompts import NEW_TOKENS


@pytest.fixture(scope="module")
def python() -> str:
    return vllm_python()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdfabric_sglangserver.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("vllm-model"), MODEL)


@pytest.fixture(scope="module")
def single(python: str, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server serving the model alone: the answers PD must equal. Started, not waited for:
    it comes up while the PD pair does (``answer`` waits for it)."""
    server = start_server("single", python, vllm_model, tmp_path_factory.mktemp("vllm-single") / "single.log")
    try:
        yield server
    finally:
        server.stop()


_answers: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def answer(server: VllmServer | VllmPD, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """The server's greedy tokens; a single server's are remembered (the same for the same prompt)."""
    key = (id(server), tuple(prompt), new_tokens)
    if isinstance(server, VllmServer) and key in _answers:
        return _answers[key]
    if isinstance(server, VllmServer):
        server.wait_healthy()
    status, body = server.complete(completion(prompt, new_tokens))
    assert status == 200, body
    if isinstance(server, VllmServer):
        _answers[key] = token_ids(body)
    return token_ids(body)
