"""Two SGLang state components on one rank that move as one (issue 25): an SWA hybrid's window
pages (``swa``) and their MXFP8 block scales (``block_scale_swa``), indexed alike by SGLang's
``_swa_payload`` on both sides, registered from SGLang's own MXFP8 pool built on CPU."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pdfabric_core.policy.types import StateKind  # noqa: E402
from pdfabric_core.spec import parse_spec  # noqa: E402
from pdfabric_core.traffic import pair_traffic  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 2, 32, 2


def mxfp8_args(page: int) -> tuple[Any, Any]:
    """KVArgs' state lists as SGLang's ``setup_state_kv_args`` fills them for an SWAKVPool whose SWA
    sub-pool is MXFP8: the sub-pool's K and V pages (``swa``), then its scales (``block_scale_swa``)."""
    import types

    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    pool = MHATokenToKVPoolMXFP8(size=8 * page - page, page_size=page, dtype=torch.float8_e4m3fn, head_num=HEADS,
                                 head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)  # fmt: skip
    args = types.SimpleNamespace(
        state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[], state_dim_per_tensor=[],
        state_conv_shard_groups=[], state_slice_outer_counts=[], state_layer_ids=[], page_size=page,
    )  # fmt: skip
    append_state_component(args, StateType.SWA, *pool.get_contiguous_buf_infos())
    append_state_component(args, StateType.BLOCK_SCALE_SWA, *pool.get_kv_scale_buf_infos())
    return args, pool


def test_sglangs_mxfp8_swa_pool_registers_pages_and_scales_as_one_page_component() -> None:
    from pdfabric_sglang.state_kinds import state_buffers, state_parts

    args, pool = mxfp8_args(16)
    parts = state_parts(args, is_mla=False)
    assert parts is not None and (parts.kind, parts.source) == (StateKind.PAGE, "swa+block_scale_swa")
    # A page of 16 tokens x 2 heads: 32 fp8 bytes a head of K or V, 1 UE8M0 scale a block of 32.
    assert parts.item_bytes == (16 * HEADS * HEAD_DIM,) * 2 * LAYERS + (16 * HEADS * HEAD_DIM // 32,) * 2 * LAYERS
    assert parts.sharded == (True,) * 4 * LAYERS
    ptrs, lens = state_buffers(args, parts)
    bufs = [*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer]
    assert ptrs == [b.data_ptr() for b in bufs] and lens == [b.nbytes for b in bufs]


def test_the_fa4_interleaved_scales_are_refused_by_name() -> None:
    from pdfabric_sglang.state_kinds import state_parts

    from pdfabric_agent.client.shares import UnshareableBuffer

    args, _ = mxfp8_args(128)
    with pytest.raises(UnshareableBuffer, match=r"block_scale_swa at page size 128.*interleaved"):
        state_parts(args, is_mla=False)
    with pytest.raises(UnshareableBuffer, match="beside MLA"):
        state_parts(mxfp8_args(16)[0], is_mla=True)


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1), (2, 2)])
def test_the_spec_names_the_merged_tensors_and_predicts_each_decode_ranks_heads(ptp: int, dtp: int) -> None:
    page, kv = 16 * HEADS * HEAD_DIM, 16 * HEADS * HEAD_DIM // 32
    s = parse_spec({"prefill": {"tp": ptp}, "decode": {"tp": dtp}, "model": {
        "layers": 2, "kvHeads": HEADS, "headDim": 16, "pageSizeTokens": 16,
        "stateKind": "page", "stateTensorBytes": [page] * 4 + [kv] * 4}})  # fmt: skip
    assert s.model.state_item_bytes(dtp) == (page // dtp,) * 4 + (kv // dtp,) * 4
    # Two window pages: every decode rank gets its heads of each page of each tensor, once.
    moved = sum(b.state for b in pair_traffic(s, 3, state_slots=2).values())
    assert moved == 2 * (4 * page + 4 * kv)
