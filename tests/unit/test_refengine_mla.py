"""The reference engine's MLA model: decode from the pools' latent and indexer state reproduces
colocated generation, every TP rank's copy and the indexer keys decide the tokens, and the KVArgs
of its pool describe SGLang's MLA layout (fabric-level checks: tests/e2e/test_sglang_mla.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pdfabric_refengine.engine import pages_for
from pdfabric_refengine.kvpool import KVPool, kv_args
from pdfabric_refengine.mla import MLAConfig, MLAModel, colocated_generate, greedy_continue, prefill_forward
from pdfabric_refengine.mla_engine import MLA_CONFIG, decode_mla, mla_pool, mla_spec_model, prefill_mla

PROMPT = list(range(3, 40))  # 37 tokens: 3 pages
NEW = 16


@pytest.fixture(scope="module")
def model() -> MLAModel:
    return MLAModel(MLA_CONFIG, 0)


@pytest.fixture
def pools() -> Iterator[list[KVPool]]:
    made = [mla_pool(MLA_CONFIG, num_pages=8) for _ in range(3)]
    yield made
    for pool in made:
        pool.close()


def test_same_seed_same_weights_and_tp_splits_heads_only(model: MLAModel) -> None:
    again = MLAModel(MLA_CONFIG, 0)
    assert all(torch.equal(a, b) for la, lb in zip(model.layers, again.layers, strict=True) for a, b in zip(la.values(), lb.values(), strict=True))  # fmt: skip
    caches, first = prefill_forward(model, PROMPT, tp=2)
    assert greedy_continue(model, caches, first, NEW) == colocated_generate(model, PROMPT, NEW)
    assert colocated_generate(MLAModel(MLA_CONFIG, 1), PROMPT, NEW) != colocated_generate(model, PROMPT, NEW)


def test_decode_from_the_pools_equals_colocated_and_each_byte_kind_matters(
    model: MLAModel, pools: list[KVPool]
) -> None:
    src, *ranks = pools  # prefill TP1 -> decode TP2
    n = pages_for(len(PROMPT), 16)
    pages = src.allocate_pages(n)
    first = prefill_mla(model, PROMPT, [[src]], [pages], [pages], 0)
    # A hand-off to other page numbers, as a fabric writes them: latent rows and state slots.
    out = [p + 4 for p in pages[::-1]]
    for dst in ranks:
        for layer in range(MLA_CONFIG.layers):
            for s, d in zip(pages, out, strict=True):
                dst.k_buffers[layer][d * 16 : d * 16 + 16] = src.k_buffers[layer][s * 16 : s * 16 + 16]
                dst.state_buffers[0][layer][d] = src.state_buffers[0][layer][s]
        dst.aux["output_ids"][1, 0] = first
    want = colocated_generate(model, PROMPT, NEW)
    assert decode_mla(model, len(PROMPT), ranks, out, 1, NEW) == want
    # One page of indexer keys of one layer missing on decode TP rank 0: other tokens.
    saved = ranks[0].state_buffers[0][1][out[1]].clone()
    ranks[0].state_buffers[0][1][out[1]] = 0
    assert decode_mla(model, len(PROMPT), ranks, out, 1, NEW) != want
    ranks[0].state_buffers[0][1][out[1]] = saved
    # One latent page of decode TP rank 1 wrong (rank 0's copy right): other tokens.
    ranks[1].k_buffers[0][out[0] * 16 : out[0] * 16 + 16] = 0
    assert decode_mla(model, len(PROMPT), ranks, out, 1, NEW) != want


def test_kv_args_describe_one_latent_buffer_per_layer_and_page_state(pools: list[KVPool]) -> None:
    pool = pools[0]
    args = kv_args(pool, engine_rank=0, page_size=16, kv_head_num=1, total_kv_head_num=1, state_type="dsa")
    width = MLA_CONFIG.kv_lora_rank + MLA_CONFIG.qk_rope_head_dim
    assert len(args.kv_data_ptrs) == MLA_CONFIG.layers  # no V buffers
    assert args.kv_item_lens == [16 * width * 4] * MLA_CONFIG.layers
    assert [str(getattr(t, "value", t)) for t in args.state_types] == ["dsa"]  # SGLang's DSA indexer state
    assert args.state_item_lens == [[16 * MLA_CONFIG.index_dim * 4] * MLA_CONFIG.layers]
    spec = mla_spec_model()
    assert spec["stateKind"] == "page"
    assert spec["stateTensorBytes"] == [16 * MLA_CONFIG.index_dim * 4] * MLA_CONFIG.layers
    assert (spec["kvLoraRank"], spec["qkRopeHeadDim"]) == (32, 16)


def test_heads_must_split_over_tp() -> None:
    small = MLAModel(MLAConfig(layers=1, heads=4), 0)
    with pytest.raises(ValueError, match="do not split over 3 TP ranks"):
        prefill_forward(small, [1, 2, 3], tp=3)
