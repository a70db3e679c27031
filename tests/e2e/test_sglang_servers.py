"""SGLang's own servers run PD over pdfabric: ``python -m sglang.launch_server`` (SGLang's CPU engine,
its scheduler, its PD queues) as a prefill and a decode server with ``--disaggregation-transfer-backend
pdfabric``, real agents on loopback tcp between them, SGLang's router in front. SGLang's own
Mooncake backend runs the same cases as the control (``BACKENDS``). The cases this module shares
with ``test_sglang_servers_nixl`` live in ``sglang_server_cases``.

The model is a small Llama with weights drawn from a seed (``pdfabric_sglangserver.model``), wide
enough that each token depends on the whole context (``test_the_models_tokens_depend_on_the_kv``):
greedy answers through PD equal to one SGLang server's answers token for token prove the KV, and
the first token carried in the metadata rows, arrived.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdfabric_devcluster.procs import post_json
from pdfabric_sglangserver.pd import PD, behind_router, pair_started_by_agents, pair_started_here, tokens
from pdfabric_sglangserver.servers import SGLangServer, greedy
from tests.e2e import sglang_server_cases as cases
from tests.e2e.prompts import NEW_TOKENS, PROMPTS
from tests.e2e.sglang_server_cases import KILLED_ANSWER_S, SAME_AS_PDFABRIC, SPEC_ENGINE, wait_serving
from tests.e2e.upstream import skip_known_wrong

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["mooncake", "pdfabric", SPEC_ENGINE]


@pytest.fixture(scope="module", params=BACKENDS)
def pd(
    request: pytest.FixtureRequest, model_dir: Path, installed_site: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PD]:
    """A prefill and a decode SGLang server over ``request.param``, and SGLang's router."""
    backend: str = request.param
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    pair = (
        pair_started_by_agents(model_dir, installed_site)
        if backend == SPEC_ENGINE
        else pair_started_here(backend, model_dir, installed_site, logs)
    )
    with behind_router(backend, pair, logs) as pd:
        yield pd


def test_the_models_tokens_depend_on_the_kv(single: SGLangServer) -> None:
    """The premise of every equality below: two prompts that end alike but differ before go on
    differently after their first token, so decode's tokens depend on the KV it was given."""
    tails = [
        tokens(single.generate(greedy([*head, 9, 9], NEW_TOKENS))[1])[1:] for head in ([5, 6, 7, 8], [100, 120, 30, 40])
    ]
    assert tails[0] != tails[1], tails


test_pd_answers_equal_a_single_server_token_for_token = cases.test_pd_answers_equal_a_single_server_token_for_token
test_pd_16_concurrent_requests_equal_a_single_server = cases.test_pd_16_concurrent_requests_equal_a_single_server
test_pd_moves_kv_through_the_agents = cases.test_pd_moves_kv_through_the_agents
test_decode_radix_prefix_moves_only_the_pages_after_it = cases.test_decode_radix_prefix_moves_only_the_pages_after_it
test_decode_server_killed_mid_traffic_fails_its_requests_then_serves_after_restart = (
    cases.test_decode_server_killed_mid_traffic_fails_its_requests_then_serves_after_restart
)


def test_prefill_server_killed_fails_its_requests_then_serves_after_restart(pd: PD, single: SGLangServer) -> None:
    """The prefill server dies under 12 requests in flight at once: every request answers (none
    hangs), those that fail fail with an error and none answers wrong tokens, the decode server
    lives on, and the restarted prefill serves equal answers again. (All at once: over SGLang's
    Mooncake backend each failed request waits out the client's KILLED_ANSWER_S, once rather than
    once per batch.)"""
    prompts = [[(i * 7 + j * 3) % 250 + 1 for j in range(200)] for i in range(12)]
    want = [tokens(single.generate(greedy(p, NEW_TOKENS))[1]) for p in prompts]
    decode_pid = pd.decode.pid()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(pd.generate, greedy(p, NEW_TOKENS), KILLED_ANSWER_S) for p in prompts]
            time.sleep(0.3)  # the first requests are in prefill's queues
            pd.prefill.kill()
            answers = [f.result(timeout=KILLED_ANSWER_S * 3 + 30) for f in futures]
        answered = [i for i, (status, _) in enumerate(answers) if status == 200]
        assert len(answered) < len(prompts), "no request failed: the kill came after the stream"
        assert [tokens(answers[i][1]) for i in answered] == [want[i] for i in answered]  # no wrong answer
        assert pd.decode.pid() == decode_pid != 0  # the decode server lives on, not restarted
    finally:
        pd.prefill.recover()
    prompt = PROMPTS[3]
    wait_serving(pd, tokens(single.generate(greedy(prompt, NEW_TOKENS))[1]), prompt)


test_prefill_agent_killed_fails_requests_then_restarted_agent_serves = (
    cases.test_prefill_agent_killed_fails_requests_then_restarted_agent_serves
)


# ---------------------------------------------------------------- aborts from SGLang's side

LONG_PROMPT_TOKENS = 1800  # 15 chunks of 128 tokens: prefill is busy for a while on these cores
ABORTED_ANSWER_S = 60.0  # both servers answer an aborted request within this (pdfabric: seconds)
ANSWER_S = 150.0  # the client's wait: a hang (upstream's timeouts are 300 s) answers nothing by then
# The control, not a pdfabric claim: skipped by `make test` (a minute of a server pair's time for a
# case that can neither pass nor fail it), run non-strict by `make test-upstream` (tests/e2e/upstream.py).
UPSTREAM_WRONG = {
    ("mooncake", "prefill"): "SGLang's Mooncake decode waits for its own timeout (300 s) for a request "
    "its prefill aborted before sending",
    # A race, seen in CI (stop 53: no answer in 150 s): decode's abort notice reaches prefill before
    # prefill's scheduler has taken the request (it is busy with the chunks ahead); prefill's
    # Mooncake manager drops a notice for a room it does not know ("ignoring (already completed or
    # unknown)") and its request then waits for decode's metadata until the bootstrap timeout.
    ("mooncake", "decode"): "SGLang's Mooncake prefill drops a decode abort that arrives before it has "
    "the room, then waits for its own timeout (300 s)",
}


def aborted(status: int, answer: dict[str, Any]) -> bool:
    """SGLang answered the request as aborted (an error status, or a finish reason of abort)."""
    reason = (answer.get("meta_info") or {}).get("finish_reason") or {}
    return status != 200 or reason.get("type") == "abort"


def abort_in_flight(pd: PD, side: str, attempt: int) -> tuple[float, tuple[tuple[int, dict[str, Any]], ...]]:
    """Three long requests keep prefill busy; a fourth, queued behind them, is aborted on one
    server (SGLang's /abort_request) while it waits. Posted to both servers as SGLang's router
    posts them, without its retries (the router would send an aborted request again). Returns how
    late the fourth answered: seconds after its abort, or after the last request ahead of it
    answered if that came later (SGLang's prefill may reach it only then, and how long the three
    take depends on the machine, not on the abort); then its prefill and decode answers and the
    three decode answers."""
    prompts = [[(i * 41 + attempt * 7 + k) % 250 + 1 for i in range(LONG_PROMPT_TOKENS)] for k in range(4)]
    rid = f"abort-{uuid.uuid4().hex}"
    server = pd.decode if side == "decode" else pd.prefill

    def post(body: dict[str, Any]) -> tuple[float, tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]]]]:
        answers = pd.generate_direct(body, ANSWER_S)
        return time.monotonic(), answers

    with ThreadPoolExecutor(4) as pool:
        ahead = [pool.submit(post, greedy(p, NEW_TOKENS)) for p in prompts[:3]]
        time.sleep(0.1)
        answer = pool.submit(post, {**greedy(prompts[3], NEW_TOKENS), "rid": rid})
        time.sleep(0.3)  # it is in both servers' queues: prefill works on the ones ahead
        abort_sent = time.monotonic()
        post_json(server.url + "/abort_request", {"rid": rid}, 10)
        at, (prefill_answer, decode_answer) = answer.result(timeout=ANSWER_S + 30)
        others = [f.result(timeout=ANSWER_S + 30) for f in ahead]
    last_ahead = max(when for when, _ in others)
    return at - max(abort_sent, last_ahead), (prefill_answer, decode_answer, *(d for _, (_, d) in others))


def rooms_failed(pd: PD, role: str) -> float:
    assert pd.fabric is not None
    return pd.fabric.metric_sum("pdfabric_requests_total", role=role, outcome="failed")


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_an_abort_in_flight_ends_the_request_and_the_servers_serve_on(
    pd: PD, single: SGLangServer, side: str, request: pytest.FixtureRequest
) -> None:
    """SGLang aborts a request mid-flight, queued behind others: on decode while it waits for the
    KV, or on prefill before it was prefilled (before pdfabric's send). Both servers answer it
    (neither hangs), decode's answer says aborted, the requests beside it answer; with pdfabric the
    abort reaches the other side through the agents (decode's abort fails prefill's request; a
    prefill abort fails decode's room), which need not wait for a deadline; the next requests
    answer equal to a single server."""
    if pd.backend == SPEC_ENGINE:
        pytest.skip(SAME_AS_PDFABRIC)
    if (pd.backend, side) in UPSTREAM_WRONG:
        skip_known_wrong(UPSTREAM_WRONG[pd.backend, side])
        request.node.add_marker(pytest.mark.xfail(reason=UPSTREAM_WRONG[pd.backend, side], strict=False))
    failed_decode_rooms = rooms_failed(pd, "decode") if pd.fabric is not None else 0.0
    for attempt in range(3):  # on an idle machine the request may finish before the abort lands
        late, (prefill_answer, decode_answer, *others) = abort_in_flight(pd, side, attempt)
        assert late < ABORTED_ANSWER_S, f"the aborted request answered {late:.0f} s late"
        assert 0 not in (prefill_answer[0], decode_answer[0]), (prefill_answer, decode_answer)  # no answer
        assert [s for s, _ in others] == [200, 200, 200], f"a request beside the aborted one failed: {others}"
        if aborted(*decode_answer):
            break
        assert decode_answer[0] == 200 and len(tokens(decode_answer[1])) == NEW_TOKENS, decode_answer
    else:
        pytest.fail(f"three requests finished before their abort on {side}")
    if pd.fabric is not None and side == "decode":
        # The abort reached the prefill side through the agents: its request failed, not served.
        assert aborted(*prefill_answer), prefill_answer
    if pd.fabric is not None and side == "prefill":
        deadline = time.monotonic() + 30  # decode's room fails once its agent hears (fenced: at once)
        while rooms_failed(pd, "decode") <= failed_decode_rooms:
            assert time.monotonic() < deadline, "the decode agent's room of the aborted request did not end"
            time.sleep(0.2)
    for prompt in (PROMPTS[1], PROMPTS[4]):
        want = tokens(single.generate(greedy(prompt, NEW_TOKENS))[1])
        status, got = pd.generate(greedy(prompt, NEW_TOKENS))
        assert (status, tokens(got)) == (200, want), (pd.backend, side, got)
