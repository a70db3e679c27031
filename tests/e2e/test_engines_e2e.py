"""A PDCluster that serves (issue 12): kubectl apply of a PDCluster with spec.engine -> the
operator's node pods (one container: the agent, which runs one engine process per replica on its
node) -> the container's real command as a local process (PodRunner; the agent starts the
reference engine's serving front with SGLang's pdfabric classes) -> prompts sent as SGLang's PD
router sends them (the same bootstrap room to the prefill and the decode endpoint of the status)
-> greedy tokens equal to colocated generation. Then the decode engine and then the prefill
engine are killed mid-traffic: their requests fail with an error answer, none hangs, the agent
restarts the engine with backoff, the PDCluster's status reports the restart, and it serves again."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pdfabric_refengine.router import Answer, PrefillEndpoint, generate
from pdfabric_refengine.server import detokenize

from pdfabric_agent.engines.sandbox import landlock_abi
from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import LocalEngine, PodRunner
from tests.builders import pdcluster
from tests.e2e import node_pods, pd_runs
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes
runner, operator = node_pods.runner, node_pods.operator

PROMPTS = pd_runs.PROMPTS
NEW_TOKENS = node_pods.NEW_TOKENS
ENGINE, colocated = node_pods.ENGINE, node_pods.colocated


def router_targets(obj: dict[str, Any], runner: PodRunner) -> tuple[PrefillEndpoint, str]:
    """The status' endpoints, as a router resolves them: here each engine's loopback ports stand
    in for its pod's DNS name and container ports."""
    (p,) = obj["status"]["endpoints"]["prefill"]
    (d,) = obj["status"]["endpoints"]["decode"]
    pe, de = runner.engine(p["pod"], p["engine"]), runner.engine(d["pod"], d["engine"])
    return PrefillEndpoint(pe.url, "127.0.0.1", pe.bootstrap_port), de.url


def endpoint(cluster: Any, namespace: str, role: str) -> dict[str, Any]:
    (ep,) = cluster.get_json("pdcluster", "pd", "-n", namespace)["status"]["endpoints"][role]
    return dict(ep)


def kill_mid_traffic(
    victim: LocalEngine, prefill: PrefillEndpoint, decode_url: str, want: list[list[int]]
) -> list[tuple[int, Answer, float]]:
    """18 requests a router sends 0.15 s apart; the victim is SIGKILLed after 1 s. Every request
    answers (some with an error), none hangs, none with wrong tokens."""

    def one(i: int) -> tuple[int, Answer, float]:
        time.sleep(0.15 * i)
        start = time.monotonic()
        a = generate(prefill, decode_url, PROMPTS[i % len(PROMPTS)], NEW_TOKENS, timeout_s=60)
        return i, a, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(one, i) for i in range(18)]
        time.sleep(1.0)
        victim.kill()
        results = [f.result(timeout=120) for f in futures]
    failed = [a for _, a, _ in results if not a.ok]
    assert failed, f"no request was affected by the kill of {victim.name}"
    assert all(a.error for a in failed)
    # No hang: each request answers within its engines' timeout (10 s) and some slack, whether it
    # met the dead engine, its restart, or neither.
    assert max(t for *_, t in results) < 10 + 15, [(round(t, 1), a.error[:80]) for _, a, t in results]
    # What was answered before the kill, or by the other engine alone, is right or an error.
    assert all(a.tokens == want[i % len(PROMPTS)] for i, a, _ in results if a.ok)
    return results


def comes_back(cluster: Any, namespace: str, victim: LocalEngine, role: str, restarts: int) -> None:
    """The agent restarted the engine (its backoff), it serves, and the PDCluster says so."""

    def back() -> bool:
        st, ep = victim.state(), endpoint(cluster, namespace, role)
        return bool(st and st.restarts >= restarts and st.ready and ep["ready"] and ep["restarts"] >= restarts)

    h.wait_until(back, timeout=150, what=f"{victim.name} restarted, ready, and so in the status")
    st = victim.state()
    assert st is not None and "signal 9" in st.last_exit, st
    assert "signal 9" in endpoint(cluster, namespace, role)["lastExit"]


def test_pdcluster_serves_prompts_through_pd_and_survives_an_engine_kill(
    cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, runner: PodRunner
) -> None:
    gpu_nodes("srv", 2, gpus=4)
    builder = (
        pdcluster()
        .transport("tcp")
        .prefill(tp=2)
        .decode(tp=4)
        .model(**pd_runs.REF_MODEL)
        .transfer(timeoutSeconds=8)
        .placement(nodeSelector=h.selector(namespace))
        .engine(**ENGINE)
    )
    h.apply_pdc(cluster, builder.manifest(), namespace)
    h.wait_until(lambda: len(h.agent_pods(cluster, namespace, "pd")) == 2, timeout=60, what="two node pods")
    pods = runner.sync()
    assert len(pods) == 2  # prefill TP2 and decode TP4 each on a node of 4 GPUs
    assert sorted(name for _, name in runner.engines) == ["decode-0", "prefill-0"]
    # An agent is Ready (its /readyz 200, the pod's readiness) once its engines answer too.
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=180, what="every agent and engine ready")
    runner.wait_engines_healthy(timeout=30)
    obj = h.wait_ready(cluster, namespace, "pd", timeout=60)  # Ready waits for the engines too
    engines = obj["status"]["engines"]
    assert [(engines[r]["desired"], engines[r]["ready"], engines[r]["restarts"]) for r in ("prefill", "decode")] == [
        (1, 1, 0),
        (1, 1, 0),
    ]
    prefill, decode_url = router_targets(obj, runner)

    # Prompts through PD, concurrently as a router sends them: tokens equal colocated generation.
    want = colocated(PROMPTS)
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: generate(prefill, decode_url, p, NEW_TOKENS, timeout_s=60), PROMPTS))
    assert [a.error for a in answers] == [""] * len(PROMPTS)
    assert [a.tokens for a in answers] == want
    assert [a.text for a in answers] == [detokenize(t) for t in want]
    # The bytes moved are the agents' to count (SGLang's KVTransferMetric: the decode ranks').
    fabric = Fabric.from_cluster(cluster, namespace, "pd", runner)
    moved = sum(fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind=k) for k in ("kv", "aux"))
    reported = sum(m["bytes"] for a in answers for m in a.meta["kv_transfer"].values())
    assert reported == moved > 0
    # The engines served from the sandbox that hides the peer key (spec.engine.sandbox BestEffort,
    # on this machine's kernel when it has Landlock).
    sandboxed = fabric.metric_sum("pdfabric_serving_engine_sandboxed")
    assert sandboxed == (2 if landlock_abi()[0] >= 1 else 0), sandboxed
    # And the PDCluster's status says so per engine (the operator reads the agents' /readyz).
    claims = [e["sandboxed"] for r in ("prefill", "decode") for e in obj["status"]["endpoints"][r]]
    assert claims == [landlock_abi()[0] >= 1] * 2, obj["status"]["endpoints"]

    # Kill the decode engine mid-traffic, then (once it is back) the prefill engine.
    decode = runner.engine(endpoint(cluster, namespace, "decode")["pod"], "decode-0")
    prefill_engine = runner.engine(endpoint(cluster, namespace, "prefill")["pod"], "prefill-0")
    kill_mid_traffic(decode, prefill, decode_url, want)
    comes_back(cluster, namespace, decode, "decode", 1)
    before = prefill_engine.state()
    assert before is not None and before.restarts == 0  # prefill was not restarted for decode's death
    again = [generate(prefill, decode_url, p, NEW_TOKENS, timeout_s=60) for p in PROMPTS]
    assert [a.error for a in again] == [""] * len(PROMPTS)
    assert [a.tokens for a in again] == want

    kill_mid_traffic(prefill_engine, prefill, decode_url, want)
    comes_back(cluster, namespace, prefill_engine, "prefill", 1)
    again = [generate(prefill, decode_url, p, NEW_TOKENS, timeout_s=60) for p in PROMPTS]
    assert [a.error for a in again] == [""] * len(PROMPTS)
    assert [a.tokens for a in again] == want
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=EngineRestarted")["items"]
    messages = [e["message"] for e in events]
    assert any("decode-0" in m for m in messages) and any("prefill-0" in m for m in messages), messages
