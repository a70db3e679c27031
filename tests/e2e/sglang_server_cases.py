"""The server cases that ``test_sglang_servers`` (pdfabric on Mooncake, SGLang's Mooncake backend)
and ``test_sglang_servers_nixl`` (pdfabric on NIXL, SGLang's NIXL backend) both run, each module
with its own ``pd`` fixture: a test module imports no other (tests/unit/test_agent_layout.py), so
the cases they share live here, and each module takes them by name in the order it runs them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdfabric_devcluster.procs import post_json
from pdfabric_sglangserver.pd import PD, tokens
from pdfabric_sglangserver.servers import PAGE_SIZE, SGLangServer, greedy
from tests.e2e.prompts import CONCURRENT, NEW_TOKENS, PROMPTS

SPEC_ENGINE = "pdfabric-spec-engine"  # pdfabric, the servers run by the PDCluster's agents
# The servers the PDCluster's agents run are the same SGLang servers with the same plugin and agents
# as the pdfabric backend's; what differs is who starts, registers and restarts them. The cases
# below that exercise only what both share run on the pdfabric backend alone (each server set
# costs minutes of CPU on this machine).
SAME_AS_PDFABRIC = "the same servers, plugin and agents as the pdfabric backend, which runs this case"


def test_pd_answers_equal_a_single_server_token_for_token(pd: PD, single: SGLangServer) -> None:
    for prompt in PROMPTS:
        want_status, want = single.generate(greedy(prompt, NEW_TOKENS))
        assert want_status == 200, want
        status, got = pd.generate(greedy(prompt, NEW_TOKENS))
        assert status == 200, (pd.backend, got, pd.decode.tail(), pd.prefill.tail())
        assert tokens(got) == tokens(want), (pd.backend, len(prompt))
        assert len(tokens(got)) == NEW_TOKENS


def test_pd_16_concurrent_requests_equal_a_single_server(pd: PD, single: SGLangServer) -> None:
    if pd.backend == SPEC_ENGINE:
        pytest.skip(SAME_AS_PDFABRIC)
    want = [tokens(single.generate(greedy(p, NEW_TOKENS))[1]) for p in CONCURRENT]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda p: pd.generate(greedy(p, NEW_TOKENS), 240), CONCURRENT))
    assert [s for s, _ in answers] == [200] * len(CONCURRENT), [a for s, a in answers if s != 200][:2]
    assert [tokens(a) for _, a in answers] == want


def test_pd_moves_kv_through_the_agents(pd: PD) -> None:
    """pdfabric's agents counted the KV of the requests (Mooncake has no such counter)."""
    if pd.fabric is None:
        pytest.skip("SGLang's own backends export no per-request byte counters")
    before = pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
    prompt = list(range(1, 101))
    status, _ = pd.generate(greedy(prompt, 4))
    assert status == 200
    deadline = time.monotonic() + 10
    # 100 tokens are 7 pages of 16: 112 token rows x 2 layers x (K + V) x 2 KV heads x 16 head
    # dim x 2 bytes (bfloat16); whole pages move, as with SGLang's own backends
    want = -(-100 // PAGE_SIZE) * PAGE_SIZE * 2 * 2 * 2 * 16 * 2
    while pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") - before < want:
        assert time.monotonic() < deadline, "the decode agent did not count the request's KV"
        time.sleep(0.2)
    assert pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") - before == want


def test_decode_radix_prefix_moves_only_the_pages_after_it(pd: PD, single: SGLangServer) -> None:
    """Decode's radix cache holds a 64-token prompt (4 pages); the same prompt with 40 tokens more
    is prefilled whole but moves only the 3 pages after the cached prefix, and decodes the single
    server's tokens."""
    base = [(i * 29) % 241 + 3 for i in range(64)]
    longer = base + [(i * 17) % 233 + 5 for i in range(40)]
    for prompt in (base, longer):
        want = tokens(single.generate(greedy(prompt, NEW_TOKENS))[1])
        kv_before = pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") if pd.fabric else 0
        status, got = pd.generate(greedy(prompt, NEW_TOKENS))
        assert status == 200, (pd.backend, got)
        assert tokens(got) == want, (pd.backend, len(prompt))
    if pd.fabric is not None:
        page_bytes = PAGE_SIZE * 2 * 2 * 2 * 16 * 2  # 16 tokens x 2 layers x (K + V) x 2 heads x 16 dim x 2 bytes
        deadline = time.monotonic() + 10
        while (
            moved := pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") - kv_before
        ) < 3 * page_bytes:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert moved == 3 * page_bytes, f"{moved / page_bytes:g} pages moved for the second prompt, want 3"


# How long a client waits for a request whose server was killed: 2-3x what the slowest live request
# takes on a busy machine. The router runs without retries (pdfabric_sglangserver.pd.behind_router)
# and answers one whose decode died at once; one whose prefill died while its decode waits for the
# KV answers when the decode side gives up (for a prefill server started here rather than by its
# agent, nothing tells the agent the engine died: its deadline), or the client gives up first.
KILLED_ANSWER_S = 60.0


def wait_serving(pd: PD, want: list[int], prompt: list[int], timeout_s: float = 180.0) -> None:
    """Until a request through the router answers ``want`` again (the router re-admits a worker
    after its health checks pass)."""
    deadline = time.monotonic() + timeout_s
    last: tuple[int, dict[str, Any]] = (0, {})
    while time.monotonic() < deadline:
        last = pd.generate(greedy(prompt, NEW_TOKENS), 60)
        if last[0] == 200:
            assert tokens(last[1]) == want, pd.backend
            return
        time.sleep(2.0)
    raise AssertionError(f"{pd.backend}: no answer after the restart within {timeout_s:g} s: {last}")


def test_decode_server_killed_mid_traffic_fails_its_requests_then_serves_after_restart(
    pd: PD, single: SGLangServer
) -> None:
    """Long generations are in decode when its server dies: none answers 200 (SGLang's router
    answers each with an error), and the restarted server (same port) serves equal answers again."""
    long_prompts = [[(i * 11 + j) % 250 + 1 for j in range(30)] for i in range(4)]
    # SGLang's own test knob: decode sleeps 50 ms per forward, so 400 tokens take over 20 s and
    # the kill lands mid-generation however fast the machine (a quiet CI machine once finished
    # three unslowed ones within the 4 s); the killed server forgets it. The client waits
    # KILLED_ANSWER_S, well past what the generations take unkilled (a 200 then fails the test).
    assert post_json(pd.decode.url + "/slow_down", {"forward_sleep_time": 0.05}, 10)[0] == 200
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(pd.generate, greedy(p, 400), KILLED_ANSWER_S) for p in long_prompts]
            time.sleep(4.0)  # the requests are decoding
            pd.decode.kill()
            answers = [f.result(timeout=KILLED_ANSWER_S + 30) for f in futures]
        assert all(status != 200 for status, _ in answers), [s for s, _ in answers]
    finally:  # the module's later cases share this pair: never leave them a dead server
        pd.decode.recover()
    prompt = PROMPTS[1]
    wait_serving(pd, tokens(single.generate(greedy(prompt, NEW_TOKENS))[1]), prompt)


def test_prefill_agent_killed_fails_requests_then_restarted_agent_serves(pd: PD, single: SGLangServer) -> None:
    """The prefill node's agent dies: requests fail with an error and both servers live on; the
    restarted agent lost the engine's registration, so the engine registers again on its next
    room (the agent refuses a room for memory it does not hold) and answers are equal again."""
    if pd.fabric is None:
        pytest.skip("SGLang's own backends have no node agent")
    if pd.backend == SPEC_ENGINE:
        pytest.skip("with spec.engine the agent is the node pod's process: its death is the pod's")
    agent = pd.fabric.agent_of("prefill-0-tp0-cp0")
    pd.fabric.kill(agent)
    prompt = PROMPTS[2]
    status, answer = pd.generate(greedy(prompt, NEW_TOKENS), 150)
    assert status != 200, answer
    assert pd.prefill.healthy() and pd.decode.healthy()
    pd.fabric.start(agent)
    wait_serving(pd, tokens(single.generate(greedy(prompt, NEW_TOKENS))[1]), prompt)
