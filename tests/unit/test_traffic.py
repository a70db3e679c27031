"""Expected bytes per request, with and without CP-replicated state dedup."""

from __future__ import annotations

import pytest

from pdfabric_core.traffic import estimate_traffic
from tests.builders import pdcluster

# One head, one layer, one page of K and V in bf16 with head_dim 128 and 16-token pages.
HEAD_PAGE = 2 * 16 * 128 * 2
AUX = 64 + 64 + 64 + 64 + 512 + 512 + 64 + 128 + 16384 + 64  # SGLang 0.5.23's rows, 8192 hidden bf16

# (id, builder, kv, state with dedup, state without dedup, aux)
CASES = [
    (
        "single-rank",
        pdcluster().model(layers=2, kvHeads=8, expectedPromptTokens=32, stateBytesPerRequest=1000),
        2 * 2 * 8 * HEAD_PAGE,
        1000,
        1000,
        AUX,
    ),
    (
        "tp-equal-4-routes",
        pdcluster().prefill(tp=4).decode(tp=4).model(layers=1, expectedPromptTokens=16, stateBytesPerRequest=10),
        1 * 1 * 8 * HEAD_PAGE,
        4 * 10,
        4 * 10,
        4 * AUX,
    ),
    (
        "cp8-rank0-only-sends",
        pdcluster().prefill(cp=8).model(layers=1, expectedPromptTokens=160, stateBytesPerRequest=100),
        10 * 8 * HEAD_PAGE,
        100,
        100,
        AUX,
    ),
    (
        "cp8-all-ranks-dedup-saves-7-of-8",
        pdcluster()
        .prefill(cp=8, allCpRanksTransfer=True)
        .model(layers=1, expectedPromptTokens=160, stateBytesPerRequest=100),
        10 * 8 * HEAD_PAGE,
        100,
        800,
        AUX,  # one row per decode rank, from CP rank 0 only
    ),
    (
        "cp4-layer-split-no-dedup-needed",
        pdcluster()
        .prefill(cp=4, allCpRanksTransfer=True, dsaCacheLayerSplit=True)
        .model(layers=1, expectedPromptTokens=64, stateBytesPerRequest=400, stateLayers=4),
        4 * 8 * HEAD_PAGE,
        400,
        400,
        AUX,
    ),
    (
        "decode-tp-larger-replicates-nothing",
        pdcluster().prefill(tp=2).decode(tp=8).model(layers=1, kvHeads=8, expectedPromptTokens=16),
        8 * HEAD_PAGE,
        0,
        0,
        8 * AUX,
    ),
    (
        "decode-tp-smaller-state-and-aux-from-primary-source-only",
        pdcluster()
        .prefill(tp=4)
        .decode(tp=2)
        .model(layers=1, kvHeads=8, expectedPromptTokens=16, stateBytesPerRequest=10),
        8 * HEAD_PAGE,
        2 * 10,  # one copy per decode rank, not one per route (4 routes)
        2 * 10,
        2 * AUX,
    ),
    (
        "pp2-splits-layers-aux-from-last-stage",
        pdcluster()
        .prefill(pp=2)
        .decode(pp=2)
        .model(layers=3, expectedPromptTokens=16, stateBytesPerRequest=50, stateLayers=2),
        3 * 8 * HEAD_PAGE,
        50,
        50,
        AUX,
    ),
]


@pytest.mark.parametrize(
    ("builder", "kv", "state", "state_nodedup", "aux"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_expected_bytes(builder, kv, state, state_nodedup, aux) -> None:
    est = estimate_traffic(builder.spec())
    assert (est.kv_bytes, est.state_bytes, est.state_bytes_without_dedup, est.aux_bytes) == (
        kv,
        state,
        state_nodedup,
        aux,
    )
    assert est.total_bytes_without_dedup - est.total_bytes == state_nodedup - state


def test_status_form_reports_saving() -> None:
    spec = (
        pdcluster()
        .prefill(cp=8, allCpRanksTransfer=True)
        .model(layers=1, expectedPromptTokens=128, stateBytesPerRequest=10_000, auxRowBytes=[0])
        .spec()
    )
    status = estimate_traffic(spec).to_status()
    kv = 8 * 8 * HEAD_PAGE  # 8 pages of 8 heads, one page per CP rank
    assert status["total"] == kv + 10_000
    assert status["totalWithoutDedup"] == kv + 80_000
    assert status["savedByDedup"] == 70_000
    assert status["savedPercent"] == f"{100 * 70_000 / (kv + 80_000):.2f}"
    # CP rank 0 sends the one copy and its page shard: the busiest prefill rank either way.
    assert status["prefill"]["maxPerRank"] == 8 * HEAD_PAGE + 10_000
    assert status["prefill"]["maxPerRankWithoutDedup"] == 8 * HEAD_PAGE + 10_000
    assert status["decode"]["maxPerRank"] == kv + 10_000
    assert status["decode"]["maxPerRankWithoutDedup"] == kv + 80_000


def test_prompt_override_and_page_rounding() -> None:
    spec = pdcluster().model(layers=1, kvHeads=1, headDim=128).spec()
    assert estimate_traffic(spec, prompt_tokens=17).pages == 2
    assert estimate_traffic(spec, prompt_tokens=0).kv_bytes == 0
    with pytest.raises(ValueError):
        estimate_traffic(spec, prompt_tokens=-1)
