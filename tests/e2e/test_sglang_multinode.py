"""One replica over two nodes (issue 45): SGLang's own CPU servers, prefill TP 2 and decode TP 2 each
split over two node pods on two nodes (``nodesPerReplica: 2``: node ranks 0 and 1, SGLang's
``--nnodes/--node-rank/--dist-init-addr`` from the operator's launch), pdfabric as the transfer
backend, SGLang's router in front.

kubectl apply of examples/sglang changed to that shape -> the operator's four node pods (a block of
each replica per node, the leaders' rendezvous ports under the headless Service) and the router's
Deployment -> their real commands as local processes (PodRunner; each agent starts its node rank's
SGLang server, the followers' rendezvous resolved to the leader's loopback port as the cluster DNS
would) -> prompts to the router -> greedy tokens equal to a single SGLang server's of TP 2 (one process), sequential
and 16 concurrent; every rank's KV moved through its own node's agent; the status lists one endpoint
per replica (its leader) and the router only those.

Then the engine of the prefill group's second node rank is killed (its pod stays, its agent restarts
it): the operator, reading the restart in the agent's /readyz, deletes the group's pods, both node
ranks start again and form the group anew (a pod of a group deleted: test_pdcluster_groups.py),
prompts sent meanwhile answer right or fail with an error (none hangs), and prompts after the
restart are token-equal again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner

from pdfabric_devcluster.fabric import Fabric
from pdfabric_devcluster.podrunner import PodRunner
from pdfabric_devcluster.timings import record
from pdfabric_sglangserver.pd import example_pdcluster, tokens
from pdfabric_sglangserver.servers import SGLangServer, greedy, reference_server
from tests.e2e import node_pods
from tests.e2e.prompts import CONCURRENT, NEW_TOKENS, PROMPTS
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes
operator = node_pods.operator

NAME = "sglang"
START_S = 420  # four SGLang processes (two groups of two) starting at once on two cores
REQUEST_S = 150  # a prompt sent while a group restarts: answered or refused within it, never left hanging
GROUP_ARGS = [
    "--tp-size", "$(PDFABRIC_TP)",
    "--nnodes", "$(PDFABRIC_NNODES)", "--node-rank", "$(PDFABRIC_NODE_RANK)",
    "--dist-init-addr", "$(PDFABRIC_DIST_INIT_ADDR)",
]  # fmt: skip
# SGLang's CPU engine asks for each rank's cores when ranks outnumber NUMA nodes (each node rank's
# process holds one rank here: both cores), and this venv's CUDA-built torch would load NCCL for
# its groups (servers.parallel_env says why): gloo, SGLang's CPU fallback, carries them.
GROUP_ENV = [
    {"name": "SGLANG_CPU_OMP_THREADS_BIND", "value": "0-1"},
    {"name": "SGLANG_NCCL_SO_PATH", "value": "/nonexistent/libnccl.so.2"},
]


@pytest.fixture
def example(model_dir: Path, namespace: str) -> dict[str, Any]:
    doc = example_pdcluster(model_dir)
    spec = doc["spec"]
    spec["placement"] = {"nodeSelector": h.selector(namespace)}
    # A prompt that meets the killed group fails at once instead of being retried against the
    # leader's pod while it restarts (SGLang's router retries 5 times by default).
    spec["router"]["args"] = [*spec["router"].get("args", []), "--disable-retries"]
    for role in ("prefill", "decode"):
        spec[role] = {"tp": 2, "nodesPerReplica": 2}
        engine = spec["engine"][role]
        engine["args"] = [*engine["args"], *GROUP_ARGS]
        engine["env"] = [*engine["env"], *GROUP_ENV]
    return doc


@pytest.fixture(scope="module")
def single_tp2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """One SGLang server of TP 2 in one process: the answers a replica of TP 2 over two nodes must
    equal (a TP 1 server's bfloat16 sums differ: one token of the 700-token prompt turns)."""
    with reference_server("single-tp2", model_dir, tmp_path_factory.mktemp("single-tp2"), tp=2) as server:
        yield server


runner = node_pods.runner  # the pods' commands, engines with pdfabric installed as a user installs it


def test_replicas_over_two_nodes_answer_equal_a_single_sglang_server(
    cluster: Any,
    namespace: str,
    gpu_nodes: Any,
    operator: KopfRunner,
    runner: PodRunner,
    example: dict[str, Any],
    single_tp2: SGLangServer,
) -> None:
    gpu_nodes("mn", 2, gpus=2)
    h.apply_pdc(cluster, example, namespace)
    h.wait_until(lambda: len(h.agent_pods(cluster, namespace, NAME)) == 4, timeout=60, what="a node pod per block")
    pods = runner.sync()
    by_node: dict[str, list[str]] = {}
    for pod in h.agent_pods(cluster, namespace, NAME):
        by_node.setdefault(pod["metadata"]["labels"]["pdfabric.dev/node"], []).append(pod["metadata"]["name"])
    assert sorted(len(v) for v in by_node.values()) == [2, 2], by_node  # one block of each group per node
    started = time.monotonic()
    h.wait_until(lambda: all(p.ready() for p in pods.values()), timeout=START_S, what="the agents and SGLang groups")
    runner.wait_engines_healthy(timeout=60)
    record("sglang group of two node ranks start (to healthy)", time.monotonic() - started)

    h.wait_until(
        lambda: node_pods.router_pods_scheduled(cluster, namespace), timeout=60, what="the router pod scheduled"
    )
    (router,) = runner.start_routers()
    router.wait_healthy(120, ready=True)
    obj = h.wait_ready(cluster, namespace, NAME, timeout=120)
    status = obj["status"]
    assert (status["prefillEnginesReady"], status["decodeEnginesReady"]) == ("1/1", "1/1")
    leaders = {role: [e["pod"] for e in status["endpoints"][role]] for role in ("prefill", "decode")}
    assert all(len(v) == 1 for v in leaders.values()), leaders  # one worker per replica: its leader

    for prompt in PROMPTS:
        want = tokens(single_tp2.generate(greedy(prompt, NEW_TOKENS))[1])
        code, got = router.generate(greedy(prompt, NEW_TOKENS))
        assert code == 200, got
        assert tokens(got) == want, len(prompt)
    want_all = [tokens(single_tp2.generate(greedy(p, NEW_TOKENS))[1]) for p in CONCURRENT]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: router.generate(greedy(p, NEW_TOKENS), 240), CONCURRENT))
    assert [c for c, _ in answers] == [200] * len(CONCURRENT), [a for c, a in answers if c != 200][:2]
    assert [tokens(a) for _, a in answers] == want_all

    # Every rank moved its own share through its own node's agent: both prefill ranks sent, both
    # decode ranks received, each counted by the agent of the pod that holds it.
    fabric = Fabric.from_cluster(cluster, namespace, NAME, runner)
    for role, rank in (("prefill", "prefill-0-tp0-cp0"), ("prefill", "prefill-0-tp1-cp0")):
        assert fabric.metric_sum("pdfabric_peer_transfer_bytes_total", role=role, rank=rank) > 0, rank
    for rank in ("decode-0-tp0", "decode-0-tp1"):
        assert fabric.metric_sum("pdfabric_peer_transfer_bytes_total", role="decode", rank=rank) > 0, rank

    # The engine of one node rank of the prefill group dies (its pod stays): the group restarts whole.
    group = {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.agent_pods(cluster, namespace, NAME)}
    (leader,) = leaders["prefill"]
    (follower,) = [n for n in group if n.startswith(f"{NAME}-prefill-0-") and n != leader]
    (victim,) = [e for (pod, _), e in runner.engines.items() if pod == follower]
    with runner.kubelet():
        victim.kill()  # its agent restarts it, but the group it belonged to is dead
        meanwhile = []
        for prompt in PROMPTS[:4]:
            sent = time.monotonic()
            code, got = router.generate(greedy(prompt, NEW_TOKENS), REQUEST_S)
            meanwhile.append((code, tokens(got), time.monotonic() - sent))
        restarted = time.monotonic()

        def anew() -> bool:
            now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.agent_pods(cluster, namespace, NAME)}
            # Replaced in the API and started by the runner (its kubelet loop may not have yet).
            fresh = all(
                now.get(n) not in (None, group[n]) and n in runner.pods and runner.pods[n].uid == now[n]
                for n in (leader, follower)
            )
            return fresh and all(p.ready() for p in runner.pods.values())

        h.wait_until(anew, timeout=START_S, what="both prefill node ranks replaced and serving again")
        runner.wait_engines_healthy(timeout=120)
        h.wait_ready(cluster, namespace, NAME, timeout=120)
        record("sglang group restart (a node rank's engine killed, to ready)", time.monotonic() - restarted)
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=GroupRestart").stdout
        assert f"the engine in pod {follower} restarted" in events, events
        # The decode group was not touched for the prefill's sake: it restarts only for a restart of
        # its own (on these busy cores an agent may restart a decode engine whose probe timed out).
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.agent_pods(cluster, namespace, NAME)}
        decode_restarted = [n for n in events.splitlines() if f"{NAME}-decode-0-" in n]
        assert decode_restarted or all(now[n] == uid for n, uid in group.items() if n.startswith(f"{NAME}-decode-0-"))
        assert all("decode-0:" in line for line in decode_restarted), decode_restarted
        for code, got, took in meanwhile:  # answered right, or failed saying so; none hung
            assert took < REQUEST_S, took
            assert code != 200 or got in [tokens(single_tp2.generate(greedy(p, NEW_TOKENS))[1]) for p in PROMPTS[:4]]
        router.wait_healthy(120, ready=True)
        for prompt in PROMPTS:
            code, got = router.generate(greedy(prompt, NEW_TOKENS))
            assert (code, tokens(got)) == (200, tokens(single_tp2.generate(greedy(prompt, NEW_TOKENS))[1]))
