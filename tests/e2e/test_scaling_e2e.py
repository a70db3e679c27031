"""Live scaling of a serving PDCluster (issue 26): decode 1 -> 3, prefill 1 -> 2, decode 3 -> 1
while prompts stream, in two shapes (a node per replica; every rank on one node). In the node per
replica shape, once every node is full, decode is scaled one past the nodes and then to 1,024 (an
HPA's overshoot, issue 40): what runs keeps running, untouched, and the rest waits for room.

Real parts: the control plane, the operator under the chart's RBAC reading the agents' /readyz,
the node pods' real command run by PodRunner with its kubelet loop (pods the operator adds
start, deleted ones stop, a changed rank-map ConfigMap is rewritten into the running pods'
volumes), the agents running the reference engine (a small Llama from a seed) with SGLang's
pdfabric classes, prompts sent as SGLang's PD router sends them to the endpoints the PDCluster's
status lists as ready.

After each step: every prompt of the stream answered token-equal to colocated generation; the
pods of every unit that stayed kept their uid, their agent process and their engines' restart
counts; every (prefill, decode) replica pair serves a prompt, its rooms checksummed at both ends
(spec.transfer.verify); every agent runs the rank map the operator wrote, and the status said
whether they did while they moved."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from pdfabric_refengine.router import Answer, PrefillEndpoint, generate

from pdfabric_devcluster.podrunner import PodRunner
from tests.builders import pdcluster
from tests.deadlines import wait_until
from tests.e2e import node_pods
from tests.e2e.pd_runs import PROMPTS, REF_MODEL
from tests.integration import pdcluster_harness as h

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes

runner, operator = node_pods.runner, node_pods.operator

NEW_TOKENS = 8
STEPS = [(1, 3), (2, 3), (2, 1)]  # (prefill, decode) replicas after each step, from 1 and 1
# shape -> (nodes, GPUs each): a node per replica (at most 2 + 3), or all on one node
SHAPES = {"node-per-replica": (5, 1), "one-node": (1, 8)}
# shape -> the (prefill, decode) step that fills every node, and the decode counts then asked for
OVERSHOOT = {"node-per-replica": ((2, 3), (4, 1024))}


def colocated() -> dict[int, list[int]]:
    return dict(enumerate(node_pods.colocated(PROMPTS, NEW_TOKENS)))


@dataclass
class Sent:
    prompt: int
    pair: tuple[str, str]  # (prefill pod, decode pod)
    answer: Answer
    retries: int


@dataclass
class Stream:
    """Prompts sent back to back by two workers, each to the next (prefill, decode) pair of the
    endpoints the PDCluster's status lists as ready (read twice a second), as a PD router would.
    A request whose engine was not there any more (connection refused: its pod just left) is
    sent again to the next pair, as SGLang's router retries; nothing else is retried."""

    cluster: Any
    namespace: str
    runner: PodRunner
    sent: list[Sent] = field(default_factory=list)
    pairs: list[tuple[tuple[str, PrefillEndpoint], tuple[str, str]]] = field(default_factory=list)
    last_status: dict[str, Any] = field(default_factory=dict)  # its endpoints and conditions, last read
    stop: threading.Event = field(default_factory=threading.Event)
    broke: list[str] = field(default_factory=list)  # why a worker stopped early (it sends no more)

    def refresh(self) -> None:
        while not self.stop.is_set():
            try:
                status = h.pdc(self.cluster, self.namespace, "pd").get("status", {})
                self.pairs = endpoint_pairs(status, self.runner)
                self.last_status = {k: status.get(k) for k in ("endpoints", "conditions")}
            except Exception:  # the API server busy for a moment: keep the last view
                pass
            self.stop.wait(0.5)

    def work(self, worker: int) -> None:
        try:
            self._work(worker)
        except Exception as exc:  # a thread's exception is otherwise lost: the test reports it
            self.broke.append(f"worker {worker}, after {len(self.sent)} prompts: {exc!r}")

    def _work(self, worker: int) -> None:
        for n in itertools.count(worker, 2):
            if self.stop.is_set():
                return
            prompt = n % len(PROMPTS)
            retries = 0
            while True:
                pairs = self.pairs
                if not pairs:  # never while a step runs: the old replicas serve until the new ones do
                    raise AssertionError(f"the status listed no ready (prefill, decode) pair: {self.last_status}")
                (p_pod, prefill), (d_pod, decode_url) = pairs[(n + retries) % len(pairs)]
                answer = generate(prefill, decode_url, PROMPTS[prompt], NEW_TOKENS, timeout_s=60)
                if answer.ok or not _not_taken(answer) or retries == 3:
                    break
                retries += 1
                time.sleep(0.5)
            self.sent.append(Sent(prompt, (p_pod, d_pod), answer, retries))

    def __enter__(self) -> Stream:
        self.pairs = endpoint_pairs(h.pdc(self.cluster, self.namespace, "pd")["status"], self.runner)
        self.threads = [threading.Thread(target=self.refresh, daemon=True)]
        self.threads += [threading.Thread(target=self.work, args=(w,), daemon=True) for w in range(2)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def _not_taken(answer: Answer) -> bool:
    """Neither engine took the request: one of them was not listening (its pod had just left)."""
    return 0 in answer.status.values() and "refused" in answer.error.lower()


def endpoint_pairs(
    status: dict[str, Any], runner: PodRunner
) -> list[tuple[tuple[str, PrefillEndpoint], tuple[str, str]]]:
    """Every (prefill, decode) pair of engines the status lists as ready, at their loopback ports."""
    eps = status.get("endpoints") or {}
    prefills, decodes = [], []
    for ep in eps.get("prefill", []):
        if ep.get("ready") and (ep["pod"], ep["engine"]) in runner.engines:
            e = runner.engine(ep["pod"], ep["engine"])
            prefills.append((ep["pod"], PrefillEndpoint(e.url, "127.0.0.1", e.bootstrap_port)))
    for ep in eps.get("decode", []):
        if ep.get("ready") and (ep["pod"], ep["engine"]) in runner.engines:
            decodes.append((ep["pod"], runner.engine(ep["pod"], ep["engine"]).url))
    return [(p, d) for p in prefills for d in decodes]


def units(cluster: Any, namespace: str) -> dict[str, dict[str, Any]]:
    """The node pods by their unit (prefill-0, decode-2): uid, and the ranks they hold."""
    out = {}
    for pod in h.agent_pods(cluster, namespace, "pd"):
        unit = pod["metadata"]["name"][len("pd-") :].rsplit("-", 1)[0]
        out[unit] = {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    return out


def life(runner: PodRunner, pod: str) -> tuple[int, int]:
    """The agent process of `pod` and its engines' restarts: what a restart would change."""
    agent = runner.pods[pod]
    assert agent.proc is not None
    _, body = agent.answered_readyz()
    return agent.proc.pid, sum(int(e.get("restarts", 0)) for e in body.get("engines", []))


def rankmap_digest(cluster: Any, namespace: str) -> str:
    cm = cluster.get_json("configmap", "pd-rankmap", "-n", namespace)
    return str(cm["metadata"]["annotations"]["pdfabric.dev/rankmap-hash"])


def settled(cluster: Any, namespace: str, prefill: int, decode: int, seen: list[tuple[str, str]] | None = None) -> bool:
    """The status says both roles serve at these counts on the rank map last written (each
    RankMapCurrent read goes into `seen`)."""
    obj = h.pdc(cluster, namespace, "pd")
    st = obj.get("status", {})
    current = h.condition(obj, "RankMapCurrent")
    ready = h.condition(obj, "Ready")
    if seen is not None and current is not None:
        seen.append((current["status"], current["message"]))
    return bool(
        ready is not None
        and ready["status"] == "True"
        and ready["reason"] != "RollingUpdate"
        and st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("prefillReady") == f"{prefill}/{prefill}"
        and st.get("decodeReady") == f"{decode}/{decode}"
        and current is not None
        and current["status"] == "True"
        and rankmap_digest(cluster, namespace) in current["message"]
    )


def short_of(cluster: Any, namespace: str, prefill: int, decode: int, asked: int) -> bool:
    """The status says prefill and decode serve at these counts, decode asked for `asked`, and
    the rest waits for room (Ready held, Placed PartiallyPlaced, status.unplaced)."""
    obj = h.pdc(cluster, namespace, "pd")
    st = obj.get("status", {})
    ready, placed = h.condition(obj, "Ready"), h.condition(obj, "Placed")
    return bool(
        ready is not None
        and ready["status"] == "True"
        and placed is not None
        and placed["reason"] == "PartiallyPlaced"
        and st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("prefillReady") == f"{prefill}/{prefill}"
        and st.get("decodeReady") == f"{decode}/{asked}"
        and (st.get("unplaced") or {}).get("decode") == asked - decode
    )


def overshoot(cluster: Any, namespace: str, runner: PodRunner, prefill: int, decode: int, asked: int) -> None:
    """Scale decode to `asked` through its PDRole: no pod replaced, added or restarted, the rank
    map as it was, the rest reported."""
    before = units(cluster, namespace)
    lives = {u: life(runner, x["name"]) for u, x in before.items()}
    digest = rankmap_digest(cluster, namespace)
    cluster.kubectl("scale", "pdrole/pd-decode", "--replicas", str(asked), "-n", namespace)
    wait_until(
        lambda: short_of(cluster, namespace, prefill, decode, asked),
        timeout=60,
        what=f"decode {asked} asked, {decode} placed",
    )
    time.sleep(2)  # the stream runs on while the rest waits
    assert units(cluster, namespace) == before
    assert {u: life(runner, x["name"]) for u, x in before.items()} == lives
    assert rankmap_digest(cluster, namespace) == digest
    placed = h.condition(h.pdc(cluster, namespace, "pd"), "Placed") or {}
    assert placed.get("message", "").startswith(f"{decode} of {asked} decode replicas placed: "), placed


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scaling_each_role_drops_no_prompt_and_restarts_no_pod_whose_ranks_stayed(
    shape: str, cluster: Any, namespace: str, gpu_nodes: Any, operator: Any, runner: PodRunner
) -> None:
    count, gpus = SHAPES[shape]
    gpu_nodes("sc", count, gpus=gpus)
    builder = (
        pdcluster()
        .transport("tcp")
        .prefill(tp=1)
        .decode(tp=1)
        .model(**REF_MODEL)
        # Every room byte-exact: a source checksums what it wrote, the decode agent what landed,
        # and the room is Success only when they match (rooms/integrity.py).
        .transfer(timeoutSeconds=8, verify=True)
        .placement(nodeSelector=h.selector(namespace))
        .engine(**node_pods.ENGINE)
    )
    want = colocated()
    h.apply_pdc(cluster, builder.manifest(), namespace)
    with runner.kubelet():
        wait_until(lambda: settled(cluster, namespace, 1, 1), timeout=240, what="1 prefill and 1 decode serving")
        observed: list[tuple[str, str]] = []  # RankMapCurrent as the status said it while steps ran
        with Stream(cluster, namespace, runner) as stream:
            for prefill, decode in STEPS:
                before = units(cluster, namespace)
                lives = {u: life(runner, x["name"]) for u, x in before.items()}
                cluster.kubectl(
                    "patch", "pdcluster", "pd", "-n", namespace, "--type", "merge", "-p",
                    json.dumps({"spec": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}}),
                )  # fmt: skip

                wait_until(
                    lambda p=prefill, d=decode: settled(cluster, namespace, p, d, observed),
                    timeout=240,
                    what=f"{prefill} prefill and {decode} decode serving",
                )
                after = units(cluster, namespace)
                expected = {f"prefill-{r}" for r in range(prefill)} | {f"decode-{r}" for r in range(decode)}
                assert set(after) == expected, after
                for unit in set(before) & set(after):  # stayed: the same pod, process and engines
                    assert after[unit]["uid"] == before[unit]["uid"], unit
                    assert life(runner, after[unit]["name"]) == lives[unit], unit
                # Every agent runs the map the operator wrote (what RankMapCurrent said).
                digest = rankmap_digest(cluster, namespace)
                for x in after.values():
                    _, body = runner.pods[x["name"]].answered_readyz()
                    assert body.get("rankmap") == digest, (x["name"], body)
                # Every replica pair serves.
                pairs = endpoint_pairs(h.pdc(cluster, namespace, "pd")["status"], runner)
                assert len(pairs) == prefill * decode
                for (p_pod, p_ep), (d_pod, d_url) in pairs:
                    answer = generate(p_ep, d_url, PROMPTS[0], NEW_TOKENS, timeout_s=60)
                    assert (answer.error, answer.tokens) == ("", want[0]), (p_pod, d_pod)
                time.sleep(2)  # the stream runs on the new shape for a while
                full, asks = OVERSHOOT.get(shape, ((0, 0), ()))
                for asked in asks if full == (prefill, decode) else ():
                    overshoot(cluster, namespace, runner, prefill, decode, asked)
    sent = stream.sent
    behind = sum(1 for status, _ in observed if status == "False")
    print(  # the numbers a closing note quotes (pytest -rP shows them)
        f"{shape}: {len(sent)} prompts, {sum(s.answer.ok for s in sent)} answered, "
        f"{sum(s.retries for s in sent)} resent after a refused connection, {len({s.pair for s in sent})} pairs used; "
        f"RankMapCurrent read {len(observed)} times during the steps, False {behind} times"
    )
    assert not stream.broke, stream.broke
    failed = [(s.pair, s.answer.error[:200]) for s in sent if not s.answer.ok]
    assert not failed, failed
    assert all(s.answer.tokens == want[s.prompt] for s in sent)
    assert len(sent) >= 20, len(sent)
    assert len({s.pair for s in sent}) >= 4  # the stream used the new replicas too
    # The status said the agents were behind while they were, and current once they were not.
    assert observed and observed[-1][0] == "True"
