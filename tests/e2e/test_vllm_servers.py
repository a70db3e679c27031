"""vLLM's own servers run PD over pdfabric: ``vllm.entrypoints.openai.api_server`` (vLLM's CPU
engine, its scheduler, its KV connector machinery) as a prefill server (TP 1) and a decode server
(TP 2, a worker process per rank: the agents split each page's heads) with pdfabric's connector,
real agents on loopback tcp between them, vLLM's router in front. vLLM's NixlConnector runs the
same cases as the control (``CONNECTORS``). The other TP direction: test_vllm_shapes.py.

The model is the SGLang tests' seeded Llama with head_dim 32 (``pdfabric_vllmserver.servers.MODEL``),
whose tokens depend on the whole context: greedy answers through PD equal to one vLLM server's,
token for token, prove the KV arrived (decode recomputes only the prompt's last token)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdfabric_vllmserver.pd import CONNECTORS, Shape, VllmPD, behind_router
from pdfabric_vllmserver.servers import BLOCK_SIZE, MODEL, VllmServer, completion, token_ids
from tests.e2e.prompts import CONCURRENT, NEW_TOKENS, PROMPTS
from tests.e2e.vllm_servers import answer, python, single, vllm_model

__all__ = ["python", "single", "vllm_model"]  # the shared fixtures, used by name

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

# One page of the test model in vLLM's fused layout: 2 KV heads x 32 tokens x (K + V) 64 floats.
PAGE_BYTES = 2 * BLOCK_SIZE * 2 * MODEL.head_dim * 4
LAYERS = MODEL.layers
EXPOSED: dict[str, list[float]] = {}  # connector -> decode's time to its first token after prefill answered


SHAPE = Shape(prefill_tp=1, decode_tp=2)


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(
    request: pytest.FixtureRequest,
    python: str,
    vllm_model: Path,
    single: VllmServer,  # started first, to come up beside the pair
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmPD]:
    connector: str = request.param
    with behind_router(connector, python, vllm_model, tmp_path_factory.mktemp(f"vllm-{connector}"), SHAPE) as pd:
        yield pd


def decode_kv_bytes(pd: VllmPD) -> float:
    assert pd.fabric is not None
    return pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")


def wait_kv_bytes(pd: VllmPD, before: float, want: int) -> float:
    deadline = time.monotonic() + 10
    while (moved := decode_kv_bytes(pd) - before) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return moved


def test_the_models_tokens_depend_on_the_kv(single: VllmServer) -> None:
    """The premise of every equality below: two prompts that end alike but differ before go on
    differently, so decode's tokens depend on the KV it was given."""
    assert answer(single, [5, 6, 7, 8, 9, 9]) != answer(single, [100, 120, 30, 40, 9, 9])


def test_pd_answers_equal_a_single_server_token_for_token(pd: VllmPD, single: VllmServer) -> None:
    for prompt in PROMPTS:
        want = answer(single, prompt)
        status, got = pd.complete(completion(prompt, NEW_TOKENS))
        assert status == 200, (pd.connector, got, pd.decode.tail(), pd.prefill.tail())
        assert token_ids(got) == want, (pd.connector, len(prompt))
        assert len(want) == NEW_TOKENS


def test_pd_16_concurrent_requests_equal_a_single_server(pd: VllmPD, single: VllmServer) -> None:
    want = [answer(single, p) for p in CONCURRENT]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: pd.complete(completion(p, NEW_TOKENS), 240), CONCURRENT))
    assert [s for s, _ in answers] == [200] * len(CONCURRENT), [a for s, a in answers if s != 200][:2]
    assert [token_ids(a) for _, a in answers] == want


def test_pd_moves_the_prompts_pages_through_the_agents(pd: VllmPD) -> None:
    """pdfabric's decode agent counted exactly the prompt's pages, half of each page's heads for each
    of its two ranks (NIXL has no such counter)."""
    if pd.fabric is None:
        pytest.skip("vLLM's NixlConnector exports no per-request byte counter here")
    before = decode_kv_bytes(pd)
    prompt = [(i * 19) % 240 + 7 for i in range(100)]  # 100 tokens: 4 pages of 32
    want = -(-100 // BLOCK_SIZE) * PAGE_BYTES * LAYERS
    assert pd.complete(completion(prompt, 4))[0] == 200
    assert wait_kv_bytes(pd, before, want) == want


def test_the_connectors_stats_reach_vllms_own_logger(pd: VllmPD) -> None:
    """vLLM's stats logger prints each connector's transfer stats of the interval: pdfabric's rooms,
    bytes and durations (get_kv_connector_stats, aggregated over the workers by vLLM)."""
    if pd.fabric is None:
        pytest.skip("pdfabric's stats; NIXL logs its own")
    assert pd.complete(completion(list(range(3, 90)), 4))[0] == 200
    deadline = time.monotonic() + 15
    while "KV Transfer metrics: Rooms=" not in pd.decode.tail(200_000):
        assert time.monotonic() < deadline, pd.decode.tail(3000)
        time.sleep(0.5)
    line = [x for x in pd.decode.tail(200_000).splitlines() if "KV Transfer metrics: Rooms=" in x][-1]
    assert "Failed rooms=0" in line and "KV MB moved=" in line, line


def test_decode_prefix_cache_takes_only_the_pages_after_it(pd: VllmPD, single: VllmServer) -> None:
    """Decode's prefix cache holds a 96-token prompt (3 pages); the same prompt with 40 tokens more
    is prefilled whole, decode loads only the pages after its cached prefix, and answers the single
    server's tokens."""
    base = [(i * 29) % 241 + 3 for i in range(96)]
    longer = base + [(i * 17) % 233 + 5 for i in range(40)]
    before = decode_kv_bytes(pd) if pd.fabric else 0.0
    for prompt in (base, longer):
        want = answer(single, prompt)
        mid = decode_kv_bytes(pd) if pd.fabric else 0.0
        status, got = pd.complete(completion(prompt, NEW_TOKENS))
        assert status == 200, (pd.connector, got)
        assert token_ids(got) == want, (pd.connector, len(prompt))
    if pd.fabric is not None:
        # The second prompt's 136 tokens are 5 pages; 3 are decode's already: 2 move.
        assert wait_kv_bytes(pd, mid, 2 * PAGE_BYTES * LAYERS) == 2 * PAGE_BYTES * LAYERS
        assert decode_kv_bytes(pd) - before == (3 + 2) * PAGE_BYTES * LAYERS


def kv_usage(server: VllmServer) -> float:
    """vLLM's own gauge of the KV cache in use (0..1), from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")
    )


def wait_no_kv_in_use(server: VllmServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (usage := kv_usage(server)) > 0:
        assert time.monotonic() < deadline, f"{server.name} still holds {usage:.2%} of its KV cache"
        time.sleep(0.3)


def test_a_decode_request_given_up_while_its_kv_is_awaited_frees_its_pages(pd: VllmPD, single: VllmServer) -> None:
    """A decode request whose KV never comes (its params name a room no prefill holds) waits in
    WAITING_FOR_REMOTE_KVS; its client gives up, vLLM aborts it, the connector gives the room up and
    vLLM frees its pages once the agent says no source writes into them. Both servers then hold no
    KV, and serve on."""
    if pd.fabric is None:
        pytest.skip("the room of a prefill that never sends is pdfabric's (NIXL names remote blocks)")
    prompt = list(range(10, 110))
    params = {
        "do_remote_prefill": True,
        "pdfabric": {"room": 4242, "prefill_replica": 0, "prefill_dp": 0, "num_tokens": 100},
    }
    status, _ = pd.decode.complete(completion(prompt, 4, kv_transfer_params=params), timeout_s=3.0)
    assert status != 200  # the client gave up after 3 s
    wait_no_kv_in_use(pd.decode)
    wait_no_kv_in_use(pd.prefill)
    assert token_ids(pd.complete(completion(prompt, NEW_TOKENS))[1]) == answer(single, prompt)


def test_exposed_time_after_prefill_is_measured_the_same_way_for_both(pd: VllmPD) -> None:
    """How long decode takes to its first token once prefill answered (the KV's transfer and one
    step), the router's two steps taken by hand, for the closing table of both connectors."""
    samples = []
    for i in range(5):
        prompt = [(i * 31 + j * 7) % 250 + 1 for j in range(300)]
        status, first = pd.prefill.complete(completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
        assert status == 200, first
        started = time.monotonic()
        status, got = pd.decode.complete(completion(prompt, 1, kv_transfer_params=first["kv_transfer_params"]))
        samples.append(time.monotonic() - started)
        assert status == 200, got
    EXPOSED[pd.connector] = samples
    print(f"\n{pd.connector}: decode's first token after prefill answered, 300-token prompts: "
          + ", ".join(f"{s * 1000:.0f} ms" for s in samples))  # fmt: skip


# How long a client waits for a request whose prefill server was killed: past the agents' room
# deadline (transfer.timeoutSeconds 20, after which decode's room fails and vLLM answers an error).
KILLED_ANSWER_S = 60.0


def test_prefill_server_killed_fails_its_requests_then_serves_after_restart(pd: VllmPD, single: VllmServer) -> None:
    """Four clients send prompts one after another; the prefill server dies among them. Every request
    answers (none hangs); those before the kill equal the single server's, those after it fail
    with an error and none answers wrong tokens; the decode server lives on; the restarted prefill
    serves equal answers again."""
    prompts = [[(i * 7 + j * 3) % 250 + 1 for j in range(150)] for i in range(8)]
    want = {tuple(p): answer(single, p) for p in prompts}
    stop, answered = threading.Event(), threading.Event()

    def client(k: int) -> list[tuple[list[int], int, dict[str, Any]]]:
        seen = []
        i = k
        while not stop.is_set():
            prompt = prompts[i % len(prompts)]
            status, body = pd.complete(completion(prompt, NEW_TOKENS), KILLED_ANSWER_S)
            seen.append((prompt, status, body))
            if status == 200:
                answered.set()
            i += 4
        return seen

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, k) for k in range(4)]
        # Requests answered before the kill: waited for, not slept on (a loaded machine once took
        # NIXL's pair past a fixed 2 s, and every request then failed after the kill).
        if not answered.wait(KILLED_ANSWER_S):
            stop.set()
            pytest.fail(f"{pd.connector}: no request answered within {KILLED_ANSWER_S:g} s before the kill")
        time.sleep(0.5)  # more in flight
        pd.prefill.kill()
        time.sleep(1.0)  # requests sent to a dead prefill
        stop.set()
        answers = [a for f in futures for a in f.result(timeout=KILLED_ANSWER_S * 3)]
    ok = [(p, b) for p, s, b in answers if s == 200]
    failed = [s for _, s, _ in answers if s != 200]
    assert ok and failed, (len(ok), failed)
    assert all(token_ids(b) == want[tuple(p)] for p, b in ok)  # no wrong answer
    assert pd.decode.proc.poll() is None  # the decode server lives on
    pd.prefill.restart()
    pd.prefill.wait_healthy()
    deadline = time.monotonic() + 120
    while True:  # the router takes the prefill back once its health checks pass
        status, body = pd.complete(completion(prompts[0], NEW_TOKENS), KILLED_ANSWER_S)
        if status == 200:
            assert token_ids(body) == want[tuple(prompts[0])]
            break
        assert time.monotonic() < deadline, (status, body)
        time.sleep(2.0)
