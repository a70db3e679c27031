"""MLA as a KV kind (issue 25): the spec describes one latent buffer per layer, the rules route it
as SGLang's MLA backends do (every prefill attention-TP rank holds the whole latent, a decode rank
takes each page from one of them, the others complete with nothing to send), the traffic
prediction counts one buffer per layer, and SGLang's MLA KVArgs register as latent buffers that the
agent checks against the model."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_memory import EngineMemory, MemoryRules, engine_layout
from pdfabric_core.duties import decode_targets, expected_sources, prefill_rank_sends, sender_duties
from pdfabric_core.policy.rank_mapping import KvRoute, kv_buffers_per_layer, tp_kv_heads
from pdfabric_core.policy.types import KvKind, MemPool, Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_core.traffic import estimate_traffic

LATENT = {"kvKind": "MLA", "kvLoraRank": 16, "qkRopeHeadDim": 8}  # 24 elements per token
MODEL = {**LATENT, "layers": 3, "dtype": "float32", "pageSizeTokens": 16, "auxRowBytes": [64]}
PAGE = 16 * 24 * 4  # tokens x latent x bytes: the same on every TP rank


def mla(prefill: dict[str, Any], decode: dict[str, Any] | None = None, **model: Any) -> PDClusterSpec:
    return parse_spec({"prefill": prefill, "decode": decode or {"tp": 1}, "transfer": {"transport": "tcp"},
                       "model": {**MODEL, **model}})  # fmt: skip


def test_the_kinds_rules() -> None:
    assert (kv_buffers_per_layer(KvKind.MHA), kv_buffers_per_layer(KvKind.MLA)) == (2, 1)
    assert (tp_kv_heads(KvKind.MHA, 8), tp_kv_heads(KvKind.MLA, 8)) == (8, 1)


def test_an_mla_model_is_one_latent_per_layer_whole_on_every_tp_rank() -> None:
    geo = mla({"tp": 8}).model
    assert (geo.kv_kind, geo.kv_buffers, geo.tp_kv_heads, geo.head_width) == (KvKind.MLA, 1, 1, 24)
    assert geo.kv_page_bytes(1) == geo.kv_page_bytes(8) == PAGE
    # DeepSeek-V3's latent in fp8: a byte per element and no scale beside it (SGLang's MLA pool).
    v3 = parse_spec({"model": {"kvKind": "MLA", "dtype": "float8_e4m3fn", "pageSizeTokens": 64}}).model
    assert (v3.kv_lora_rank, v3.qk_rope_head_dim, v3.kv_page_bytes(4)) == (512, 64, 64 * 576)
    assert "a latent of 576 (kvLoraRank 512 + qkRopeHeadDim 64)" in v3.describe_page(4)
    # kvHeads is not read: any TP size splits an MLA model (an MHA one of 3 heads refuses TP 2).
    assert mla({"tp": 2}, kvHeads=3).model.tp_kv_heads == 1
    with pytest.raises(SpecError, match="do not divide"):
        parse_spec({"prefill": {"tp": 2}, "model": {"kvHeads": 3}})
    with pytest.raises(SpecError, match="kvKind must be one of MHA, MLA"):
        parse_spec({"model": {"kvKind": "mla"}})


def test_prefill_tp2_to_decode_tp1_takes_the_latent_from_one_rank_the_other_completes_empty() -> None:
    """SGLang's MLA decode pulls from ``target_tp_ranks[0]`` and counts one prefill response; the
    other prefill rank is a dummy that still reaches Success (``prefill_rank_sends`` False)."""
    spec = mla({"tp": 2})
    assert decode_targets(spec, 0) == [KvRoute(0, 0, 0, 0, 1, 1, 1)]
    assert decode_targets(spec, 1) == []
    assert prefill_rank_sends(spec, 0, 0) and not prefill_rank_sends(spec, 1, 0)
    assert expected_sources(spec, 0) == [(0, 0, 0)]
    duties = sender_duties(spec, decode_targets(spec, 0)[0], 0, 5)
    assert duties is not None and duties.route.whole_page and duties.pages == range(5) and duties.send_aux


def test_prefill_tp1_to_decode_tp2_sends_the_whole_latent_to_each_decode_rank() -> None:
    spec = mla({"tp": 1}, {"tp": 2})
    assert decode_targets(spec, 0) == [KvRoute(0, 0, 0, 0, 1, 1, 1), KvRoute(0, 1, 0, 0, 1, 1, 1)]
    assert [expected_sources(spec, d) for d in (0, 1)] == [[(0, 0, 0)], [(0, 0, 0)]]
    # Each decode rank's request rows come from its one source.
    assert all(sender_duties(spec, r, 0, 4).send_aux for r in decode_targets(spec, 0))  # type: ignore[union-attr]


def test_prefill_cp_shards_and_state_dedup_apply_to_mla_unchanged() -> None:
    spec = mla({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, stateBytesPerRequest=96, stateLayers=3)
    route = decode_targets(spec, 0)[0]
    d0, d1 = (sender_duties(spec, route, cp, 5) for cp in (0, 1))
    assert d0 is not None and d1 is not None
    assert (d0.pages, d1.pages) == (range(0, 3), range(3, 5))
    assert (d0.state_layers, d1.state_layers, d1.state_skipped) == (range(3), range(0), True)
    assert expected_sources(spec, 0) == [(0, 0, 0), (0, 1, 0)]
    only_rank0 = mla({"tp": 1, "cp": 2})
    assert sender_duties(only_rank0, route, 1, 5) is None and expected_sources(only_rank0, 0) == [(0, 0, 0)]


@pytest.mark.parametrize(
    ("prefill", "dtp"), [({"tp": 2}, 1), ({"tp": 1}, 2), ({"cp": 2, "allCpRanksTransfer": True}, 1)]
)
def test_predicted_kv_bytes_are_one_latent_per_layer_per_decode_rank(prefill: dict[str, Any], dtp: int) -> None:
    est = estimate_traffic(mla(prefill, {"tp": dtp}), prompt_tokens=80)
    assert est.kv_bytes == 5 * 3 * 1 * dtp * PAGE  # pages x layers x one buffer x decode ranks x page
    assert est.aux_bytes == dtp * 64


def test_an_mla_pool_layout_has_one_buffer_per_layer() -> None:
    lay = PoolLayout.from_geometry(mla({"tp": 2}).model, 2, kv_pages=4, state_slots=0, aux_slots=2)
    assert (lay.kv_buffers, lay.local_heads, lay.page_bytes) == (1, 1, PAGE)
    assert lay.kv_bytes == 3 * 4 * PAGE and lay.kv_offset(2, 0, 1) == (2 * 4 + 1) * PAGE
    assert PoolLayout.from_dict(lay.to_dict()) == lay


# ---------------------------------------------------------------- the registration
def shm(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "engine-pool"
    path.write_bytes(bytes(size))
    return path


def latent_reg(path: Path, *, layers: int = 3, pages: int = 4, page: int = PAGE) -> MemoryRegistration:
    latent = [BufferShare(ShareKind.SHM, pages * page, i * pages * page, path=str(path)) for i in range(layers)]
    aux = [BufferShare(ShareKind.SHM, 8 * 64, layers * pages * page, path=str(path))]
    return MemoryRegistration("prefill-0-tp1-cp0", PageOrder.TOKEN_MAJOR, 16, page, [], [], 0, [], [64], aux,
                              kv_kind=KvKind.MLA, latent=latent)  # fmt: skip


TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)
RANK = Rank(Role.PREFILL, 0, 1)


def refusal(reg: MemoryRegistration, spec: PDClusterSpec) -> str:
    with pytest.raises(ApiError) as exc:
        engine_layout(reg, spec, RANK, TCP)
    assert exc.value.status == 422
    return exc.value.message


def test_the_registration_carries_latent_buffers_on_the_wire() -> None:
    reg = latent_reg(Path("/dev/shm/x"))
    body = reg.to_json()
    assert (body["kv_kind"], len(body["latent"]), body["k"], body["v"]) == ("MLA", 3, [], [])
    assert MemoryRegistration.parse(body) == reg and len(reg.kv_buffers()) == 3
    from pdfabric_agent.protocol.errors import ApiError as Refused

    for bad in ({**body, "k": body["latent"], "v": body["latent"]}, {**body, "latent": []}, {**body, "kv_kind": "GQA"}):
        with pytest.raises(Refused):
            MemoryRegistration.parse(bad)
    mha = {**body, "kv_kind": "MHA", "k": body["latent"], "v": body["latent"], "latent": []}
    assert "kv_kind" not in MemoryRegistration.parse(mha).to_json()  # MHA reads as it always did


def test_the_agent_maps_an_mla_registration_as_one_buffer_per_layer(tmp_path: Path) -> None:
    path = shm(tmp_path, 3 * 4 * PAGE + 8 * 64)
    reg = latent_reg(path)
    lay = engine_layout(reg, mla({"tp": 2}), RANK, TCP)
    assert (lay.kv_buffers, lay.layers, lay.local_heads, lay.kv_pages, lay.page_bytes) == (1, 3, 1, 4, PAGE)
    mem = EngineMemory.map(reg, lay, shm_dir=str(tmp_path), gpu=0)
    try:
        kv = mem.memory_map.kv
        assert len(kv) == 3 and kv[1] - kv[0] == kv[2] - kv[1] == 4 * PAGE
        mem.memory_map.check(lay)
    finally:
        mem.close()


def test_the_agent_refuses_an_mla_registration_that_does_not_fit_the_model(tmp_path: Path) -> None:
    path = shm(tmp_path, 4 * 4 * PAGE + 8 * 64)
    spec = mla({"tp": 2})
    assert "kvKind MHA" in refusal(
        latent_reg(path), parse_spec({"prefill": {"tp": 2}, "model": MODEL | {"kvKind": "MHA"}})
    )
    assert "one latent buffer per layer" in refusal(latent_reg(path, layers=4), spec)
    assert "a latent of 24 (kvLoraRank 16 + qkRopeHeadDim 8)" in refusal(latent_reg(path, page=PAGE // 2), spec)
    k = latent_reg(path).latent
    mha = MemoryRegistration("prefill-0-tp1-cp0", PageOrder.TOKEN_MAJOR, 16, PAGE, k, k, 0, [], [], [])
    assert "MHA KV buffers registered" in refusal(mha, spec)


def sglang_mla_args(tmp_path: Path, **extra: Any) -> tuple[Any, Any]:
    """An MLA pool in SGLang's layout and the KVArgs its scheduler fills for it (no SGLang import)."""
    from pdfabric_refengine import KVPool, kv_args

    pool = KVPool(layers=3, local_heads=1, head_dim=24, num_pages=4, shm_dir=str(tmp_path), mla=True)
    args = kv_args(pool, engine_rank=1, page_size=16, kv_head_num=1, total_kv_head_num=1, cls=types.SimpleNamespace)
    for key, value in extra.items():
        setattr(args, key, value)
    return pool, args


def test_sglangs_mla_kvargs_register_as_latent_buffers(tmp_path: Path) -> None:
    from pdfabric_sglang.kvargs import registration

    pool, args = sglang_mla_args(tmp_path)
    try:
        assert not hasattr(args, "kv_head_num")  # SGLang's schedulers leave it unset for MLA
        reg = registration("prefill-0-tp1-cp0", args, is_mla=True, gpu=None, aux_inline=True)
        assert (reg.kv_kind, reg.k, reg.v, len(reg.latent), reg.kv_page_bytes) == (KvKind.MLA, [], [], 3, PAGE)
        assert [b.offset for b in reg.latent] == [i.offset for i in pool.k_infos]
        assert engine_layout(reg, mla({"tp": 2}), RANK, TCP).kv_buffers == 1
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"mla_compression_ratios": [4, 128]}, "compressed or hybrid MLA"),
        ({"is_hybrid_mla_backend": True}, "compressed or hybrid MLA"),
        ({"num_draft_entries": 3}, "3 draft KV buffers of 3 KV buffers in all"),  # no target left
        (
            {"state_types": ["dsa"], "state_data_ptrs": [[8]], "state_data_lens": [[0]], "state_item_lens": [[0]]},
            "shared top-k layers",
        ),
        (
            {"state_types": ["swa"], "state_data_ptrs": [[8]], "state_data_lens": [[64]], "state_item_lens": [[64]]},
            "'swa' beside MLA",
        ),
    ],
    ids=["deepseek-v4-compressed", "hybrid-mla", "draft-without-target", "dsa-shared-topk", "swa-beside-mla"],
)
def test_what_mla_registration_does_not_move_is_refused_by_its_name(
    tmp_path: Path, extra: dict[str, Any], named: str
) -> None:
    from pdfabric_sglang.kvargs import registration

    from pdfabric_agent.client.shares import UnshareableBuffer

    pool, args = sglang_mla_args(tmp_path, **extra)
    try:
        with pytest.raises(UnshareableBuffer, match=named):
            registration("prefill-0-tp1-cp0", args, is_mla=True, gpu=None, aux_inline=True)
    finally:
        pool.close()


def test_sglangs_kv_cache_sharding_is_read_from_its_parallel_state() -> None:
    """MLA pages striped over attention TP are moved by owner (the registration carries the shard
    group, held to spec.prefill.kvCacheSharding by the agent); striped over attention CP (any
    attention kind) they are refused at start, by SGLang's name; a shard group of one rank shards
    nothing."""
    from pdfabric_sglang.kvargs import published_kv_shard_size
    from pdfabric_sglang.manager import kv_sharding_refusal
    from sglang.srt.runtime_context import get_parallel

    assert kv_sharding_refusal(True) is None and published_kv_shard_size(True) == 1  # nothing published
    parallel = get_parallel()
    with parallel.override(enable_kv_cache_sharding=True, attn_tp_size=2, attn_cp_size=1):
        assert kv_sharding_refusal(True) is None  # MLA over attention TP: moved by page owner
        assert published_kv_shard_size(True) == 2
        assert kv_sharding_refusal(False) is None  # GQA without CP: SGLang's shard group is one rank
        assert published_kv_shard_size(False) == 1
    with parallel.override(enable_kv_cache_sharding=True, attn_tp_size=1, attn_cp_size=1):
        assert kv_sharding_refusal(True) is None and published_kv_shard_size(True) == 1
    with parallel.override(enable_kv_cache_sharding=True, attn_tp_size=2, attn_cp_size=4):
        for mla in (True, False):
            refused = kv_sharding_refusal(mla)
            assert refused is not None and refused.startswith("KV cache sharding over attention CP")
            assert "l % 4" in refused and "attention CP (4 ranks)" in refused
    with parallel.override(enable_kv_cache_sharding=False, attn_tp_size=2, attn_cp_size=2):
        assert kv_sharding_refusal(True) is None and published_kv_shard_size(True) == 1
    with parallel.override(enable_kv_cache_sharding=True):  # the option on, its group unreadable here
        refused = kv_sharding_refusal(True)
        assert refused is not None and "unpublished" in refused
