"""A PDCluster whose engines are vLLM's own server, under the operator: kubectl apply of
examples/vllm (spec.engine: ``vllm.entrypoints.openai.api_server`` with pdfabric's connector per
role; spec.router of kind vllm) -> the operator's node pods and the router's Deployment -> their
real commands as local processes (PodRunner: each agent starts its vLLM server from vLLM's own
environment, which stands for the engine image; the router pod runs ``vllm-router`` as the operator
wrote its command, the engine URLs resolved as the cluster DNS would) -> prompts to the router ->
greedy tokens equal to a single vLLM server's, sequential and 16 concurrent, the KV counted by the
decode agent in whole pages, the PDCluster Ready with its engines and router."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.procs import post_json
from pdfabric_vllmserver.pd import example_images, example_pdcluster
from pdfabric_vllmserver.servers import BLOCK_SIZE, MODEL, VllmServer, completion, token_ids
from tests.e2e import node_pods
from tests.e2e.prompts import CONCURRENT, NEW_TOKENS, PROMPTS
from tests.e2e.vllm_servers import answer, python, single, vllm_model
from tests.integration import pdcluster_harness as h

__all__ = ["python", "single", "vllm_model"]  # the shared fixtures, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes
operator = node_pods.operator

NAME = "vllm"
PAGE_BYTES = 2 * BLOCK_SIZE * 2 * MODEL.head_dim * 4  # a page of the test model, fused K|V, float32
START_S = 420  # three vLLM servers starting at once on two cores


@pytest.fixture
def example(vllm_model: Path, namespace: str) -> dict[str, Any]:
    doc = example_pdcluster(vllm_model)
    doc["spec"]["placement"] = {"nodeSelector": h.selector(namespace)}
    return doc


@pytest.fixture
def runner(cluster: Any, namespace: str, tmp_path: Path, python: str, example: dict[str, Any]) -> Iterator[PodRunner]:
    """The pods' commands as local processes, the engine's and router's images being vLLM's
    environment here (vLLM and this project pin different torch releases)."""
    images = example_images(example, python)
    pods = PodRunner(cluster, namespace, "app.kubernetes.io/component=agent", tmp_path / "pods", images=images)
    yield pods
    pods.stop()


def test_the_vllm_example_answers_equal_a_single_vllm_server_under_the_operator(
    cluster: Any,
    namespace: str,
    gpu_nodes: Any,
    operator: KopfRunner,
    runner: PodRunner,
    example: dict[str, Any],
    single: VllmServer,
) -> None:
    gpu_nodes("vl", 2, gpus=1)
    h.apply_pdc(cluster, example, namespace)
    h.wait_until(lambda: len(h.agent_pods(cluster, namespace, NAME)) == 2, timeout=60, what="a node pod per role")
    pods = runner.sync()
    assert sorted(name for _, name in runner.engines) == ["decode-0", "prefill-0"]
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=START_S, what="the agents and vLLM servers")
    runner.wait_engines_healthy(timeout=30)

    h.wait_until(
        lambda: node_pods.router_pods_scheduled(cluster, namespace), timeout=60, what="the router pod scheduled"
    )
    (router,) = runner.start_routers()
    router.wait_healthy(120, ready=True)  # vllm-router listens once both workers answer /health
    obj = h.wait_ready(cluster, namespace, NAME, timeout=60)
    assert obj["status"]["router"]["ready"] == "1/1"
    engines = obj["status"]["engines"]
    assert [(engines[r]["desired"], engines[r]["ready"]) for r in ("prefill", "decode")] == [(1, 1), (1, 1)]

    def complete(prompt: list[int]) -> tuple[int, dict[str, Any]]:
        return post_json(router.url + "/v1/completions", completion(prompt, NEW_TOKENS), 240)

    for prompt in PROMPTS:
        want = answer(single, prompt)
        status, got = complete(prompt)
        assert status == 200, (got, router.log.read_text(errors="replace")[-2000:])
        assert token_ids(got) == want, len(prompt)
    want_all = [answer(single, p) for p in CONCURRENT]
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        answers = list(pool.map(complete, CONCURRENT))
    assert [s for s, _ in answers] == [200] * len(CONCURRENT), [a for s, a in answers if s != 200][:2]
    assert [token_ids(a) for _, a in answers] == want_all

    # Decode's agent took the KV, in whole pages of every layer (decode's prefix cache may hold
    # some pages already, so not every prompt's every page).
    fabric = Fabric.from_cluster(cluster, namespace, NAME, runner)
    moved = fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
    assert moved > 0 and moved % (PAGE_BYTES * MODEL.layers) == 0, moved
    assert fabric.metric_sum("pdfabric_requests_total", outcome="failed") == 0
