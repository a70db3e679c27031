"""SGLang's real servers with several scheduler ranks run PD over pdfabric, and SGLang's Mooncake
backend runs the same cases as the control:

- prefill TP2 -> decode TP1 of a model with one KV head: both prefill ranks hold the same head, so
  one of them sends and the other has nothing to send, yet must complete as SGLang's scheduler
  expects (its poll is all-reduced over the TP ranks). In float32: TP2 sums partial results in
  another order than one rank, which in bfloat16 alone turns some greedy tokens;
- prefill PP2 -> decode TP1 of a three-layer model: each prefill stage sends its own layers, one
  and two (SGLang gives the extra layer to the last stage).

Each server is one ``sglang.launch_server`` with ``--tp-size`` or ``--pp-size``: SGLang starts a
scheduler process per rank and all-reduces their polls over gloo. Greedy answers must equal a
one-rank server's answers token for token (the KV of every layer and head arrived).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdfabric_core.spec import DTYPE_BYTES
from pdfabric_devcluster.procs import free_port, post_json
from pdfabric_sglangserver.model import DEFAULT, Variant, write_model_dir
from pdfabric_sglangserver.pd import PD, Shape, behind_router, pair_started_here, tokens
from pdfabric_sglangserver.servers import PAGE_SIZE, SGLangServer, greedy, server_argv, server_env, start_server
from tests.deadlines import wait_until
from tests.e2e.upstream import skip_known_wrong

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

REPLICATED_HEADS = Shape(prefill_tp=2, model=Variant(kv_heads=1, dtype="float32"))
PIPELINE = Shape(prefill_pp=2, model=Variant(layers=3))  # stage 0 holds layer 0, stage 1 layers 1 and 2
# One rank each, float32: a retracted request's prefix recomputed by prefill equals the one decode
# computed token by token (in bfloat16 the two paths round differently and later tokens turn).
RETRACTED = Shape(model=Variant(dtype="float32"))
SHAPES = [REPLICATED_HEADS, PIPELINE, RETRACTED]
BACKENDS = ["mooncake", "pdfabric"]
# What SGLang's own Mooncake backend gets wrong here (the control, not a pdfabric claim): `make test`
# skips these pairs (they could neither pass nor fail it, and each costs a server pair of its own);
# `make test-upstream` runs them, non-strict, to see when upstream passes (tests/e2e/upstream.py):
UPSTREAM_WRONG = {
    # Both prefill ranks hold the one KV head: wrong tokens from the second token on (2 of 2 runs
    # here, at 88 tokens in bfloat16 and at 300 in float32).
    (REPLICATED_HEADS, "mooncake"): "SGLang's Mooncake backend corrupts replicated-head KV",
    # Stage 1 holds 2 of 3 layers; 3 % 2 != 0 sends it down the draft-model branch of
    # ``CommonKVManager.get_mha_kv_ptrs_with_pp``, which writes its V into decode's V of layers 0..1
    # instead of 1..2: wrong tokens from the second token on.
    (PIPELINE, "mooncake"): "SGLang's Mooncake backend writes an uneven PP stage's V to the wrong layers",
}
# Decode in bfloat16 on the CPU is not batch-invariant: eight prompts decoded together may break a
# near-tie differently from one prompt alone. Seen here from 2026-12-02 (a rebuilt environment): one
# of the eight concurrent prompts turns at its ninth token, identically at that session's start
# commit, while every prompt sent alone is equal and each stage's KV lands exactly once
# (test_shaped_pd_moves_each_rank_share_once). Only that comparison is excused, and only here.
BATCH_SENSITIVE = {PIPELINE: "bfloat16 decode of 8 concurrent prompts breaks a near-tie unlike one prompt alone"}
PROMPTS = [
    list(range(32, 120)),
    [(i * 37) % 251 for i in range(300)],  # 3 chunks of 128 tokens
    [65] * 33,
]
CONCURRENT = [[(i * 13 + j * 7) % 250 + 1 for j in range(20 + 11 * i)] for i in range(8)]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def variant_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[Variant, Path]:
    """Each shape's model directory (the session's for the default model)."""
    dirs = {DEFAULT: model_dir}
    for variant in {s.model for s in SHAPES} - {DEFAULT}:
        dirs[variant] = write_model_dir(tmp_path_factory.mktemp(f"sglang-model-{variant.name}"), variant)
    return dirs


class OneRankServers:
    """A one-rank server of each model variant, started when a shape first needs it: the answers its
    PD shapes must equal. The default model's is the session's; of the others one runs at a time
    (a server holds about 1.5 GB, and make test runs this module's shapes on two workers at once)."""

    def __init__(self, single: SGLangServer, variant_dirs: dict[Variant, Path], logs: pytest.TempPathFactory) -> None:
        self.single, self.variant_dirs, self.logs = single, variant_dirs, logs
        self.other: tuple[Variant, SGLangServer] | None = None

    def of(self, variant: Variant) -> SGLangServer:
        if variant == DEFAULT:
            return self.single
        if self.other is not None and self.other[0] == variant:
            return self.other[1]
        self.close()
        log, port = self.logs.mktemp(f"single-{variant.name}") / "single.log", free_port()
        argv = server_argv(self.variant_dirs[variant], port, extra=variant.server_flags)
        server = start_server(f"single-{variant.name}", argv, server_env(dict(os.environ)), log, port)
        server.memo = {}  # both backends of a shape compare against the same answers
        self.other = (variant, server)
        server.wait_healthy()
        return server

    def close(self) -> None:
        if self.other is not None:
            self.other[1].stop()
            self.other = None


@pytest.fixture(scope="module")
def one_rank_servers(
    single: SGLangServer, variant_dirs: dict[Variant, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OneRankServers]:
    servers = OneRankServers(single, variant_dirs, tmp_path_factory)
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: s.name)
def shape(request: pytest.FixtureRequest) -> Shape:
    """The shape: its two backends' pairs are compared with its one-rank server (OneRankServers)."""
    shape: Shape = request.param
    return shape


@pytest.fixture(scope="module", params=BACKENDS)
def shaped(
    request: pytest.FixtureRequest,
    shape: Shape,
    variant_dirs: dict[Variant, Path],
    installed_site: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Shape, PD]]:
    backend = request.param
    if (shape, backend) in UPSTREAM_WRONG:
        skip_known_wrong(UPSTREAM_WRONG[shape, backend])
    logs = tmp_path_factory.mktemp(f"{shape.name}-{backend}")
    pair = pair_started_here(backend, variant_dirs[shape.model], installed_site, logs, shape)
    with behind_router(backend, pair, logs) as pd:
        yield shape, pd


@pytest.fixture
def reference(shaped: tuple[Shape, PD], one_rank_servers: OneRankServers) -> SGLangServer:
    return one_rank_servers.of(shaped[0].model)


def test_shaped_pd_answers_equal_a_one_rank_server(
    shaped: tuple[Shape, PD], reference: SGLangServer, request: pytest.FixtureRequest
) -> None:
    shape, pd = shaped
    if (shape, pd.backend) in UPSTREAM_WRONG:
        request.node.add_marker(pytest.mark.xfail(reason=UPSTREAM_WRONG[shape, pd.backend], strict=False))
    for prompt in PROMPTS:
        want = tokens(reference.generate(greedy(prompt, NEW_TOKENS))[1])
        status, got = pd.generate(greedy(prompt, NEW_TOKENS))
        assert status == 200, (shape.name, pd.backend, got, pd.prefill.tail(), pd.decode.tail())
        assert tokens(got) == want, (shape.name, pd.backend, len(prompt))
    want_all = [tokens(reference.generate(greedy(p, NEW_TOKENS))[1]) for p in CONCURRENT]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: pd.generate(greedy(p, NEW_TOKENS), 240), CONCURRENT))
    assert [s for s, _ in answers] == [200] * len(CONCURRENT), [a for s, a in answers if s != 200][:2]
    got_all = [tokens(a) for _, a in answers]
    if got_all != want_all and shape in BATCH_SENSITIVE:
        turned = [
            (i, next((k for k, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), min(len(g), len(w))))
            for i, (g, w) in enumerate(zip(got_all, want_all, strict=True))
            if g != w
        ]
        pytest.xfail(f"{BATCH_SENSITIVE[shape]}: (prompt, token) {turned}")
    assert got_all == want_all


def test_shaped_pd_moves_each_rank_share_once(shaped: tuple[Shape, PD]) -> None:
    """The decode agent counted the prompt's KV exactly once: with replicated heads one prefill rank
    sent the head (not both), with PP each stage sent its own layers."""
    shape, pd = shaped
    if pd.fabric is None:
        pytest.skip("SGLang's Mooncake backend exports no per-request byte counters")
    before = pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv")
    status, _ = pd.generate(greedy(list(range(1, 101)), 4))
    assert status == 200
    # 100 tokens are 7 pages of 16: 112 token rows x layers x (K + V) x KV heads x 16 x dtype bytes
    m = shape.model
    want = -(-100 // PAGE_SIZE) * PAGE_SIZE * m.layers * 2 * m.kv_heads * 16 * DTYPE_BYTES[m.dtype]
    deadline = time.monotonic() + 10
    while (moved := pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") - before) < want:
        assert time.monotonic() < deadline, f"the decode agent counted {moved} of {want} KV bytes"
        time.sleep(0.2)
    time.sleep(1.0)  # a second copy would land right after the first
    assert pd.fabric.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind="kv") - before == want


def decode_running(pd: PD) -> bool:
    """Decode's scheduler runs a request (SGLang's /v1/loads)."""
    with urllib.request.urlopen(pd.decode.url + "/v1/loads?include=core", timeout=10) as resp:
        loads = json.loads(resp.read())["loads"]
    return any(load.get("num_running_reqs", 0) >= 1 for load in loads)


def test_a_retracted_request_is_received_again_and_answers_equal(
    shaped: tuple[Shape, PD], reference: SGLangServer
) -> None:
    """Rebootstrap: decode's /pause_generation with mode retract takes a long generation out of
    its batch and, on /continue_generation, re-receives it: SGLang posts the prompt and the tokens
    so far to prefill, which computes their KV again and sends it under the same bootstrap room.
    The answer is whole and equal to a one-rank server's."""
    shape, pd = shaped
    if shape is not RETRACTED:
        pytest.skip("run on the one-rank float32 pair (see RETRACTED)")
    prompt, new = list(range(32, 120)), 1500
    want = tokens(reference.generate(greedy(prompt, new), 300)[1])
    for _ in range(3):  # the pause must find the request decoding
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(pd.generate_direct, greedy(prompt, new), 300)
            # Pause once decode runs the request (after prefill and the transfer: a fixed wait missed
            # it on a loaded machine), a little into its ~20 s of decoding.
            wait_until(lambda a=answer: decode_running(pd) or a.done(), timeout=120, what="decode running the request")
            time.sleep(1.0)
            assert post_json(pd.decode.url + "/pause_generation", {"mode": "retract"}, 30)[0] == 200
            time.sleep(1.0)
            assert post_json(pd.decode.url + "/continue_generation", {}, 30)[0] == 200
            (_, _), (status, got) = answer.result(timeout=330)
        assert status == 200, (pd.backend, got, pd.decode.tail())
        if got["meta_info"].get("num_retractions", 0) >= 1:
            break
    else:
        pytest.fail("three requests ended before decode retracted them")
    assert tokens(got) == want, pd.backend
