"""Fused K and V buffers (``MemoryRegistration.fused``: vLLM keeps a layer's K and V in one buffer,
``[head][K tokens | V tokens]`` per page on its CPU backend): the agent takes one buffer per layer
whose pages are twice a K page, a head's share of a page one run twice as long, and plans head
slices between TP sizes exactly as for split buffers; a fused layout against a split one is refused
when planned, naming both."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from pdfabric_agent.memory.plan import MemoryMap, TransferSide, decode_targets, plan_transfer, sender_duties
from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_memory import MemoryRules, engine_layout
from pdfabric_core.policy.types import MemPool, Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import parse_spec

TOKENS, HEADS, DIM, ELEM = 32, 2, 32, 4
MODEL = {"layers": 2, "kvHeads": HEADS, "headDim": DIM, "dtype": "float32", "pageSizeTokens": TOKENS}
HEAD_UNIT = TOKENS * 2 * DIM * ELEM  # one head's K and V of one page
TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)


def spec(prefill_tp: int = 1, decode_tp: int = 1) -> object:
    return parse_spec({"prefill": {"tp": prefill_tp}, "decode": {"tp": decode_tp}, "transfer": {"transport": "tcp"},
                       "model": MODEL})  # fmt: skip


def fused(rank: str, heads: int, pages: int = 4, layers: int = 2) -> MemoryRegistration:
    page = heads * HEAD_UNIT
    shares = [BufferShare(ShareKind.SHM, pages * page, i * pages * page, path="/dev/shm/x") for i in range(layers)]
    return MemoryRegistration(rank, PageOrder.HEAD_MAJOR, TOKENS, page, [], [], 0, [], [], [], fused=shares)


def layout(reg: MemoryRegistration, s: object, role: Role = Role.PREFILL, tp_rank: int = 0) -> PoolLayout:
    return engine_layout(reg, s, Rank(role, 0, tp_rank), TCP)  # type: ignore[arg-type]


def test_a_fused_registration_is_one_buffer_per_layer_of_double_heads() -> None:
    reg = fused("prefill-0-tp0-cp0", HEADS)
    assert MemoryRegistration.parse(reg.to_json()) == reg and reg.kv_buffers() == reg.fused
    lay = layout(reg, spec())
    assert (lay.kv_buffers, lay.head_bytes, lay.local_heads, lay.kv_pages) == (1, HEAD_UNIT, HEADS, 4)
    split = PoolLayout.from_geometry(spec().model, 1, kv_pages=4, state_slots=0, aux_slots=0)  # type: ignore[attr-defined]
    assert dataclasses.replace(split.fused(), aux_items=lay.aux_items, state_slots=lay.state_slots) == lay
    # A page's bytes over a layer's buffers are the split layout's: K and V together are K plus V.
    assert lay.page_bytes * lay.kv_buffers == split.page_bytes * split.kv_buffers


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"kv_page_bytes": HEADS * HEAD_UNIT // 2}, "K and V together"),
        ({"fused": [BufferShare(ShareKind.SHM, 4 * HEADS * HEAD_UNIT, 0, path="/dev/shm/x")] * 3}, "3 fused K and V"),
    ],
)
def test_a_fused_registration_that_does_not_fit_the_model_is_refused(change: dict[str, object], says: str) -> None:
    reg = dataclasses.replace(fused("prefill-0-tp0-cp0", HEADS), **change)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as exc:
        layout(reg, spec())
    assert exc.value.status == 422 and says in str(exc.value)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"k": [{"kind": "shm", "nbytes": 64, "offset": 0, "path": "/dev/shm/x"}]}, "instead of K and V"),
        ({"kv_kind": "MLA", "latent": [{"kind": "shm", "nbytes": 64, "offset": 0, "path": "/dev/shm/x"}]}, "MHA's"),
    ],
)
def test_fused_buffers_come_alone(extra: dict[str, object], says: str) -> None:
    body = {**fused("prefill-0-tp0-cp0", HEADS).to_json(), **extra}
    with pytest.raises(ApiError, match=says):
        MemoryRegistration.parse(body)


def test_fused_head_slices_move_each_heads_k_and_v() -> None:
    """Prefill TP 1 -> decode TP 2 in vLLM's pages: decode rank 1 gets head 1's K and V of every page,
    at its own pages, and nothing else."""
    s = spec(1, 2)
    src = layout(fused("prefill-0-tp0-cp0", HEADS), s)
    dst = layout(fused("decode-0-tp1", 1), s, Role.DECODE, 1)
    layers, pages = 2, 4
    src_buf = (ctypes.c_uint8 * (layers * pages * HEADS * HEAD_UNIT))()
    dst_buf = (ctypes.c_uint8 * (layers * pages * HEAD_UNIT))()
    for i in range(len(src_buf)):
        src_buf[i] = (i * 7 + 3) % 251
    src_map = MemoryMap(tuple(ctypes.addressof(src_buf) + i * pages * HEADS * HEAD_UNIT for i in range(layers)), (), ())
    dst_map = MemoryMap(tuple(ctypes.addressof(dst_buf) + i * pages * HEAD_UNIT for i in range(layers)), (), ())
    target = decode_targets(s, 0)[1]
    duties = sender_duties(s, target, 0, 2)
    assert duties is not None
    plan = plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None), TransferSide(dst, dst_map, [0, 2], [], None))  # fmt: skip
    for b in plan.kv:
        ctypes.memmove(b.dst, b.src, b.length)
    for layer in range(layers):
        for sp, dp in ((3, 0), (1, 2)):
            s_off = (layer * pages + sp) * HEADS * HEAD_UNIT + 1 * HEAD_UNIT  # head 1: its K and its V
            d_off = (layer * pages + dp) * HEAD_UNIT
            assert bytes(dst_buf[d_off : d_off + HEAD_UNIT]) == bytes(src_buf[s_off : s_off + HEAD_UNIT])
    assert sum(b.length for b in plan.kv) == layers * 2 * HEAD_UNIT
    # SGLang's split K and V against vLLM's fused pages: refused when planned, naming both.
    split = dataclasses.replace(dst, kv_buffers=2, head_bytes=HEAD_UNIT // 2)
    with pytest.raises(ValueError, match="fused"):
        plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None), TransferSide(split, dst_map, [0, 2], [], None))  # fmt: skip


def test_only_k_and_v_buffers_fuse() -> None:
    latent = PoolLayout.from_geometry(
        parse_spec({"prefill": {"tp": 1}, "decode": {"tp": 1}, "transfer": {"transport": "tcp"},
                    "model": {**MODEL, "kvKind": "MLA", "kvHeads": 1, "kvLoraRank": 512, "qkRopeHeadDim": 64}}).model,
        1, kv_pages=1, state_slots=0, aux_slots=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="only K and V buffers fuse"):
        latent.fused()


def test_a_decode_rooms_fused_layout_is_the_specs_fused() -> None:
    """The prefill agent's check of a decode rank's room info (``room_info_checks.check_dst_layout``) takes the spec's
    layout fused when the decode engine registered fused buffers, and nothing else."""
    s = spec()
    want = PoolLayout.from_geometry(s.model, 1, kv_pages=4, state_slots=0, aux_slots=0)  # type: ignore[attr-defined]
    got = layout(fused("decode-0-tp0", HEADS), s, Role.DECODE)
    assert dataclasses.replace(want.fused(), aux_items=got.aux_items, state_slots=got.state_slots) == got
