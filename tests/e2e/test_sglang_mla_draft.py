"""The MLA reference model with an MTP-style draft head through PD under SGLang's own classes
(issue 25, the draft KV group): the draft's paged latent moves as the registration's second KV
group, decode runs greedy speculative decoding from its pools alone, and its tokens, the draft's
proposals and the accepted length of every step equal the colocated run's; the agents count the
bytes the geometry predicts, per kind, the draft's layer included.

Verification makes the tokens the target's alone, so the tokens cannot show a wrong draft byte:
the proposals can (they are computed from the draft KV that moved). The negative control gives one
draft page another's bytes on decode after the transfer: the tokens stay, the proposals change.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pdfabric_refengine.mla_engine import MLA_CONFIG, mla_spec_model, state_slot_bytes

from pdfabric_core.spec import parse_spec
from pdfabric_core.traffic import pair_traffic
from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.pd_runs import NEW_TOKENS, run_pd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = mla_spec_model(draft_layers=1)
PROMPTS = [list(range(3, 40)), [7, 1, 5] * 11, list(range(100, 116))]  # 37, 33, 16 tokens: 3, 3, 1 pages
PAGE = 16


@cache
def colocated() -> list[tuple[list[int], list[list[int]], list[int]]]:
    from pdfabric_refengine.mla import MLAModel
    from pdfabric_refengine.mla_draft import MTPDraft, colocated_speculative

    model = MLAModel(MLA_CONFIG, 0)
    draft = MTPDraft(model, 0)
    out = []
    for p in PROMPTS:
        tokens, trace = colocated_speculative(model, draft, p, NEW_TOKENS)
        out.append((tokens, trace.proposals, trace.accepted))
    return out


def predicted(decode_tp: int) -> dict[str, int]:
    """Bytes per kind decode receives, from the geometry alone: every decode rank gets each page's
    whole latent of every target layer and of the draft layer once, each page's indexer keys of
    every layer once, one aux row per request."""
    pages = sum(-(-len(p) // PAGE) for p in PROMPTS)
    latent = PAGE * MLA_CONFIG.latent_width * 4  # one page of one layer, float32
    draft = decode_tp * pages * 1 * latent
    return {
        "kv": decode_tp * pages * MLA_CONFIG.layers * latent + draft,
        "state": decode_tp * pages * MLA_CONFIG.layers * state_slot_bytes(MLA_CONFIG),
        "aux": decode_tp * len(PROMPTS) * sum(MODEL["auxRowBytes"]),
        "draft": draft,
    }


@pytest.mark.parametrize(
    ("prefill", "decode", "corrupt"),
    [
        ({"tp": 2}, {"tp": 1}, False),  # decode takes each draft page from one prefill rank
        ({"tp": 1}, {"tp": 2}, False),  # each decode rank gets the whole draft latent
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, False),  # draft pages by CP shard
        ({"tp": 2}, {"tp": 1}, True),  # the negative control: one draft page overwritten on decode
    ],
    ids=["tp2-tp1", "tp1-tp2", "cp2-all-ranks", "tp2-tp1-corrupt-draft-page"],
)
def test_mla_draft_through_pd_equals_colocated_proposals_too(
    installed_site: Path, tmp_path: Path, prefill: dict[str, Any], decode: dict[str, int], corrupt: bool
) -> None:
    spec = {
        "prefill": prefill,
        "decode": decode,
        "transfer": {"transport": "tcp", "timeoutSeconds": 20},
        "model": MODEL,
    }
    engine_args = {"tp": prefill["tp"], "cp": prefill.get("cp", 1), "draft": 1}
    decode_args = {**decode, "draft": 1, "corrupt-draft": int(corrupt)}
    with LocalFabric(spec) as lc:
        out = run_pd(lc, installed_site, tmp_path, engine_args, decode_args, module="pdfabric_refengine.mla_pd", prompts=PROMPTS)  # fmt: skip
        for side in ("prefill", "decode"):
            assert [r["state"] for r in out[side]["results"]] == ["Success"] * len(PROMPTS), out[side]
        results = out["decode"]["results"]
        want = colocated()
        # The tokens are the target's: equal with or without a wrong draft byte.
        assert [r["tokens"] for r in results] == [w[0] for w in want]
        got_trace = [(r["proposals"], r["accepted"]) for r in results]
        want_trace = [(w[1], w[2]) for w in want]
        if corrupt:  # the prompts of more than one page get other proposals
            assert [g != w for g, w in zip(got_trace, want_trace, strict=True)] == [True, True, False]
            return
        assert got_trace == want_trace
        want_bytes = predicted(decode["tp"])
        for role in ("prefill", "decode"):
            got = {k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in ("kv", "state", "aux")}
            assert got == {k: want_bytes[k] for k in ("kv", "state", "aux")}, role
        # The operator's prediction (status, traffic sweep) reads the same, the draft's part apart.
        parsed = parse_spec(spec)
        by_spec = [pair_traffic(parsed, -(-len(p) // PAGE), state_slots=-(-len(p) // PAGE)) for p in PROMPTS]
        assert sum(b.kv for pairs in by_spec for b in pairs.values()) == want_bytes["kv"]
        assert sum(b.draft_kv for pairs in by_spec for b in pairs.values()) == want_bytes["draft"]
        per_room = [sum(m["bytes"] for m in r["metrics"].values()) for r in results]
        assert per_room == [sum(b.total for b in pairs.values()) for pairs in by_spec]
