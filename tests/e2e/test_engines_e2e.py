"""A PDCluster that serves (issue 12): kubectl apply of a PDCluster with spec.engine -> the
operator's node pods (agent + one engine container per replica) -> their real commands as local
processes (EnginePodRunner: the agents, and the reference engine's serving front with SGLang's
pdfabric classes) -> prompts sent as SGLang's PD router sends them (the same bootstrap room to the
prefill and the decode endpoint of the status) -> greedy tokens equal to colocated generation.
Then an engine is killed mid-traffic: its requests fail with an error answer, none hangs, and the
engine comes back (restarted with backoff) and serves again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pdfabric_refengine.router import Answer, PrefillEndpoint, generate
from pdfabric_refengine.server import detokenize

from pdfabric_devcluster.enginerunner import EnginePodRunner
from pdfabric_devcluster.fabric import LocalFabric
from tests.builders import pdcluster
from tests.e2e import test_sglang_pd as sg
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

operator_kubeconfig, gpu_nodes, operator = h.operator_kubeconfig, h.gpu_nodes, h.operator
installed = sg.installed

PROMPTS = sg.PROMPTS
NEW_TOKENS = 16
SERVER = ["python", "-m", "pdfabric_refengine.server"]
# What the engine containers run: the reference engine's serving front with SGLang's classes for
# --disaggregation-transfer-backend pdfabric; its port, TP and shm dir from the container's env.
ENGINE = {
    "image": "pdfabric/refengine:local",
    "prefill": {"command": SERVER, "args": ["--role", "prefill", "--tp", "$(PDFABRIC_TP)", "--timeout-s", "10"]},
    "decode": {"command": SERVER, "args": ["--role", "decode", "--tp", "$(PDFABRIC_TP)", "--timeout-s", "10"]},
}


@pytest.fixture
def runner(cluster: Any, namespace: str, tmp_path: Path, installed: Path) -> Iterator[EnginePodRunner]:
    pods = EnginePodRunner(
        cluster, namespace, "app.kubernetes.io/component=agent", tmp_path / "pods", pythonpath=[str(installed)]
    )
    yield pods
    pods.stop()


def colocated(prompts: list[list[int]]) -> list[list[int]]:
    from pdfabric_refengine import build_model, colocated_generate

    model = build_model(0)
    return [colocated_generate(model, p, NEW_TOKENS) for p in prompts]


def router_targets(obj: dict[str, Any], runner: EnginePodRunner) -> tuple[PrefillEndpoint, str]:
    """The status' endpoints, as a router resolves them: here each engine's loopback ports stand
    in for its pod's DNS name and container ports."""
    (p,) = obj["status"]["endpoints"]["prefill"]
    (d,) = obj["status"]["endpoints"]["decode"]
    pe, de = runner.engine(p["pod"], p["container"]), runner.engine(d["pod"], d["container"])
    return PrefillEndpoint(pe.url, "127.0.0.1", pe.bootstrap_port), de.url


def test_pdcluster_serves_prompts_through_pd_and_survives_an_engine_kill(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, runner: EnginePodRunner
) -> None:
    gpu_nodes("srv", 2, gpus=4)
    builder = (
        pdcluster()
        .transport("tcp")
        .prefill(tp=2)
        .decode(tp=4)
        .model(**sg.REF_MODEL)
        .transfer(timeoutSeconds=8)
        .placement(nodeSelector=h.selector(namespace))
        .engine(**ENGINE)
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    obj = h.wait_ready(cluster, namespace, "pd")
    assert obj["status"]["engines"] == {"prefill": {"desired": 1, "ready": 1}, "decode": {"desired": 1, "ready": 1}}

    pods = runner.sync()
    assert len(pods) == 2  # prefill TP2 and decode TP4 each on a node of 4 GPUs
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=90, what="every agent ready")
    runner.wait_engines_healthy(timeout=120)
    assert sorted(c for _, c in runner.engines) == ["decode-0", "prefill-0"]
    prefill, decode_url = router_targets(obj, runner)

    # Prompts through PD, concurrently as a router sends them: tokens equal colocated generation.
    want = colocated(PROMPTS)
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: generate(prefill, decode_url, p, NEW_TOKENS, timeout_s=60), PROMPTS))
    assert [a.error for a in answers] == [""] * len(PROMPTS)
    assert [a.tokens for a in answers] == want
    assert [a.text for a in answers] == [detokenize(t) for t in want]
    # The bytes moved are the agents' to count (SGLang's KVTransferMetric: the decode ranks').
    fabric = LocalFabric.from_cluster(cluster, namespace, "pd", runner)
    moved = sum(fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind=k) for k in ("kv", "aux"))
    reported = sum(m["bytes"] for a in answers for m in a.meta["kv_transfer"].values())
    assert reported == moved > 0

    # Kill the decode engine mid-traffic: every request answers (some with an error), none hangs.
    victim = runner.engine(obj["status"]["endpoints"]["decode"][0]["pod"], "decode-0")
    t0 = time.monotonic()

    def one(i: int) -> tuple[int, Answer, float]:
        time.sleep(0.15 * i)
        a = generate(prefill, decode_url, PROMPTS[i % len(PROMPTS)], NEW_TOKENS, timeout_s=60)
        return i, a, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(one, i) for i in range(18)]
        time.sleep(1.0)
        victim.kill()
        killed_at = time.monotonic() - t0
        results = [f.result(timeout=90) for f in futures]
    failed = [a for _, a, _ in results if not a.ok]
    assert failed, "no request was affected by the kill"
    assert all(a.error for a in failed)
    # No hang: a request whose peer died answers within its engine's timeout (10 s) and some slack.
    assert max(t for *_, t in results) < killed_at + 0.15 * 18 + 25, [round(t, 1) for *_, t in results]
    # What was answered before the kill, or by prefill alone, is right or an error, never wrong tokens.
    assert all(a.tokens == want[i % len(PROMPTS)] for i, a, _ in results if a.ok)

    # The engine comes back (the supervisor's backoff; its rank's buffers registered again once
    # the dead engine's rooms are over) and serves; prefill never restarted.
    h.wait_until(lambda: victim.restarts >= 1 and victim.healthy(), timeout=120, what="decode-0 restarted and healthy")
    assert victim.exit_codes[0] == -9
    assert runner.engine(prefill_pod(obj), "prefill-0").restarts == 0
    again = [generate(prefill, decode_url, p, NEW_TOKENS, timeout_s=60) for p in PROMPTS]
    assert [a.error for a in again] == [""] * len(PROMPTS)
    assert [a.tokens for a in again] == want


def prefill_pod(obj: dict[str, Any]) -> str:
    return str(obj["status"]["endpoints"]["prefill"][0]["pod"])
