"""What the vLLM test modules share: the vLLM environment's python, the model directory, a single
vLLM server (the answers PD must equal, remembered per prompt), and the prompts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric_vllmserver.pd import VllmPD
from pdfabric_vllmserver.servers import MODEL, VllmServer, completion, start_server, token_ids, vllm_python

PROMPTS = [
    [104, 101, 108, 108, 111],
    list(range(32, 120)),
    [7, 1, 5] * 40,
    list(range(40, 250)) * 2,
    [(i * 37) % 251 for i in range(700)],
    [65] * 33,
]
CONCURRENT = [[(i * 13 + j * 7) % 250 + 1 for j in range(20 + 9 * i)] for i in range(16)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def python() -> str:
    return vllm_python()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdfabric_sglangserver.model import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("vllm-model"), MODEL)


@pytest.fixture(scope="module")
def single(python: str, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server serving the model alone: the answers PD must equal."""
    server = start_server("single", python, vllm_model, tmp_path_factory.mktemp("vllm-single") / "single.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


_answers: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def answer(server: VllmServer | VllmPD, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """The server's greedy tokens; a single server's are remembered (the same for the same prompt)."""
    key = (id(server), tuple(prompt), new_tokens)
    if isinstance(server, VllmServer) and key in _answers:
        return _answers[key]
    status, body = server.complete(completion(prompt, new_tokens))
    assert status == 200, body
    if isinstance(server, VllmServer):
        _answers[key] = token_ids(body)
    return token_ids(body)
