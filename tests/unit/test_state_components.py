"""Typed state components (issue 25): each kind's planning rule, exhaustive over TP ratios, played
out on bytes through ``plan_transfer``; the spec's list and its refusals; the registration's typed
state on the wire, read from SGLang's KVArgs, and checked against the spec."""

from __future__ import annotations

import itertools
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdfabric_agent.memory.plan import Bases, TransferSide, plan_transfer
from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_agent.protocol.buffers import StateParts
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_memory import MemoryRules, engine_layout
from pdfabric_core.duties import decode_targets, replica_duties, sender_duties
from pdfabric_core.policy.state_slices import state_share
from pdfabric_core.policy.types import MemPool, Role, StateKind, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_core.traffic import pair_traffic

TPS = [1, 2, 4, 8]
RATIOS = [(p, d) for p in TPS for d in TPS if p % d == 0 or d % p == 0]
HEADS, TOKENS, HEAD_DIM = 8, 4, 2  # float32: a head of a token is 8 bytes


def spec(prefill: dict[str, Any], decode: dict[str, Any], **model: Any) -> PDClusterSpec:
    geo = {"layers": 2, "kvHeads": HEADS, "headDim": HEAD_DIM, "dtype": "float32", "pageSizeTokens": TOKENS}
    return parse_spec({"prefill": prefill, "decode": decode, "model": {**geo, **model}})


MAMBA = {"stateTensorBytes": [480, 480, 512, 512], "stateTensorSharded": [True, True, True, False]}
# GDN: a conv tensor of q | k | v sub-blocks sharded apart, and a temporal tensor.
GDN = {"stateTensorBytes": [256, 512], "stateTensorSharded": [True, True], "stateTensorBlocks": [[64, 64, 128], []]}
SWA = {"stateKind": "page", "stateTensorBytes": [HEADS * TOKENS * 8] * 4}
# SWA K and V pages, then their MXFP8 block scales (one byte a head a token): SGLang's swa + block_scale_swa.
SWA_SCALES = {"stateKind": "page", "stateTensorBytes": [HEADS * TOKENS * 8] * 2 + [HEADS * TOKENS] * 2}
ROW = {"stateKind": "row", "stateTensorBytes": [40, 24]}


def layout(s: PDClusterSpec, tp: int, slots: int) -> PoolLayout:
    lay = PoolLayout.from_geometry(s.model, tp, kv_pages=1, state_slots=slots, aux_slots=1)
    return lay if s.model.state_kind is not StateKind.PAGE else _token_major(lay)


def _token_major(lay: PoolLayout) -> PoolLayout:
    import dataclasses

    return dataclasses.replace(lay, page_order=PageOrder.TOKEN_MAJOR)


def whole_item(s: PDClusterSpec, tensor: int, index: int) -> np.ndarray[Any, Any]:
    """The whole (unsharded) item ``index`` of a tensor: distinct bytes per tensor and index; page
    state as [token][head][head bytes]."""
    rng = np.random.default_rng(1000 * tensor + index)
    return rng.integers(1, 255, s.model.state_tensors[tensor], dtype=np.uint8)


def local_item(s: PDClusterSpec, tensor: int, index: int, tp: int, rank: int) -> np.ndarray[Any, Any]:
    """What TP rank ``rank`` holds of the whole item: its contiguous share (slot), its heads of
    every token row (page), all of it (replicated, row)."""
    whole = whole_item(s, tensor, index)
    if not s.model.state_sharded[tensor]:
        return whole
    if s.model.state_kind is StateKind.PAGE:
        rows = whole.reshape(TOKENS, HEADS, -1)
        heads = HEADS // tp  # TPS stay within the KV heads: no replicated heads here
        return rows[:, rank * heads : (rank + 1) * heads].reshape(-1)
    out, at = [], 0
    for block in s.model.state_blocks(tensor):  # each sub-block's share, in turn
        share = block // tp
        out.append(whole[at + rank * share : at + (rank + 1) * share])
        at += block
    return np.concatenate(out)


def play(s: PDClusterSpec, src_idx: list[int], dst_idx: list[int]) -> dict[int, np.ndarray[Any, Any]]:
    """Every prefill rank's state blocks for one room, executed on byte arrays; each decode rank's state."""
    p, d = s.prefill.tp, s.decode.tp
    slots = max(*src_idx, *dst_idx) + 1
    src_lay, dst_lay = layout(s, p, slots), layout(s, d, slots)
    decode = {r: np.zeros(dst_lay.state_bytes, np.uint8) for r in range(d)}
    for prank in range(p):
        src = np.zeros(src_lay.state_bytes, np.uint8)
        for t in range(len(s.model.state_tensors)):
            for n, i in enumerate(src_idx):
                off = src_lay.state_offset(t, i)
                item = local_item(s, t, n, p, prank)
                src[off : off + len(item)] = item
        for route in decode_targets(s, prank):
            duties = sender_duties(s, route, 0, 1)
            assert duties is not None
            plan = plan_transfer(
                duties,
                TransferSide(src_lay, Bases(0, 0, 0), [0], src_idx, None),
                TransferSide(dst_lay, Bases(0, 0, 0), [0], dst_idx, None),
            )
            dst = decode[route.decode_tp_rank]
            for b in plan.state:
                assert not dst[b.dst : b.dst + b.length].any(), "a state byte written twice"
                dst[b.dst : b.dst + b.length] = src[b.src : b.src + b.length]
    return decode


@pytest.mark.parametrize(
    "model", [MAMBA, GDN, SWA, SWA_SCALES, ROW], ids=["slot", "slot-blocks", "page", "page-scales", "row"]
)
@pytest.mark.parametrize(("ptp", "dtp"), RATIOS)
def test_each_kinds_rule_lands_every_decode_ranks_share_exactly_once(model: dict[str, Any], ptp: int, dtp: int) -> None:
    s = spec({"tp": ptp}, {"tp": dtp}, **model)
    src_idx, dst_idx = [3, 1], [0, 2]  # two state indices (pages or slots), in different places
    got = play(s, src_idx, dst_idx)
    dst_lay = layout(s, dtp, max(*src_idx, *dst_idx) + 1)
    m = s.model
    for t, (tp, rank) in itertools.product(
        range(len(m.state_tensors)), [(ptp, r) for r in range(ptp)] + [(dtp, r) for r in range(dtp)]
    ):
        share = state_share(m.state_kind, whole_item(s, t, 0).tobytes(), sharded=m.state_sharded[t], blocks=m.state_blocks(t),
                            tp=tp, rank=rank, kv_heads=HEADS, page_tokens=TOKENS)  # fmt: skip
        assert share == local_item(s, t, 0, tp, rank).tobytes()  # the synthetic traffic's share is the rule's
    for drank, mem in got.items():
        want = np.zeros_like(mem)
        for t in range(len(s.model.state_tensors)):
            for n, i in enumerate(dst_idx):
                off = dst_lay.state_offset(t, i)
                item = local_item(s, t, n, dtp, drank)
                want[off : off + len(item)] = item
        assert (mem == want).all(), (drank, model)
    # The prediction the operator's status and the decode's owed bytes use is what moved.
    predicted = sum(b.state for b in pair_traffic(s, 1, state_slots=len(src_idx)).values())
    assert predicted == dtp * len(dst_idx) * sum(s.model.state_item_bytes(dtp))


def test_a_tp_sharded_slot_tensor_moves_as_sglangs_mooncake_slices_it() -> None:
    """SGLang's compute_mamba_state_slice_blocks, by hand: aggregation (TP 2 -> 1) writes each
    prefill shard at writer index x shard; scatter (TP 1 -> 2) reads decode rank r's shard at r x share."""
    agg = spec({"tp": 2}, {"tp": 1}, **MAMBA)
    for prank in (0, 1):
        (route,) = decode_targets(agg, prank)
        duties = sender_duties(agg, route, 0, 1)
        assert duties is not None
        slices = {(sl.tensor, sl.src_offset, sl.dst_offset, sl.length) for sl in duties.state_slices}
        want = {(0, 0, prank * 240, 240), (1, 0, prank * 240, 240), (2, 0, prank * 256, 256)}
        assert slices == want | ({(3, 0, 0, 512)} if prank == 0 else set())  # replicated: one writer
    scatter = spec({"tp": 1}, {"tp": 2}, **MAMBA)
    for route in decode_targets(scatter, 0):
        duties = sender_duties(scatter, route, 0, 1)
        assert duties is not None
        r = route.decode_tp_rank
        assert [(sl.tensor, sl.src_offset, sl.length) for sl in duties.state_slices] == [
            (0, r * 240, 240), (1, r * 240, 240), (2, r * 256, 256), (3, 0, 512)
        ]  # fmt: skip


def test_cp_sends_each_component_from_cp_rank_0_or_by_the_layer_split() -> None:
    for model in (MAMBA, SWA, ROW):
        s = spec({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, **model)
        by_cp = {p.cp_rank: p.duties for p in replica_duties(s, 4)}
        assert by_cp[0].state_slices and not by_cp[1].state_slices and by_cp[1].state_skipped
        assert by_cp[1].skipped_state_bytes == by_cp[0].state_bytes == sum(s.model.state_tensors)
        split = spec({"tp": 1, "cp": 2, "allCpRanksTransfer": True, "dsaCacheLayerSplit": True}, {"tp": 1}, **model)
        owned = {p.cp_rank: {sl.tensor for sl in p.duties.state_slices} for p in replica_duties(split, 4)}
        assert owned == ({0: {0, 1}, 1: {2, 3}} if len(split.model.state_tensors) == 4 else {0: {0}, 1: {1}})


def test_the_legacy_state_is_a_list_of_equal_replicated_slot_tensors() -> None:
    s = spec({"tp": 2}, {"tp": 1}, stateBytesPerRequest=2048, stateLayers=4)
    m = s.model
    assert (m.state_kind, m.state_tensors, m.state_sharded) == (StateKind.SLOT, (512,) * 4, (False,) * 4)
    typed = spec({"tp": 2}, {"tp": 1}, **MAMBA)
    assert (typed.model.state_layers, typed.model.state_bytes_per_request) == (4, 1984)  # derived
    assert typed.model.state_item_bytes(2) == (240, 240, 256, 512)


@pytest.mark.parametrize(
    ("prefill", "model", "words"),
    [
        ({"tp": 1}, {"stateKind": "page"}, "need model.stateTensorBytes"),
        ({"tp": 1}, {"stateTensorSharded": [True]}, "need model.stateTensorBytes"),
        ({"tp": 1}, {"stateTensorBytes": [100, 100], "stateTensorSharded": [True]}, "1 entries for 2"),
        ({"tp": 4}, {"stateTensorBytes": [6], "stateTensorSharded": [True]}, "does not split evenly"),
        ({"tp": 1, "pp": 2}, {"stateTensorBytes": [64]}, "pipeline parallelism"),
        ({"tp": 1}, {"stateKind": "page", "stateTensorBytes": [100]}, "not whole pages"),
        ({"tp": 1}, {"stateKind": "row", "stateTensorBytes": [8], "stateTensorSharded": [True]}, "row is whole"),
        ({"tp": 1}, {"stateTensorBytes": [8, 8], "stateLayers": 3}, "disagree with model.stateTensorBytes"),
        ({"tp": 1}, {"stateTensorBytes": [8], "stateTensorSharded": [True], "stateTensorBlocks": [[4, 2]]}, "sum to"),
        ({"tp": 1}, {"stateTensorBytes": [8], "stateTensorBlocks": [[4, 4]]}, "TP-sharded slot tensors only"),
        ({"tp": 4}, {"stateTensorBytes": [12], "stateTensorSharded": [True], "stateTensorBlocks": [[6, 6]]}, "evenly"),
        ({"tp": 1}, {"stateKind": "page", "stateTensorBytes": [256], "stateTensorBlocks": [[128, 128]]}, "page is"),
        ({"tp": 1}, {"stateTensorBytes": [8], "stateBytesPerRequest": 9}, "disagree with model.stateTensorBytes"),
    ],
)
def test_the_spec_refuses_state_its_rules_cannot_move(
    prefill: dict[str, Any], model: dict[str, Any], words: str
) -> None:
    with pytest.raises(SpecError, match=words):
        spec(prefill, {"tp": 1}, **model)


def test_sharded_state_off_the_kv_routes_is_refused() -> None:
    """One KV head over prefill TP 2: decode TP 2 rank 1 takes KV from prefill rank 0 only, but its
    half of a sharded state is on prefill rank 1."""
    with pytest.raises(SpecError, match="along KV routes"):
        parse_spec({"prefill": {"tp": 2}, "decode": {"tp": 1}, "model": {"kvHeads": 1, "stateTensorBytes": [64],
                    "stateTensorSharded": [True]}})  # fmt: skip


# ---------------------------------------------------------------- the registration
def share(n: int, at: int) -> BufferShare:
    return BufferShare(ShareKind.SHM, n, at, path="/dev/shm/pool")


def registration(parts: StateParts | None, items: list[int], slots: int = 3) -> MemoryRegistration:
    kv = [share(4 * 128, i * 512) for i in range(4)]
    state = [share(slots * n, 4096 + 8192 * i) for i, n in enumerate(items)]
    slot_bytes = items[0] if items and len(set(items)) == 1 else 0
    return MemoryRegistration("prefill-0-tp0", PageOrder.TOKEN_MAJOR, TOKENS, 128, kv[:2], kv[2:], slot_bytes,
                              state, [64], [share(64, 60000)], state_parts=parts)  # fmt: skip


def test_typed_state_travels_on_the_wire_and_bad_parts_are_refused() -> None:
    parts = StateParts(StateKind.SLOT, "mamba", (240, 240, 256), (True, True, False))
    reg = registration(parts, [240, 240, 256])
    body = reg.to_json()
    assert body["state_parts"] == {"kind": "slot", "source": "mamba", "item_bytes": [240, 240, 256],
                                   "sharded": [True, True, False]}  # fmt: skip
    assert MemoryRegistration.parse(body) == reg
    assert "state_parts" not in registration(None, [64]).to_json()  # an untyped one reads as before
    for bad in ({"kind": "ring"}, {**body["state_parts"], "item_bytes": [240]}, {**body["state_parts"], "sharded": [1, 1, 0]},
                {**body["state_parts"], "item_bytes": [240, 0, 256]}):  # fmt: skip
        with pytest.raises(ApiError) as exc:
            MemoryRegistration.parse({**body, "state_parts": {**body["state_parts"], **bad}})
        assert exc.value.status == 400


TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)


def test_the_agent_takes_the_state_the_spec_names_and_refuses_another_with_both_sides() -> None:
    s = spec({"tp": 2}, {"tp": 1}, **{**MAMBA, "layers": 2, "kvHeads": 2, "headDim": 8})
    rank = Rank(Role.PREFILL, 0, 0)
    items = [240, 240, 256, 512]
    lay = engine_layout(registration(StateParts(StateKind.SLOT, "mamba", tuple(items), (True, True, True, False)), items),
                        s, rank, TCP)  # fmt: skip
    assert (lay.state_items, lay.state_whole, lay.state_kind, lay.state_slots) == (
        tuple(items),
        (480, 480, 512, 512),
        "slot",
        3,
    )
    swa = StateParts(StateKind.PAGE, "swa", tuple(items), (True,) * 4)
    with pytest.raises(ApiError) as exc:
        engine_layout(registration(swa, items), s, rank, TCP)
    msg = exc.value.message
    assert exc.value.status == 422 and "page state (SGLang's swa state)" in msg and "has slot state" in msg
    # What to set, derived from the registration: a page of this rank's one head of two, whole.
    assert msg.endswith('spec.model {"stateKind": "page", "stateTensorBytes": [480, 480, 512, 1024]}')
    with pytest.raises(ApiError, match="TP-sharded"):
        engine_layout(registration(None, [240] * 4), s, rank, TCP)  # an untyped (replicated) registration


def test_prefill_refuses_a_decode_of_another_state_by_name() -> None:
    a, b = spec({"tp": 1}, {"tp": 1}, **MAMBA), spec({"tp": 1}, {"tp": 1}, **ROW)
    duties = sender_duties(a, decode_targets(a, 0)[0], 0, 1)
    assert duties is not None
    with pytest.raises(ValueError, match=r"slot state of tensors \[480, 480, 512, 512\].*row state of \[40, 24\]"):
        plan_transfer(duties, TransferSide(layout(a, 1, 2), Bases(0, 0, 0), [0], [0], None),
                      TransferSide(layout(b, 1, 2), Bases(0, 0, 0), [0], [1], None))  # fmt: skip


# ---------------------------------------------------------------- SGLang's KVArgs
def kvargs(types_: list[Any], items: list[list[int]], **extra: Any) -> Any:
    n = [len(i) for i in items]
    fields = {
        "state_types": types_,
        "state_data_ptrs": [[0] * k for k in n],
        "state_data_lens": [[1] * k for k in n],
        "state_item_lens": items,
        "state_dim_per_tensor": [[0] * k for k in n],
        "state_conv_shard_groups": [[None] * k for k in n],
        "state_slice_outer_counts": [[1] * k for k in n],
        "state_layer_ids": [list(range(k)) for k in n],
    }
    return types.SimpleNamespace(**{**fields, **extra})


def test_sglangs_mamba_pool_registers_as_slot_state_of_two_sizes_head_sharded() -> None:
    import torch
    from pdfabric_sglang.state_kinds import state_parts
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = Mamba2StateShape.create(tp_world_size=2, intermediate_size=64, n_groups=2, num_heads=4, head_dim=8,
                                    state_size=4, conv_kernel=4)  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape, layers=[1, 3], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    pool = MambaPool(size=4, spec_state_size=4, cache_params=params, mamba_layer_ids=[1, 3], device="cpu")
    args = kvargs([], [])
    append_state_component(args, StateType.MAMBA, *pool.get_contiguous_buf_infos(), pool.get_state_dim_per_tensor(),
                           pool.get_state_conv_shard_groups(), pool.get_state_slice_outer_counts(),
                           pool.get_state_layer_ids())  # fmt: skip
    parts = state_parts(args, is_mla=False)
    assert parts == StateParts(StateKind.SLOT, "mamba", (240, 240, 256, 256), (True,) * 4)


def test_sglangs_gdn_pool_registers_its_conv_sub_blocks_in_whole_bytes() -> None:
    """Qwen3-Next's shape (SGLang's qwen3_next config): conv = q | k | v, each head-sharded apart."""
    import torch
    from pdfabric_sglang.state_kinds import state_parts
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component
    from sglang.srt.mem_cache.memory_pool import MambaPool

    key_dim, value_dim = 2 * 4, 4 * 8
    shape = Mamba2StateShape.create(tp_world_size=2, intermediate_size=value_dim, n_groups=2, num_heads=4, head_dim=8,
                                    state_size=4, conv_kernel=4, conv_shard_groups=[key_dim, key_dim, value_dim])  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    pool = MambaPool(size=2, spec_state_size=2, cache_params=params, mamba_layer_ids=[0], device="cpu")
    args = kvargs([], [])
    append_state_component(args, StateType.MAMBA, *pool.get_contiguous_buf_infos(), pool.get_state_dim_per_tensor(),
                           pool.get_state_conv_shard_groups(), pool.get_state_slice_outer_counts(),
                           pool.get_state_layer_ids())  # fmt: skip
    parts = state_parts(args, is_mla=False)
    # conv at TP 2: 24 dims x 3 x bf16 = 144 bytes, 6 a dim; whole q, k, v: 8, 8, 32 dims.
    assert parts == StateParts(StateKind.SLOT, "mamba", (144, 256), (True, True), ((48, 48, 192), ()))
    s = spec({"tp": 2}, {"tp": 1}, stateTensorBytes=[288, 512], stateTensorSharded=[True, True],
             stateTensorBlocks=[[48, 48, 192]], layers=2, kvHeads=2, headDim=8)  # fmt: skip
    items = list(parts.item_bytes)
    reg = registration(parts, items)
    assert engine_layout(reg, s, Rank(Role.PREFILL, 0, 0), TCP).state_items == (144, 256)
    assert MemoryRegistration.parse(reg.to_json()) == reg
    with pytest.raises(ApiError, match="stateTensorBlocks"):
        engine_layout(registration(StateParts(StateKind.SLOT, "mamba", (144, 256), (True, True)), items), s,
                      Rank(Role.PREFILL, 0, 0), TCP)  # fmt: skip


def test_an_swa_state_on_an_mha_model_is_page_state() -> None:
    """The bug this fixes: a lone SWA component registered as slot state (one per request)."""
    from pdfabric_sglang.state_kinds import state_parts
    from sglang.srt.disaggregation.base.conn import StateType

    parts = state_parts(kvargs([StateType.SWA], [[512] * 4]), is_mla=False)
    assert parts is not None and (parts.kind, parts.source, parts.sharded) == (StateKind.PAGE, "swa", (True,) * 4)
    row = state_parts(kvargs([StateType.REQUEST_ROW], [[64]]), is_mla=False)
    assert row == StateParts(StateKind.ROW, "request_row", (64,), (False,))
    assert state_parts(kvargs([], []), is_mla=False) is None


@pytest.mark.parametrize(
    ("names", "extra", "is_mla", "words"),
    [
        (["dsa"], {}, False, "'dsa' indexer state beside an MHA pool"),
        (["swa", "block_scale"], {}, False, r"\['block_scale'\] would not move"),
        (["swa", "c128_state"], {}, False, r"\['c128_state'\] would not move"),  # DeepSeek-V4's pair
        (["mamba", "dsa"], {}, False, r"\['dsa'\] would not move"),
        (["swa"], {}, True, "beside MLA"),
        (["mamba"], {"state_slice_outer_counts": [[3, 1]]}, False, "Kimi"),
    ],
)
def test_what_is_not_moved_is_refused_by_its_sglang_name(
    names: list[str], extra: dict[str, Any], is_mla: bool, words: str
) -> None:
    from pdfabric_sglang.state_kinds import state_parts
    from sglang.srt.disaggregation.base.conn import StateType

    from pdfabric_agent.client.shares import UnshareableBuffer

    args = kvargs([StateType(n) for n in names], [[32, 32] for _ in names])
    for k, v in extra.items():
        setattr(args, k, v)
    with pytest.raises(UnshareableBuffer, match=words):
        state_parts(args, is_mla=is_mla)


def test_all_ratios_are_covered() -> None:
    assert set(itertools.chain(*RATIOS)) == set(TPS) and (8, 1) in RATIOS and (1, 8) in RATIOS


def test_on_sglangs_cpu_engine_the_plugin_allocates_the_mamba_state_where_the_agent_maps_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's hook around MambaPool's constructor (its target path resolves in this SGLang):
    with pdfabric the backend on the CPU, every state buffer SGLang registers is a shared-memory
    file in PDFABRIC_SHM_DIR; else SGLang's private memory, as before."""
    import importlib

    import torch
    from pdfabric_sglang import plugin
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from pdfabric_agent.client.shares import process_mappings, share_of

    assert plugin.pdfabric_is_the_backend() is False  # no serving process here: no runtime context, no raise
    module, cls, attr = plugin.MAMBA_POOL_INIT.rsplit(".", 2)
    assert getattr(getattr(importlib.import_module(module), cls), attr) is not None
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=8,
                                    state_size=4, conv_kernel=4)  # fmt: skip
    params = Mamba2CacheParams(
        shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    )
    kwargs = {"size": 2, "spec_state_size": 2, "cache_params": params, "mamba_layer_ids": [0], "device": "cpu"}
    monkeypatch.setenv("PDFABRIC_SHM_DIR", str(tmp_path))
    for backend in (True, False):
        monkeypatch.setattr(plugin, "pdfabric_is_the_backend", lambda on=backend: on)
        pool = MambaPool.__new__(MambaPool)
        plugin.cpu_state_pool_in_shm(MambaPool.__init__, pool, **kwargs)
        ptrs, lens, _ = pool.get_contiguous_buf_infos()
        maps = process_mappings()
        if backend:
            shares = [share_of(p, n, None, maps) for p, n in zip(ptrs, lens, strict=True)]
            assert {(s.kind, Path(s.path).parent) for s in shares} == {(ShareKind.SHM, tmp_path)}
        else:
            with pytest.raises(ValueError):
                share_of(ptrs[0], lens[0], None, maps)
