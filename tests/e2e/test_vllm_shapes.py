"""Heterogeneous TP between vLLM's prefill and decode servers, the direction test_vllm_servers.py
does not run: prefill TP 2 -> decode TP 1, each prefill rank a worker process and its own pdfabric
engine rank, the agents gathering both ranks' KV heads into decode's fused pages. Answers through
vLLM's router equal a single vLLM server's, token for token. vLLM's NixlConnector runs its control
on test_vllm_servers.py's pair only: its servers spin while up (two threads per worker:
benchmarks/bench_vllm_exposed.py's idle cores), which a second pair's worth starved the suite on two
cores."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdfabric_vllmserver.pd import Shape, VllmPD, behind_router
from pdfabric_vllmserver.servers import VllmServer, completion, token_ids
from tests.e2e.prompts import CONCURRENT, NEW_TOKENS, PROMPTS
from tests.e2e.vllm_servers import answer, python, single, vllm_model

__all__ = ["python", "single", "vllm_model"]  # the shared fixtures, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SHAPES = [Shape(2, 1)]  # 1 -> 2 is test_vllm_servers.py's pair
CASES = [pytest.param(("pdfabric", s), id=f"pdfabric-{s.name}") for s in SHAPES]


@pytest.fixture(scope="module", params=CASES)
def pd(
    request: pytest.FixtureRequest,
    python: str,
    vllm_model: Path,
    single: VllmServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmPD]:
    connector, shape = request.param
    logs = tmp_path_factory.mktemp(f"vllm-{connector}-{shape.name}")
    with behind_router(connector, python, vllm_model, logs, shape) as pd:
        yield pd


def test_shaped_pd_answers_equal_a_single_server(pd: VllmPD, single: VllmServer) -> None:
    for prompt in PROMPTS:
        status, got = pd.complete(completion(prompt, NEW_TOKENS))
        assert status == 200, (pd.connector, got, pd.decode.tail(), pd.prefill.tail())
        assert token_ids(got) == answer(single, prompt), (pd.connector, len(prompt))
    prompts = CONCURRENT[:6]
    want = [answer(single, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: pd.complete(completion(p, NEW_TOKENS), 240), prompts))
    assert [(s, token_ids(a)) for s, a in answers] == [(200, w) for w in want]
    if pd.fabric is not None:  # every decode rank's agent counted its share of the KV
        assert pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") > 0
