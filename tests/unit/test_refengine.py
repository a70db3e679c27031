"""The reference engine: PD hand-offs through its pools reproduce colocated generation exactly.

The fabric is emulated by raw memmoves between the addresses SGLang's KVArgs registers (page by
page, head slice by head slice, rank to rank by pdfabric's own route rules), so these tests also
pin that the KVArgs pointers and item lens describe the pool's real bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from collections.abc import Iterator

import pytest
import torch
from pdfabric_refengine import (
    KVPool,
    build_model,
    colocated_generate,
    decode,
    kv_args,
    model_shape,
    pages_for,
    prefill,
    prefill_cp,
)
from sglang.srt.disaggregation.base.conn import KVArgs  # type: ignore[import-untyped,unused-ignore]
from transformers import LlamaForCausalLM

from pdfabric_core.policy.rank_mapping import cp_page_shard, kv_routes, local_heads, primary_source

KV_HEADS = 4
NEW_TOKENS = 33
PROMPT_LENS = (1, 16, 37, 50)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_model(0, kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> dict[int, tuple[list[int], list[int]]]:
    """Prompt length -> (prompt, colocated tokens), computed once for the module."""
    rng = random.Random(7)
    out = {}
    for n in PROMPT_LENS:
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(n)]
        out[n] = (prompt, colocated_generate(model, prompt, NEW_TOKENS))
    return out


def make_pools(tp: int, num_pages: int = 12, *, heads: int = KV_HEADS) -> list[KVPool]:
    return [KVPool(layers=2, local_heads=local_heads(tp, heads), head_dim=16, num_pages=num_pages) for _ in range(tp)]


@pytest.fixture
def pools_made() -> Iterator[list[KVPool]]:
    """Every pool a test makes, closed (shm file unlinked) afterwards."""
    made: list[KVPool] = []
    yield made
    for pool in made:
        pool.close()


def pools(made: list[KVPool], tp: int, num_pages: int = 12) -> list[KVPool]:
    new = make_pools(tp, num_pages)
    made.extend(new)
    return new


def args_of(pool_list: list[KVPool]) -> list[KVArgs]:
    return [
        kv_args(p, engine_rank=r, page_size=p.page_size, kv_head_num=p.local_heads, total_kv_head_num=KV_HEADS)
        for r, p in enumerate(pool_list)
    ]


def fabric_copy_kv(
    src: list[KVPool], src_pages: list[int], dst: list[KVPool], dst_pages: list[int], num_pages: int
) -> None:
    """Move the request's KV like the fabric: for each route, per buffer, per page and per token,
    one memmove of the route's head slice between the registered addresses."""
    src_args, dst_args = args_of(src), args_of(dst)
    page_size = src[0].page_size
    for route in kv_routes(len(src), len(dst), KV_HEADS):
        s, d = src_args[route.prefill_tp_rank], dst_args[route.decode_tp_rank]
        head_bytes = s.kv_item_lens[0] // (page_size * route.src_local_heads)
        for i in range(len(s.kv_data_ptrs)):
            for sp, dp in zip(src_pages[:num_pages], dst_pages[:num_pages], strict=True):
                for t in range(page_size):
                    src_addr = s.kv_data_ptrs[i] + sp * s.kv_item_lens[i] + t * route.src_local_heads * head_bytes
                    dst_addr = d.kv_data_ptrs[i] + dp * d.kv_item_lens[i] + t * route.dst_local_heads * head_bytes
                    ctypes.memmove(
                        dst_addr + route.dst_head_offset * head_bytes,
                        src_addr + route.src_head_offset * head_bytes,
                        route.num_heads * head_bytes,
                    )


def fabric_copy_aux(src: KVPool, src_slot: int, dst: KVPool, dst_slot: int) -> None:
    s, d = args_of([src])[0], args_of([dst])[0]
    for sp, dp, n in zip(s.aux_data_ptrs, d.aux_data_ptrs, s.aux_item_lens, strict=True):
        ctypes.memmove(dp + dst_slot * n, sp + src_slot * n, n)


def test_colocated_generation_is_deterministic_for_a_seed(model: LlamaForCausalLM) -> None:
    prompt = [3, 14, 15, 92, 65]
    again = build_model(0, kv_heads=KV_HEADS)
    assert colocated_generate(model, prompt, NEW_TOKENS) == colocated_generate(again, prompt, NEW_TOKENS)
    other = build_model(1, kv_heads=KV_HEADS)
    assert colocated_generate(other, prompt, NEW_TOKENS) != colocated_generate(model, prompt, NEW_TOKENS)
    assert len(colocated_generate(model, prompt, NEW_TOKENS)) == NEW_TOKENS
    assert model_shape(model).layers == 2 and model_shape(model).kv_heads == KV_HEADS


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_from_the_prefill_pools_equals_colocated(
    model: LlamaForCausalLM, reference: dict[int, tuple[list[int], list[int]]], pools_made: list[KVPool], tp: int
) -> None:
    group = pools(pools_made, tp)
    for n, (prompt, expected) in reference.items():
        # Scattered, out-of-order pages: the page table, not the token order, places the KV.
        pages = group[0].allocate_pages(pages_for(n, 16))[::-1]
        for pool in group[1:]:
            assert pool.allocate_pages(len(pages))[::-1] == pages
        slot = group[0].allocate_aux_slot()
        first = prefill(model, prompt, group, pages, slot)
        assert first == expected[0]
        assert all(int(p.aux["output_ids"][slot, 0]) == first for p in group)
        assert decode(model, n, group, pages, slot, NEW_TOKENS) == expected


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 4), (4, 2), (1, 2), (2, 8)])
def test_tp_resharded_hand_off_equals_colocated(
    model: LlamaForCausalLM,
    reference: dict[int, tuple[list[int], list[int]]],
    pools_made: list[KVPool],
    prefill_tp: int,
    decode_tp: int,
) -> None:
    src, dst = pools(pools_made, prefill_tp), pools(pools_made, decode_tp)
    for pool in dst:
        pool.allocate_pages(3)  # decode's pages differ from prefill's
    for n, (prompt, expected) in reference.items():
        num = pages_for(n, 16)
        # Same page indices on every rank of a side, as the scheduler's page table gives them.
        src_pages = src[0].allocate_pages(num)
        assert all(pool.allocate_pages(num) == src_pages for pool in src[1:])
        dst_pages = dst[0].allocate_pages(num)
        assert all(pool.allocate_pages(num) == dst_pages for pool in dst[1:])
        prefill(model, prompt, src, src_pages, aux_slot=1)
        fabric_copy_kv(src, src_pages, dst, dst_pages, num)
        for d, pool in enumerate(dst):
            fabric_copy_aux(src[primary_source(d, prefill_tp, decode_tp, KV_HEADS)], 1, pool, 5)
        assert decode(model, n, dst, dst_pages, 5, NEW_TOKENS) == expected


@pytest.mark.parametrize(("prompt_len", "all_ranks_send"), [(37, True), (50, True), (50, False)])
def test_cp2_shards_into_one_decode_pool_equal_colocated(
    model: LlamaForCausalLM,
    reference: dict[int, tuple[list[int], list[int]]],
    pools_made: list[KVPool],
    prompt_len: int,
    all_ranks_send: bool,
) -> None:
    prompt, expected = reference[prompt_len]
    num = pages_for(prompt_len, 16)
    cp_pools = [pools(pools_made, 1), pools(pools_made, 1)]
    shards = [cp_page_shard(num, 2, c, all_ranks_send=all_ranks_send) for c in range(2)]
    cp_pools[1][0].allocate_pages(4)  # the CP ranks' local pages differ from each other
    cp_pages = [cp_pools[c][0].allocate_pages(len(shards[c])) for c in range(2)]
    prefill_cp(model, prompt, cp_pools, cp_pages, aux_slot=0, all_ranks_send=all_ranks_send)

    # Each CP rank holds its shard only: pages outside it were never written.
    for c, pool_list in enumerate(cp_pools):
        pool = pool_list[0]
        for p in range(pool.num_pages):
            written = p in cp_pages[c]
            assert bool(pool.page("k", 1, p).any()) == written, (c, p)

    [dst] = pools(pools_made, 1)
    dst_pages = dst.allocate_pages(num)[::-1]
    for c, shard in enumerate(shards):
        fabric_copy_kv(cp_pools[c], cp_pages[c], [dst], [dst_pages[i] for i in shard], len(shard))
    fabric_copy_aux(cp_pools[0][0], 0, dst, 3)
    assert decode(model, prompt_len, [dst], dst_pages, 3, NEW_TOKENS) == expected


def test_damaged_kv_changes_the_tokens(
    model: LlamaForCausalLM, reference: dict[int, tuple[list[int], list[int]]], pools_made: list[KVPool]
) -> None:
    """The equality checks above have teeth: one head slice of one page lost changes the output."""
    prompt, expected = reference[37]
    group = pools(pools_made, 2)
    pages = group[0].allocate_pages(3)
    group[1].allocate_pages(3)
    prefill(model, prompt, group, pages, 0)
    group[1].page("v", 0, pages[1]).zero_()
    assert decode(model, 37, group, pages, 0, NEW_TOKENS) != expected
    group[1].aux["output_ids"][0, 0] += 1
    with pytest.raises(ValueError, match="disagree on the first token"):
        decode(model, 37, group, pages, 0, NEW_TOKENS)


def test_kv_args_is_sglangs_with_mha_pointer_order(pools_made: list[KVPool]) -> None:
    pool = pools(pools_made, 2)[0]
    args = kv_args(pool, engine_rank=1, page_size=16, kv_head_num=2, total_kv_head_num=KV_HEADS, gpu_id=3)
    assert isinstance(args, KVArgs)
    assert args.kv_data_ptrs == [
        pool.k_buffers[0].data_ptr(),
        pool.k_buffers[1].data_ptr(),
        pool.v_buffers[0].data_ptr(),
        pool.v_buffers[1].data_ptr(),
    ]
    assert args.kv_data_lens == [12 * 16 * 2 * 16 * 4] * 4
    assert args.kv_item_lens == [16 * 2 * 16 * 4] * 4  # page_size * local heads * head_dim * float32
    assert args.kv_layer_ids == []  # SGLang's build_kv_layer_ids for a plain MHA pool
    assert args.aux_data_ptrs == [t.data_ptr() for t in pool.aux.values()]
    assert args.aux_item_lens == [64, 64, 64]  # output_ids, cached_tokens (16 x int32), room (8 x uint64)
    assert args.aux_data_lens == [64 * pool.aux_slots] * 3
    assert args.state_types == [] and args.state_data_ptrs == [] and args.state_item_lens == []
    assert (args.engine_rank, args.gpu_id, args.page_size, args.kv_head_num, args.total_kv_head_num) == (
        1,
        3,
        16,
        2,
        KV_HEADS,
    )
    assert (args.pp_rank, args.prefill_start_layer, args.prefill_end_layer, args.system_dp_rank) == (0, 0, 2, 0)
    assert args.kv_layout is None and args.ib_device == "" and args.num_draft_entries == 0
    # Every annotated attribute is set (an unset one would raise AttributeError in a KV manager).
    for name in KVArgs.__annotations__:
        getattr(args, name)
    with pytest.raises(ValueError, match="local heads"):
        kv_args(pool, engine_rank=0, page_size=16, kv_head_num=4, total_kv_head_num=KV_HEADS)


def test_shm_file_holds_the_pool_bytes(model: LlamaForCausalLM, pools_made: list[KVPool]) -> None:
    [pool] = pools(pools_made, 1)
    assert pool.shm_path is not None and pool.shm_path.startswith("/dev/shm/")
    pages = pool.allocate_pages(2)
    prefill(model, [5, 6, 7, 8] * 5, [pool], pages, 2, room=0xDEADBEEF)
    infos = pool.k_infos + pool.v_infos + pool.aux_infos
    assert all(i.offset is not None and i.offset % 4096 == 0 for i in infos)
    with open(pool.shm_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as second:
        info = pool.v_infos[1]
        assert info.offset is not None
        start = info.offset + pages[1] * pool.page_bytes
        assert bytes(second[start : start + pool.page_bytes]) == pool.page("v", 1, pages[1]).numpy().tobytes()
        aux = pool.aux_infos[0]
        assert aux.offset is not None
        row = torch.frombuffer(bytearray(second[aux.offset + 2 * 64 : aux.offset + 3 * 64]), dtype=torch.int32)
        assert int(row[0]) == int(pool.aux["output_ids"][2, 0])
    assert int(pool.aux["bootstrap_room"][2, 0]) == 0xDEADBEEF
    path = pool.shm_path
    pool.close()
    assert not os.path.exists(path)


def test_page_and_slot_allocation() -> None:
    with KVPool(layers=1, local_heads=1, head_dim=4, num_pages=4, aux_slots=2) as pool:
        assert pool.allocate_pages(3) == [0, 1, 2]
        with pytest.raises(MemoryError):
            pool.allocate_pages(2)
        pool.free_pages([1])
        assert pool.allocate_pages(2) == [1, 3]
        with pytest.raises(ValueError, match="not allocated"):
            pool.free_pages([5])
        with pytest.raises(ValueError, match="not allocated"):
            pool.free_pages([0, 0])
        a, b = pool.allocate_aux_slot(), pool.allocate_aux_slot()
        assert (a, b) == (0, 1)
        pool.aux["output_ids"][a, 0] = 9
        pool.free_aux_slot(a)
        assert int(pool.aux["output_ids"][a, 0]) == 0
        assert pool.allocate_aux_slot() == a
        with pytest.raises(MemoryError):
            pool.allocate_aux_slot()


def test_the_spec_model_is_the_reference_engines_own() -> None:
    """geometry.SPEC_MODEL (what tests and the demo give a PDCluster) describes build_model's model
    and the pool's aux rows, so a registration fits the spec it is checked against."""
    from pdfabric_refengine import AUX_ITEMS
    from pdfabric_refengine.geometry import SPEC_MODEL

    shape = model_shape(build_model(0))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, shape.page_size) == (
        SPEC_MODEL["layers"], SPEC_MODEL["kvHeads"], SPEC_MODEL["headDim"], SPEC_MODEL["dtype"],
        SPEC_MODEL["pageSizeTokens"],
    )  # fmt: skip
    assert [item.width * item.dtype.itemsize for item in AUX_ITEMS] == SPEC_MODEL["auxRowBytes"]
