"""The MLA reference model's MTP-style draft (``pdfabric_refengine.mla_draft``): speculative decoding
keeps the target's greedy tokens, decode from the pools reproduces the colocated run's tokens and
the draft's trace (proposals, accepted lengths), and a wrong draft page changes the trace though
not the tokens (fabric-level checks: tests/e2e/test_sglang_mla_draft.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pdfabric_refengine.engine import pages_for
from pdfabric_refengine.kvpool import KVPool, kv_args
from pdfabric_refengine.mla import MLACache, MLAModel, colocated_generate
from pdfabric_refengine.mla_draft import (
    MTPDraft,
    colocated_speculative,
    decode_speculative,
    draft_pool,
    prefill_draft,
    speculative_continue,
    with_draft,
)
from pdfabric_refengine.mla_engine import MLA_CONFIG, mla_pool, prefill_mla

PROMPTS = [list(range(3, 40)), [7, 1, 5] * 11]  # 37 and 33 tokens: 3 pages each
NEW = 24


@pytest.fixture(scope="module")
def model() -> MLAModel:
    return MLAModel(MLA_CONFIG, 0)


@pytest.fixture(scope="module")
def draft(model: MLAModel) -> MTPDraft:
    return MTPDraft(model, 0)


def test_speculative_tokens_are_the_targets_greedy_tokens(model: MLAModel, draft: MTPDraft) -> None:
    for prompt in PROMPTS:
        tokens, trace = colocated_speculative(model, draft, prompt, NEW)
        assert tokens == colocated_generate(model, prompt, NEW)
        assert len(trace.proposals) == len(trace.accepted) > 0 and all(len(p) == 3 for p in trace.proposals)


class OracleDraft(MTPDraft):
    """A draft that is the target itself: every proposal is accepted (the catch-up path)."""

    def forward(self, tokens: list[int], caches: list[MLACache]) -> object:  # type: ignore[override]
        return self.target.forward(tokens, caches)


def test_a_draft_that_is_always_right_is_accepted_whole(model: MLAModel) -> None:
    oracle = OracleDraft(model, 0)
    caches, dcaches = model.new_caches(), model.new_caches()
    first = int(model.forward(PROMPTS[0], caches).argmax())
    oracle.forward(PROMPTS[0], dcaches)
    tokens, trace = speculative_continue(model, oracle, caches, dcaches, first, NEW)
    assert tokens == colocated_generate(model, PROMPTS[0], NEW)
    assert set(trace.accepted) == {3}  # every step keeps all 3 proposals and the target's next


@pytest.fixture
def pools() -> Iterator[tuple[KVPool, KVPool, KVPool, KVPool]]:
    made = (mla_pool(MLA_CONFIG, num_pages=8), mla_pool(MLA_CONFIG, num_pages=8))
    drafts = (draft_pool(MLA_CONFIG, num_pages=8), draft_pool(MLA_CONFIG, num_pages=8))
    yield (*made, *drafts)
    for pool in (*made, *drafts):
        pool.close()


def test_decode_from_the_pools_reproduces_the_trace_and_a_wrong_draft_page_changes_it(
    model: MLAModel, draft: MTPDraft, pools: tuple[KVPool, KVPool, KVPool, KVPool]
) -> None:
    src, dst, dsrc, ddst = pools
    prompt = PROMPTS[0]
    pages = src.allocate_pages(pages_for(len(prompt), 16))
    first = prefill_mla(model, prompt, [[src]], [pages], [pages], 0)
    prefill_draft(draft, prompt, [[dsrc]], [pages])
    out = [p + 4 for p in pages[::-1]]  # a hand-off to other page numbers, as a fabric writes them
    for s, d in zip(pages, out, strict=True):
        rows, to = slice(s * 16, s * 16 + 16), slice(d * 16, d * 16 + 16)
        for layer in range(MLA_CONFIG.layers):
            dst.k_buffers[layer][to] = src.k_buffers[layer][rows]
            dst.state_buffers[0][layer][d] = src.state_buffers[0][layer][s]
        ddst.k_buffers[0][to] = dsrc.k_buffers[0][rows]
    dst.aux["output_ids"][1, 0] = first
    want_tokens, want_trace = colocated_speculative(model, draft, prompt, NEW)
    tokens, trace = decode_speculative(model, draft, len(prompt), [dst], [ddst], out, 1, NEW)
    assert (tokens, trace) == (want_tokens, want_trace)
    # The draft's second page given its first page's bytes: other proposals, the same tokens.
    ddst.k_buffers[0][out[1] * 16 : out[1] * 16 + 16] = ddst.k_buffers[0][out[0] * 16 : out[0] * 16 + 16].clone()
    tokens, trace = decode_speculative(model, draft, len(prompt), [dst], [ddst], out, 1, NEW)
    assert tokens == want_tokens and trace.proposals != want_trace.proposals


def test_the_draft_pool_rides_after_the_targets_buffers_in_kv_args(
    pools: tuple[KVPool, KVPool, KVPool, KVPool],
) -> None:
    """SGLang's layout: the target's latents, then the draft's (num_draft_entries), one page size;
    the plugin registers them as the second KV group."""
    from pdfabric_sglang.kvargs import registration

    src, _, dsrc, _ = pools
    args = with_draft(kv_args(src, engine_rank=0, page_size=16, kv_head_num=1, total_kv_head_num=1), dsrc)
    assert args.num_draft_entries == 1 and len(args.kv_data_ptrs) == MLA_CONFIG.layers + 1
    assert len(set(args.kv_item_lens)) == 1
    reg = registration("prefill-0-tp0-cp0", args, is_mla=True, gpu=None)
    assert reg.draft is not None and len(reg.draft.latent) == 1 and reg.draft.page_bytes == src.page_bytes
    assert len(reg.latent) == MLA_CONFIG.layers and reg.draft.latent[0].path == dsrc.shm_path
