"""DeepSeek-V3.2 (DSA) as SGLang registers it (issue 25): the packed fp8 latent is an MLA KV packing
the spec describes (its bytes a token derived, never free-form), and the registration of SGLang's
own ``DSATokenToKVPool`` fits it; what does not fit is refused naming the field."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.ranks.engine_memory import MemoryRules, engine_layout
from pdfabric_core.policy.types import KvPacking, MemPool, Role, Transport, packed_fp8_token_bytes
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_core.traffic import estimate_traffic
from tests.sglang_dsa import INDEX_PAGE, PACKED_TOKEN, PAGE_TOKENS, dsa_kv_args, dsa_model, dsa_pool

pytest.importorskip("torch")

TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)
LAYERS = 3


def spec(model: dict[str, Any], prefill: dict[str, Any] | None = None) -> PDClusterSpec:
    return parse_spec({"prefill": prefill or {"tp": 1}, "transfer": {"transport": "tcp"}, "model": model})


def latent_only(layers: int = LAYERS) -> dict[str, Any]:
    return {k: v for k, v in dsa_model(layers).items() if not k.startswith("state")}


def test_the_packed_latent_is_656_bytes_a_token_derived_from_the_latent() -> None:
    assert packed_fp8_token_bytes(512, 64) == PACKED_TOKEN == 656  # 512 fp8 + 4 float32 scales + 64 bf16
    geo = spec(latent_only()).model
    assert geo.kv_packing is KvPacking.PACKED_FP8 and geo.packed
    assert (geo.head_token_bytes, geo.kv_page_bytes(1), geo.kv_page_bytes(8)) == (656, 64 * 656, 64 * 656)
    assert "packed fp8 latent of 656 bytes (kvLoraRank 512 fp8 + 4 float32 scales" in geo.describe_page(1)
    unpacked = spec({**latent_only(), "kvPacking": "none"}).model
    assert unpacked.head_token_bytes == 576  # the raw fp8 latent (SGLang's trtllm/tilelang DSA layout)
    # The status's prediction counts the packed pages: 4096 tokens = 64 pages of 3 layers, one decode rank.
    assert estimate_traffic(spec(latent_only())).kv_bytes == 64 * LAYERS * 64 * 656


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ({"kvKind": "MHA"}, "set kvKind MLA"),
        ({"dtype": "bfloat16"}, r"set dtype float8_e4m3fn \(got bfloat16\)"),
        ({"kvLoraRank": 200}, "kvLoraRank must be a multiple of 128, got 200"),
    ],
    ids=["mha", "bfloat16", "partial-scale-block"],
)
def test_a_packed_latent_the_engine_cannot_have_is_refused_naming_the_field(model: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError, match=named):
        spec({**latent_only(), **model})


# ---------------------------------------------------------------- SGLang's own pool registered
def sglang_dsa_args(tmp_path: Path, layers: int = LAYERS, pages: int = 4) -> tuple[Any, Any, Any]:
    """SGLang's DSATokenToKVPool in ``tmp_path`` and its KVArgs (aux rows from a reference pool)."""
    from pdfabric_refengine import KVPool, kv_args

    pool = dsa_pool(str(tmp_path), layers=layers, pages=pages)
    aux = KVPool(
        layers=1, local_heads=1, head_dim=8, num_pages=1, page_size=PAGE_TOKENS, shm_dir=str(tmp_path), mla=True
    )
    args = kv_args(aux, engine_rank=0, page_size=PAGE_TOKENS, kv_head_num=1, total_kv_head_num=1)
    return pool, aux, dsa_kv_args(pool, args)


def kv_only(args: Any) -> Any:
    """The KVArgs without their state components (the latent alone)."""
    out = types.SimpleNamespace(**vars(args))
    out.state_types = []
    return out


def test_sglangs_dsa_pool_registers_its_packed_latent_which_fits_the_spec(tmp_path: Path) -> None:
    from pdfabric_sglang.kvargs import registration

    pool, aux, args = sglang_dsa_args(tmp_path)
    try:
        assert pool.kv_cache_dim == PACKED_TOKEN and args.kv_item_lens == [PAGE_TOKENS * PACKED_TOKEN] * LAYERS
        reg = registration("prefill-0-tp0-cp0", kv_only(args), is_mla=True, gpu=None, aux_inline=True)
        rank = Rank(Role.PREFILL, 0, 0)
        lay = engine_layout(reg, spec(latent_only()), rank, TCP)
        assert (lay.kv_buffers, lay.layers, lay.page_bytes, lay.kv_pages) == (1, LAYERS, 64 * 656, 5)
        # Against the unpacked latent it is refused, and the refusal names the packing that fits.
        with pytest.raises(ApiError) as exc:
            engine_layout(reg, spec({**latent_only(), "kvPacking": "none"}), rank, TCP)
        assert "41984 KV bytes per page registered; prefill-0-tp0-cp0 (TP 1, PP stage 0 of 1) has 36864" in str(
            exc.value.message
        )
        assert "the engine's pages are the latent with spec.model.kvPacking packedFp8" in exc.value.message
    finally:
        aux.close()


def test_sglangs_dsa_indexer_is_one_page_state_tensor_a_layer(tmp_path: Path) -> None:
    pool, aux, args = sglang_dsa_args(tmp_path)
    try:
        assert [str(getattr(t, "value", t)) for t in args.state_types] == ["dsa"]
        assert args.state_item_lens == [[INDEX_PAGE] * LAYERS]
        assert [int(b.shape[0]) for b in pool.index_k_with_scale_buffer] == [5] * LAYERS  # pages + SGLang's padding
    finally:
        aux.close()


# ---------------------------------------------------------------- the indexer state beside MLA
def test_sglangs_dsa_kvargs_register_as_page_state_beside_the_latent_and_fit_the_spec(tmp_path: Path) -> None:
    from pdfabric_sglang.kvargs import registration

    _pool, aux, args = sglang_dsa_args(tmp_path)
    try:
        reg = registration("prefill-0-tp0-cp0", args, is_mla=True, gpu=None, aux_inline=True)
        parts = reg.state_parts
        assert parts is not None and (parts.kind.value, parts.source) == ("page", "dsa")
        assert (parts.item_bytes, parts.sharded, len(reg.state)) == ((INDEX_PAGE,) * LAYERS, (True,) * LAYERS, LAYERS)
        lay = engine_layout(reg, spec(dsa_model(LAYERS), {"tp": 2}), Rank(Role.PREFILL, 0, 0), TCP)
        assert (lay.state_kind, lay.state_items, lay.state_slots) == ("page", (INDEX_PAGE,) * LAYERS, 5)
        # A spec that leaves the indexer out is refused with the fields that describe it.
        with pytest.raises(ApiError) as exc:
            engine_layout(reg, spec(latent_only()), Rank(Role.PREFILL, 0, 0), TCP)
        assert (
            f'"stateKind": "page", "stateTensorBytes": [{INDEX_PAGE}, {INDEX_PAGE}, {INDEX_PAGE}]' in exc.value.message
        )
    finally:
        aux.close()


def test_page_state_beside_mla_is_whole_pages_of_the_latents_one_head() -> None:
    geo = spec(dsa_model(LAYERS), {"tp": 4}).model
    assert geo.state_item_bytes(4) == geo.state_item_bytes(1) == (INDEX_PAGE,) * LAYERS  # whole on every TP rank
    with pytest.raises(SpecError, match="not whole pages of 64 tokens x 1 KV heads"):
        spec({**dsa_model(LAYERS), "stateTensorBytes": [INDEX_PAGE + 1] * LAYERS})


@pytest.mark.parametrize(
    ("prefill", "decode_tp", "senders"),
    [
        ({"tp": 2}, 1, {(0, 0): 2}),  # one prefill rank sends each decode rank its state, with its latent
        ({"tp": 1}, 2, {(0, 0): 4}),  # every decode rank gets the whole state
        ({"cp": 2, "allCpRanksTransfer": True}, 1, {(0, 0): 2, (0, 1): 0}),  # CP rank 0 only: dedup
        ({"cp": 2, "allCpRanksTransfer": True, "dsaCacheLayerSplit": True}, 1, {(0, 0): 1, (0, 1): 1}),
    ],
    ids=["tp2-tp1", "tp1-tp2", "cp2-dedup", "cp2-layer-split"],
)
def test_the_indexer_state_moves_by_the_page_rule_with_cp_dedup_and_the_layer_split(
    prefill: dict[str, Any], decode_tp: int, senders: dict[tuple[int, int], int]
) -> None:
    """Per sending prefill rank (tp, cp): indexer layer-pages it moves per page (two layers), by every
    rule at once."""
    from pdfabric_core.duties import replica_duties

    s = parse_spec({"prefill": prefill, "decode": {"tp": decode_tp}, "transfer": {"transport": "tcp"},
                    "model": dsa_model(2)})  # fmt: skip
    got: dict[tuple[int, int], int] = {}
    for d in replica_duties(s, 5):
        key = (d.prefill_tp_rank, d.cp_rank)
        got[key] = got.get(key, 0) + d.duties.state_bytes // INDEX_PAGE
        if d.duties.state_skipped:
            assert d.duties.skipped_state_bytes == 2 * INDEX_PAGE
    assert {k: v for k, v in got.items() if v or k in senders} == senders


def test_sglangs_layer_split_dsa_pool_is_refused_at_start_from_its_parallel_state() -> None:
    """SGLang's LayerSplitDSATokenToKVPool registers only a CP rank's own latent layers, which pdfabric
    does not move (it moves page-sharded latents of every layer): the manager asks this and refuses."""
    from pdfabric_sglang.manager import dsa_layer_split_pool
    from sglang.srt.runtime_context import get_parallel

    dsa, mamba = types.SimpleNamespace(state_types=["dsa"]), types.SimpleNamespace(state_types=["mamba"])
    assert not dsa_layer_split_pool(dsa)  # nothing published in this process
    with get_parallel().override(enable_dsa_cache_layer_split=True, attn_cp_size=2):
        assert dsa_layer_split_pool(dsa) and not dsa_layer_split_pool(mamba)
    with get_parallel().override(enable_dsa_cache_layer_split=True, attn_cp_size=1):
        assert not dsa_layer_split_pool(dsa)  # one CP rank: SGLang builds the plain DSA pool


def test_the_status_predicts_deepseek_v32s_dedup_at_prefill_cp8_to_decode_tp8() -> None:
    """DeepSeek-V3.2's geometry as SGLang registers it (61 layers, the 656-byte packed latent, an 8448-byte
    indexer page a layer per 64-token KV page): the indexer moves one page item per KV page (not one
    per request), and CP all-ranks transfer sends it from CP rank 0 only: 7 of 8 copies saved."""
    from pdfabric_core.traffic import state_indices

    v32 = {**dsa_model(61), "auxRowBytes": [0]}
    s = parse_spec({"prefill": {"cp": 8, "allCpRanksTransfer": True}, "decode": {"tp": 8}, "model": v32})
    assert state_indices(s, 64) == 64 and state_indices(spec(latent_only()), 64) == 1
    t = estimate_traffic(s, 4096)
    page = 64 * 61  # pages x layers
    assert (t.kv_bytes, t.state_bytes, t.state_bytes_without_dedup) == (
        8 * page * 64 * PACKED_TOKEN,
        8 * page * INDEX_PAGE,
        8 * 8 * page * INDEX_PAGE,
    )
    reduction = 1 - t.total_bytes / t.total_bytes_without_dedup
    assert round(100 * reduction, 2) == 53.97 == round(100 * 7 * INDEX_PAGE / (64 * PACKED_TOKEN + 8 * INDEX_PAGE), 2)


def test_the_kpool_compress_tail_beside_the_indexer_is_refused_by_its_name() -> None:
    """SGLang's DSA pool with index_kpool > 1 and compression appends a request-row tail (``dsa_tail``)."""
    from pdfabric_sglang.state_kinds import state_parts

    from pdfabric_agent.client.shares import UnshareableBuffer

    args = types.SimpleNamespace(state_types=["dsa", "dsa_tail"], state_item_lens=[[INDEX_PAGE], [512]])
    with pytest.raises(UnshareableBuffer, match=r"\['dsa_tail'\] would not move"):
        state_parts(args, is_mla=True)
