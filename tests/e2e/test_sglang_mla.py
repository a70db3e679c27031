"""A DeepSeek-style MLA model through PD under SGLang's own classes (issue 25): greedy tokens equal
colocated ones, and the agents count the bytes the geometry predicts, per kind.

The reference engine's MLA model (``pdfabric_refengine.mla``: q/kv low-rank projections, a latent
of kv_lora_rank + qk_rope_head_dim per token and layer cached in SGLang's MLA layout, attention
computed from it, and a DSA-style indexer whose per-token keys are page-indexed state that picks
and biases the attended tokens) runs in a prefill and a decode engine process
(``pdfabric_refengine.mla_pd``), SGLang's ``get_kv_class`` classes move its latent and indexer
state through real agents on Mooncake tcp loopback, and decode generates from its pools alone. A
wrong byte of either kind changes the tokens.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pdfabric_refengine.mla_engine import MLA_CONFIG, mla_spec_model, state_slot_bytes

from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import expected_bytes
from tests.e2e.pd_runs import NEW_TOKENS, run_pd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = mla_spec_model()
PROMPTS = [list(range(3, 40)), [7, 1, 5] * 11, list(range(100, 116))]  # 37, 33, 16 tokens: 3, 3, 1 pages
PAGE = 16


@cache
def colocated() -> list[list[int]]:
    from pdfabric_refengine.mla import MLAModel, colocated_generate

    model = MLAModel(MLA_CONFIG, 0)
    return [colocated_generate(model, p, NEW_TOKENS) for p in PROMPTS]


def predicted(prefill: dict[str, Any], decode_tp: int) -> dict[str, int]:
    """Bytes per kind the decode side receives, from the model's geometry alone: every decode rank
    gets each page's whole latent of every layer once, and each page's indexer keys of every
    layer once (SGLang's DSA state type: page state beside MLA), and one aux row per request."""
    pages = sum(-(-len(p) // PAGE) for p in PROMPTS)
    latent = PAGE * MLA_CONFIG.latent_width * 4  # one page of one layer, float32
    kv = decode_tp * pages * MLA_CONFIG.layers * latent
    state = decode_tp * pages * MLA_CONFIG.layers * state_slot_bytes(MLA_CONFIG)
    aux = decode_tp * len(PROMPTS) * sum(MODEL["auxRowBytes"])
    cp = prefill.get("cp", 1)
    dedup = cp > 1 and not prefill.get("dsaCacheLayerSplit", False)
    return {"kv": kv, "state": state, "aux": aux, "skipped": (cp - 1) * state if dedup else 0}


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ({"tp": 2}, {"tp": 1}),  # decode takes each page from one prefill rank
        ({"tp": 1}, {"tp": 2}),  # each decode rank gets the whole latent and state
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}),  # page shards, state from CP rank 0
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True, "dsaCacheLayerSplit": True}, {"tp": 1}),
        # Two decode DP groups (attention DP): each room to one group, its own rank id and memory.
        ({"tp": 1}, {"tp": 1, "dp": 2}),
    ],
    ids=["tp2-tp1", "tp1-tp2", "cp2-all-ranks-dedup", "cp2-layer-split", "decode-dp2"],
)
def test_mla_model_through_pd_equals_colocated(
    installed_site: Path, tmp_path: Path, prefill: dict[str, Any], decode: dict[str, int]
) -> None:
    spec = {
        "prefill": prefill,
        "decode": decode,
        "transfer": {"transport": "tcp", "timeoutSeconds": 20},
        "model": MODEL,
    }
    engine_args = {"tp": prefill["tp"], "cp": prefill.get("cp", 1), "layer-split": int(prefill.get("dsaCacheLayerSplit", False))}  # fmt: skip
    with LocalFabric(spec) as lc:
        out = run_pd(lc, installed_site, tmp_path, engine_args, decode, module="pdfabric_refengine.mla_pd", prompts=PROMPTS)  # fmt: skip
        assert out["decode"]["classes"]["RECEIVER"] == "pdfabric_sglang.receiver.PdfabricKVReceiver"
        for side in ("prefill", "decode"):
            assert [r["state"] for r in out[side]["results"]] == ["Success"] * len(PROMPTS), out[side]
        tokens = [r["tokens"] for r in out["decode"]["results"]]
        assert tokens == colocated()
        dp = decode.get("dp", 1)
        assert [r["dp_group"] for r in out["decode"]["results"]] == [(1000 + i) % dp for i in range(len(PROMPTS))]
        want = predicted(prefill, decode["tp"])
        for role in ("prefill", "decode"):
            got = {k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in ("kv", "state", "aux")}
            assert got == {k: want[k] for k in ("kv", "state", "aux")}, role
        assert lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total") == want["skipped"]
        # The devcluster's own prediction from the spec reads the same, request by request.
        by_spec = [expected_bytes(lc.spec, pages=-(-len(p) // PAGE), state_slots=-(-len(p) // PAGE), aux=True) for p in PROMPTS]  # fmt: skip
        assert (sum(b.kv for b in by_spec), sum(b.state for b in by_spec)) == (want["kv"], want["state"])
        # SGLang's KVTransferMetric on decode reports those very bytes, room by room on the
        # receivers of the DP group that took the room.
        per_room = [sum(m["bytes"] for m in r["metrics"].values()) for r in out["decode"]["results"]]
        assert per_room == [b.kv + b.state + b.aux for b in by_spec]
        assert sum(per_room) == want["kv"] + want["state"] + want["aux"]
