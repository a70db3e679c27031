"""spec.router end to end: kubectl apply of a PDCluster with spec.engine and spec.router -> the
operator's node pod (its agent runs two prefill engines and a decode engine) and the router's
Deployment -> the kube-scheduler places the router pod, and the harness runs both pods' real
commands (PodRunner: the router's is SGLang's own router, its engine URLs resolved to the agent
pod's loopback ports as the cluster DNS would) -> plain /generate requests to the router -> greedy
tokens equal to colocated generation, KV sent by both prefill engines' ranks, the PDCluster Ready
with its router."""

from __future__ import annotations

from typing import Any

import pytest
from kopf.testing import KopfRunner

from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from tests.builders import pdcluster
from tests.e2e import node_pods as eng
from tests.e2e import pd_runs
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes
runner, operator = eng.runner, eng.operator


def test_the_operators_router_serves_prompts_through_pd(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: KopfRunner, runner: PodRunner
) -> None:
    gpu_nodes("rt", 1, gpus=4)
    builder = (
        pdcluster()
        .transport("tcp")
        .prefill(replicas=2, tp=1)
        .decode(tp=1)
        .model(**pd_runs.REF_MODEL)
        .transfer(timeoutSeconds=8)
        .placement(nodeSelector=h.selector(namespace))
        .engine(**eng.ENGINE)
        .router(args=["--policy", "round_robin"], nodeSelector=h.selector(namespace))
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    h.wait_until(lambda: len(h.agent_pods(cluster, namespace, "pd")) == 3, timeout=60, what="a node pod per replica")
    pods = runner.sync()
    assert sorted(name for _, name in runner.engines) == ["decode-0", "prefill-0", "prefill-1"]
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=180, what="the agents and their engines ready")
    runner.wait_engines_healthy(timeout=30)

    h.wait_until(lambda: eng.router_pods_scheduled(cluster, namespace), timeout=60, what="the router pod scheduled")
    (router,) = runner.start_routers()
    router.wait_healthy(60, ready=True)  # the operator's readiness probe: a healthy worker of each kind
    obj = h.wait_ready(cluster, namespace, "pd", timeout=60)  # the engines and a router replica
    assert obj["status"]["router"]["ready"] == "1/1"

    prompts = pd_runs.PROMPTS * 2
    want = eng.colocated(prompts)
    body = {"sampling_params": {"max_new_tokens": eng.NEW_TOKENS, "temperature": 0}}
    answers = [router.generate({**body, "input_ids": p}) for p in prompts]
    assert [status for status, _ in answers] == [200] * len(prompts), [a for s, a in answers if s != 200][:2]
    assert [a["output_ids"] for _, a in answers] == want
    fabric = Fabric.from_cluster(cluster, namespace, "pd", runner)
    for rank in ("prefill-0-tp0-cp0", "prefill-1-tp0-cp0"):
        sent = fabric.metric_sum("pdfabric_peer_transfer_bytes_total", role="prefill", rank=rank)
        assert sent > 0, f"the router sent nothing through {rank}"
    # The router's own metrics, on the port the Deployment names "metrics" (the chart's
    # PodMonitor scrapes it): every request it took, as it counted them.
    generated = router.metric_samples("smg_http_requests_total")
    assert generated[(("method", "POST"), ("path", "/generate"))] == len(prompts), generated
