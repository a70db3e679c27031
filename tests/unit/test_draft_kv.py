"""The draft model's KV (EAGLE/MTP) as a declared second KV group (issue 25): the spec field and
its refusals, the registration's typed group and its checks against the spec, the routing (the
target's head slices, CP page shards, the MLA one-source rule, the last PP stage only) and the
prediction of its bytes, per kind."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdfabric_agent.memory.plan import MemoryMap, TransferSide, decode_targets, plan_transfer, sender_duties
from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_agent.protocol.draft import DraftKv
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare, ShareKind
from pdfabric_agent.ranks.engine_memory import MemoryRules, engine_layout
from pdfabric_core.policy.types import KvKind, MemPool, Role, Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec
from pdfabric_core.traffic import estimate_traffic, pair_traffic

MODEL = {"layers": 2, "kvHeads": 4, "headDim": 16, "dtype": "float32", "pageSizeTokens": 16, "auxRowBytes": [64]}
PAGE = 16 * 4 * 16 * 4  # tokens x heads x dim x bytes at TP 1
TCP = MemoryRules(Transport.TCP, Transport.TCP, MemPool.NONE, engine_moves_gpu=False)


def spec(ptp: int = 1, dtp: int = 1, pp: int = 1, **model: Any) -> PDClusterSpec:
    return parse_spec({"prefill": {"tp": ptp, "pp": pp}, "decode": {"tp": dtp, "pp": pp}, "transfer": {"transport": "tcp"},
                       "model": {**MODEL, **model}})  # fmt: skip


# ---- the spec ------------------------------------------------------------------------------


def test_draft_layers_default_to_none_and_parse() -> None:
    assert spec().model.draft_layers == 0
    assert spec(draftLayers=1).model.draft_layers == 1


@pytest.mark.parametrize(("value", "named"), [(-1, "at least 0"), (65, "at most 64")])
def test_invalid_draft_layers_are_refused_with_the_field(value: int, named: str) -> None:
    with pytest.raises(SpecError, match=f"model.draftLayers must be {named}"):
        spec(draftLayers=value)


def test_the_crd_declares_draft_layers_with_the_validators_bounds() -> None:
    import yaml

    crd = yaml.safe_load(Path("crds/pdcluster.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    field = props["model"]["properties"]["draftLayers"]
    assert (field["minimum"], field["maximum"], field["default"]) == (0, 64, 0)


# ---- the prediction ------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "ptp", "dtp"), [("MHA", 2, 1), ("MHA", 1, 2), ("MLA", 2, 1), ("MLA", 1, 2)])
def test_the_draft_adds_its_layers_to_kv_by_the_targets_route(kind: str, ptp: int, dtp: int) -> None:
    """Per request the draft group moves what one more target layer moves (the target's route, its
    head slices or the MLA one-source rule), counted in kv and shown apart as draftKv."""
    mla = {"kvKind": "MLA", "kvLoraRank": 32, "qkRopeHeadDim": 8} if kind == "MLA" else {}
    plain, drafted = spec(ptp, dtp, **mla), spec(ptp, dtp, draftLayers=1, **mla)
    a, b = estimate_traffic(plain, 160), estimate_traffic(drafted, 160)
    assert a.draft_kv_bytes == 0
    assert b.draft_kv_bytes == a.kv_bytes // 2 > 0  # one draft layer beside two target layers
    assert b.kv_bytes == a.kv_bytes + b.draft_kv_bytes
    assert (b.state_bytes, b.aux_bytes) == (a.state_bytes, a.aux_bytes)
    assert b.to_status()["draftKv"] == b.draft_kv_bytes and b.to_status()["kv"] == b.kv_bytes
    if kind == "MLA":  # every prefill rank holds the whole latent; each decode rank reads one source
        pairs = pair_traffic(drafted, 10)
        assert len(pairs) == dtp and all(p.draft_kv == 10 * 40 * 4 * 16 for p in pairs.values())


def test_only_the_last_pp_stage_moves_the_draft() -> None:
    pairs = pair_traffic(spec(pp=2, draftLayers=1), 3)
    by_stage = {src[2]: b.draft_kv for (src, _), b in pairs.items()}
    assert by_stage == {0: 0, 1: 3 * 2 * PAGE}  # K and V of the one draft layer


# ---- the registration ----------------------------------------------------------------------


def shares(path: Path, n: int, nbytes: int, start: int = 0) -> list[BufferShare]:
    return [BufferShare(ShareKind.SHM, nbytes, start + i * nbytes, path=str(path)) for i in range(n)]


def registration(path: Path, *, draft_layers: int = 0, draft_page: int = PAGE, rank: str = "prefill-0-tp0-cp0") -> MemoryRegistration:  # fmt: skip
    kv = shares(path, 4, 4 * PAGE)
    draft = None
    if draft_layers:
        d = shares(path, 2 * draft_layers, 4 * draft_page, 4 * 4 * PAGE)
        draft = DraftKv(KvKind.MHA, draft_page, d[:draft_layers], d[draft_layers:], [])
    return MemoryRegistration(rank, PageOrder.TOKEN_MAJOR, 16, PAGE, kv[0::2], kv[1::2], 0, [], [64],
                              shares(path, 1, 8 * 64, 1 << 20), draft=draft)  # fmt: skip


def refusal(reg: MemoryRegistration, s: PDClusterSpec, rank: Rank | None = None) -> str:
    with pytest.raises(ApiError) as exc:
        engine_layout(reg, s, rank or Rank(Role.PREFILL, 0, 0), TCP)
    assert (exc.value.status, exc.value.reason) == (422, "layout_mismatch")
    return exc.value.message


def test_a_registered_draft_group_is_checked_against_the_spec(tmp_path: Path) -> None:
    lay = engine_layout(
        registration(tmp_path / "f", draft_layers=1), spec(draftLayers=1), Rank(Role.PREFILL, 0, 0), TCP
    )
    assert (lay.layers, lay.draft_layers, lay.kv_layers, lay.kv_pages) == (2, 1, 3, 4)
    assert "set spec.model.draftLayers to 1" in refusal(registration(tmp_path / "f", draft_layers=1), spec())
    assert "or set spec.model.draftLayers to 0" in refusal(registration(tmp_path / "f"), spec(draftLayers=1))
    assert "set spec.model.draftLayers to 2" in refusal(
        registration(tmp_path / "f", draft_layers=2), spec(draftLayers=1)
    )
    msg = refusal(registration(tmp_path / "f", draft_layers=1, draft_page=PAGE // 2), spec(draftLayers=1))
    assert "target's KV kind, heads and dims" in msg


def test_only_the_last_pp_stage_registers_draft_kv(tmp_path: Path) -> None:
    s = spec(pp=2, layers=4, draftLayers=1)
    first, last = Rank(Role.PREFILL, 0, 0, pp_rank=0), Rank(Role.PREFILL, 0, 0, pp_rank=1)
    assert "only the last PP stage" in refusal(registration(tmp_path / "f", draft_layers=1), s, first)
    assert engine_layout(registration(tmp_path / "f", draft_layers=1), s, last, TCP).draft_layers == 1
    assert engine_layout(registration(tmp_path / "f"), s, first, TCP).draft_layers == 0


def test_the_draft_group_travels_typed_and_malformed_ones_are_refused(tmp_path: Path) -> None:
    reg = registration(tmp_path / "f", draft_layers=1)
    body = reg.to_json()
    assert body["draft"]["kv_kind"] == "MHA" and len(body["draft"]["k"]) == 1
    assert MemoryRegistration.parse(body) == reg and reg.draft_layers == 1
    assert len(reg.kv_buffers()) == 6 and len(reg.target_kv_buffers()) == 4
    for bad in ({**body["draft"], "v": []}, {**body["draft"], "kv_kind": "MLA"}, {**body["draft"], "page_bytes": 0}):
        with pytest.raises(ApiError) as exc:
            MemoryRegistration.parse({**body, "draft": bad})
        assert exc.value.status == 400


def test_sglangs_appended_draft_entries_become_the_second_group(tmp_path: Path) -> None:
    """SGLang's KVArgs: target K, target V, then draft K, draft V (num_draft_entries of them)."""
    from pdfabric_sglang.kvargs import registration as register

    n, item = 6, 256
    pool = tmp_path / "kv"
    pool.write_bytes(bytes(n * 4 * item))
    with open(pool, "r+b") as fh, mmap.mmap(fh.fileno(), n * 4 * item) as mem:
        buf = np.frombuffer(mem, np.uint8).reshape(n, 4 * item)
        args = SimpleNamespace(
            kv_data_ptrs=[b.ctypes.data for b in buf], kv_data_lens=[4 * item] * n, kv_item_lens=[item] * n,
            num_draft_entries=2, page_size=16, engine_rank=0, aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[],
        )  # fmt: skip
        reg = register("prefill-0-tp0-cp0", args, is_mla=False, gpu=None)
        assert [s.offset for s in (*reg.k, *reg.v)] == [0, 1024, 2048, 3072]
        assert reg.draft is not None and (reg.draft.k[0].offset, reg.draft.v[0].offset) == (4096, 5120)
        mla = register("prefill-0-tp0-cp0", args, is_mla=True, gpu=None)
        assert reg.draft.page_bytes == item and mla.draft is not None and len(mla.draft.latent) == 2
        args.num_draft_entries = 3
        with pytest.raises(ValueError, match="a K and a V buffer per layer"):
            register("prefill-0-tp0-cp0", args, is_mla=False, gpu=None)
        args.num_draft_entries = 6
        with pytest.raises(ValueError, match="6 draft KV buffers of 6"):
            register("prefill-0-tp0-cp0", args, is_mla=False, gpu=None)
        del buf


# ---- the plan ------------------------------------------------------------------------------


def test_draft_layers_move_the_targets_head_slices_into_the_peers_draft_layers() -> None:
    """Prefill TP 1 -> decode TP 2, SGLang's token-major pages, one draft layer: decode rank 1's
    draft K and V get heads 2..3 of every token of each page, as its target layers do."""
    s = spec(1, 2, draftLayers=1)
    geo = s.model
    src = PoolLayout.from_geometry(geo, 1, kv_pages=4, state_slots=0, aux_slots=1)
    dst = PoolLayout.from_geometry(geo, 2, kv_pages=4, state_slots=0, aux_slots=1)
    src, dst = (dataclasses.replace(x, page_order=PageOrder.TOKEN_MAJOR) for x in (src, dst))
    src_buf = (ctypes.c_uint8 * (6 * 4 * PAGE))()
    dst_buf = (ctypes.c_uint8 * (6 * 4 * PAGE // 2))()
    for i in range(len(src_buf)):
        src_buf[i] = (i * 7 + 3) % 251
    src_map = MemoryMap(tuple(ctypes.addressof(src_buf) + i * 4 * PAGE for i in range(6)), (), (1,))
    dst_map = MemoryMap(tuple(ctypes.addressof(dst_buf) + i * 2 * PAGE for i in range(6)), (), (1,))
    duties = sender_duties(s, decode_targets(s, 0)[1], 0, 2)
    assert duties is not None and duties.draft_layers == 1
    plan = plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None), TransferSide(dst, dst_map, [0, 2], [], None))  # fmt: skip
    for b in plan.kv:
        ctypes.memmove(b.dst, b.src, b.length)
    row = 16 * 4
    for buf in (4, 5):  # the draft's K and V: buffers after the target's two layers
        for sp, dp in ((3, 0), (1, 2)):
            for t in range(16):
                s_off = buf * 4 * PAGE + sp * PAGE + t * 4 * row + 2 * row
                d_off = buf * 2 * PAGE + dp * (PAGE // 2) + t * 2 * row
                assert bytes(dst_buf[d_off : d_off + 2 * row]) == bytes(src_buf[s_off : s_off + 2 * row])
    assert sum(b.length for b in plan.kv) == plan.kv_pages.nbytes == 6 * 2 * 16 * 2 * row  # type: ignore[union-attr]
    assert plan.kv_pages.nbytes == sum(b.kv for b in pair_traffic(s, 2).values()) // 2  # type: ignore[union-attr]
    # A peer that holds no draft layers cannot take them: refused when planned.
    with pytest.raises(ValueError, match="draft KV layers"):
        plan_transfer(duties, TransferSide(src, src_map, [3, 1], [], None),
                      TransferSide(dataclasses.replace(dst, draft_layers=0), MemoryMap(dst_map.kv[:4], (), (1,)), [0, 2], [], None))  # fmt: skip


def test_the_operators_status_shows_the_drafts_bytes_apart_and_the_crd_keeps_them() -> None:
    """status.expectedBytesPerRequest (what the operator publishes) carries draftKv, within kv;
    the CRD's status schema declares it, so the API server does not prune it."""
    import yaml

    from pdfabric_operator.observed import Observed
    from pdfabric_operator.status import compute_status

    s = spec(2, 1, draftLayers=1)
    shown = compute_status(Observed(1, s, None), "pd")["expectedBytesPerRequest"]
    want = estimate_traffic(s)
    assert (shown["kv"], shown["draftKv"]) == (want.kv_bytes, want.draft_kv_bytes)
    assert 0 < shown["draftKv"] < shown["kv"] and shown["total"] == want.total_bytes
    crd = yaml.safe_load(Path("crds/pdcluster.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert "draftKv" in status["expectedBytesPerRequest"]["properties"]
