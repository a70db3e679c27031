"""Typed state components through SGLang's classes and real agents, byte-exact (issue 25): a
Mamba-style hybrid (slot state of two tensor sizes, head-sharded, prefill TP 2 -> decode TP 1), a
GDN hybrid (its conv state's q, k, v sub-blocks sharded apart, TP 2 -> 1 and 1 -> 2) and an SWA
hybrid (page state, head-sliced like KV, prefill TP 1 -> decode TP 2).

Each rank's KV and aux are the reference engine's pool (SGLang's MHA layout) in the agents'
shared-memory directory. Its state is SGLang's own: a ``MambaPool`` built at the rank's TP
(``Mamba2StateShape.create``: conv ``[conv_dim / tp, K - 1]`` bf16, temporal ``[heads / tp, head_dim,
state]`` f32, two Mamba layers), or the SWA sub-pool an ``SWAKVPool`` registers (an MHA pool of the
SWA layers); its tensors live in the shared-memory directory, where the agent can map them, and
its KVArgs are filled by SGLang's ``append_state_component`` from the pool's own
``get_contiguous_buf_infos``/``get_state_dim_per_tensor``/layer ids, as ``setup_state_kv_args``
does. Senders and receivers are SGLang's classes for the pdfabric backend (``get_kv_class``),
driven as its schedulers drive them. Decode's state is checked against the whole item cut to its
share, every other slot or page left zero; the agents' counters against the geometry per kind.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdfabric_core.policy.rank_mapping import global_heads  # noqa: E402
from pdfabric_core.policy.types import Role  # noqa: E402
from pdfabric_core.rankmap import Rank, replica_ranks  # noqa: E402
from pdfabric_core.traffic import pair_traffic  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402
from pdfabric_devcluster.synthetic import aux_chunk, kv_chunk  # noqa: E402
from tests.e2e.sglang_rooms import poll_until, sglang_classes  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOM, PAGES, TOKENS, HEADS, HEAD_DIM = 5151, 5, 16, 2, 16
GEO = {"layers": 4, "kvHeads": HEADS, "headDim": HEAD_DIM, "dtype": "float32", "pageSizeTokens": TOKENS,
       "auxRowBytes": [64, 64, 64]}  # fmt: skip
# Mamba2 at TP 1: conv_dim = 64 + 2 x 2 groups x 4 = 80 x (K-1 = 3) bf16 = 480 bytes a slot, temporal
# 4 heads x 8 x 4 f32 = 512; two Mamba layers, tensor-major (conv l1, conv l3, temporal l1, l3).
MAMBA_SHAPE = {"intermediate_size": 64, "n_groups": 2, "num_heads": 4, "head_dim": 8, "state_size": 4, "conv_kernel": 4}
MAMBA = {**GEO, "stateTensorBytes": [480, 480, 512, 512], "stateTensorSharded": [True] * 4}
# GDN (Qwen3-Next's shape, SGLang's qwen3_next config): conv = q | k | v (8, 8, 32 dims at TP 1), each
# head-sharded apart (state_conv_shard_groups): 48 x 3 bf16 = 288 bytes; temporal 4 x 8 x 4 f32 = 512.
GDN_SHAPE = {"intermediate_size": 32, "n_groups": 2, "num_heads": 4, "head_dim": 8, "state_size": 4, "conv_kernel": 4,
             "conv_shard_groups": [8, 8, 32]}  # fmt: skip
GDN = {**GEO, "stateTensorBytes": [288, 288, 512, 512], "stateTensorSharded": [True] * 4,
       "stateTensorBlocks": [[48, 48, 192], [48, 48, 192]]}  # fmt: skip
SWA_LAYERS = 2
SWA_PAGE = TOKENS * HEADS * HEAD_DIM * 4  # one page of every KV head, f32
SWA = {**GEO, "stateKind": "page", "stateTensorBytes": [SWA_PAGE] * (2 * SWA_LAYERS)}
# An MXFP8 SWA sub-pool (SGLang's MHATokenToKVPoolMXFP8, head dim 32): fp8 K and V pages, then one
# UE8M0 scale a block of 32 (block_scale_swa), both indexed by the window's pages.
MX_DIM = 32
SWA_MXFP8 = {**GEO, "stateKind": "page",
             "stateTensorBytes": [TOKENS * HEADS * MX_DIM] * (2 * SWA_LAYERS) + [TOKENS * HEADS] * (2 * SWA_LAYERS)}  # fmt: skip


class ShmTensors:
    """Tensors in one file of the agents' shared-memory directory (as SGLang's pools, but mappable)."""

    def __init__(self, shm_dir: str, shapes: list[tuple[tuple[int, ...], Any]]) -> None:
        sizes = [int(np.prod(s)) * dt.itemsize for s, dt in shapes]
        offsets = [sum(-(-n // 4096) * 4096 for n in sizes[:i]) for i in range(len(sizes))]
        total = offsets[-1] + -(-sizes[-1] // 4096) * 4096
        self.path = os.path.join(shm_dir, f"sglang-state-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            self.mem = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.tensors = [
            torch.frombuffer(self.mem, dtype=dt, count=int(np.prod(s)), offset=off).view(s)
            for (s, dt), off in zip(shapes, offsets, strict=True)
        ]

    def close(self) -> None:
        self.tensors = []
        os.unlink(self.path)


def mamba_pool(tp: int, shm_dir: str, shape_args: dict[str, Any]) -> tuple[Any, ShmTensors]:
    """SGLang's MambaPool at TP ``tp``, its state tensors moved into shared memory (same shapes)."""
    import dataclasses

    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool

    shape = Mamba2StateShape.create(tp_world_size=tp, **shape_args)
    dtype = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    params = Mamba2CacheParams(shape=shape, layers=[1, 3], dtype=dtype)
    pool = MambaPool(size=4, spec_state_size=4, cache_params=params, mamba_layer_ids=[1, 3], device="cpu")
    cache = pool.mamba_cache
    shm = ShmTensors(shm_dir, [(tuple(t.shape), t.dtype) for t in [*cache.conv, cache.temporal]])
    pool.mamba_cache = dataclasses.replace(cache, conv=shm.tensors[:-1], temporal=shm.tensors[-1])
    return pool, shm


def as_bytes(t: Any) -> np.ndarray[Any, Any]:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1) if t.dtype != torch.uint8 else t.numpy().reshape(-1)


def whole(tensor: int, index: int, nbytes: int) -> bytes:
    """The whole (TP 1) item of state tensor ``tensor`` for the room's ``index``-th state index."""
    return np.random.default_rng([ROOM, tensor, index]).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class Side:
    """One role's ranks: the reference engine's KV and aux pool, SGLang's state, a manager each."""

    def __init__(self, lc: LocalFabric, role: Role, kind: str, classes: dict[str, Any], mp: pytest.MonkeyPatch) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import DisaggregationMode, append_state_component

        self.group = lc.spec.prefill if role is Role.PREFILL else lc.spec.decode
        self.ranks = replica_ranks(lc.spec, role, 0)
        self.pools: dict[Rank, Any] = {}
        self.state: dict[Rank, Any] = {}  # the MambaPool, or the SWA sub-pool
        self.managers: dict[Rank, Any] = {}
        self._shm: list[Any] = []
        mode = DisaggregationMode.PREFILL if role is Role.PREFILL else DisaggregationMode.DECODE
        for rank in self.ranks:
            heads = len(global_heads(rank.tp_rank, self.group.tp, HEADS))
            pool = KVPool(layers=4, local_heads=heads, head_dim=HEAD_DIM, num_pages=16, shm_dir=lc.shm_dir)
            self.pools[rank] = pool
            mp.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
            args = kv_args(pool, engine_rank=rank.tp_rank, page_size=TOKENS, kv_head_num=heads, total_kv_head_num=HEADS)
            if kind == "swa-mxfp8":  # SGLang's own pool, its buffers in the agents' shared memory
                from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

                from pdfabric_agent.client.shm import shared_cpu_allocations

                with shared_cpu_allocations(lc.shm_dir):
                    state = MHATokenToKVPoolMXFP8(size=7 * TOKENS, page_size=TOKENS, dtype=torch.float8_e4m3fn,
                                                  head_num=heads, head_dim=MX_DIM, layer_num=SWA_LAYERS, device="cpu",
                                                  enable_memory_saver=False)  # fmt: skip
                append_state_component(args, StateType.SWA, *state.get_contiguous_buf_infos())
                append_state_component(args, StateType.BLOCK_SCALE_SWA, *state.get_kv_scale_buf_infos())
                args.swa_kv_cache_layout = "nhd"
            elif kind != "swa":
                state, shm = mamba_pool(self.group.tp, lc.shm_dir, GDN_SHAPE if kind == "gdn" else MAMBA_SHAPE)
                self._shm.append(shm)
                append_state_component(args, StateType.MAMBA, *state.get_contiguous_buf_infos(),
                                       state.get_state_dim_per_tensor(), state.get_state_conv_shard_groups(),
                                       state.get_state_slice_outer_counts(), state.get_state_layer_ids())  # fmt: skip
            else:  # SWAKVPool.get_state_buf_infos: its MHA sub-pool's K then V buffers, a page an item
                state = KVPool(layers=SWA_LAYERS, local_heads=heads, head_dim=HEAD_DIM, num_pages=8, shm_dir=lc.shm_dir)
                bufs = state.k_infos + state.v_infos
                append_state_component(args, StateType.SWA, [b.data_ptr for b in bufs], [b.nbytes for b in bufs],
                                       [state.page_bytes] * len(bufs))  # fmt: skip
                args.swa_kv_cache_layout = "nhd"
            self.state[rank] = state
            self.managers[rank] = classes["MANAGER"](args, mode, None, False)
            source = {"swa": "swa", "swa-mxfp8": "swa+block_scale_swa"}.get(kind, "mamba")
            assert self.managers[rank].registration.state_parts.source == source

    def state_items(self, rank: Rank) -> list[Any]:
        """Per state tensor, its [index][item] tensor (Mamba: slot-major; SWA: page-major)."""
        st = self.state[rank]
        if hasattr(st, "mamba_cache"):
            c = st.mamba_cache
            return [t[i] for t in [*c.conv, c.temporal] for i in range(t.shape[0])]
        if hasattr(st, "k_scale_buffer"):  # SGLang's MXFP8 pool: K, V, then their scales, page-major
            bufs = [*st.k_buffer, *st.v_buffer, *st.k_scale_buffer, *st.v_scale_buffer]
            return [b.view(torch.uint8).view(b.shape[0] // TOKENS, -1) for b in bufs]
        return [b.view(st.num_pages, -1) for b in [*st.k_buffers, *st.v_buffers]]

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for pool in [*self.pools.values(), *(s for s in self.state.values() if hasattr(s, "k_buffers"))]:
            pool.close()
        for shm in self._shm:
            shm.close()


def share(data: bytes, kind: str, tp: int, rank: int, blocks: tuple[int, ...]) -> bytes:
    """What TP rank ``rank`` of ``tp`` holds of a whole item: a contiguous share of each sub-block in
    turn (Mamba's slice axis is outermost; GDN's conv is q | k | v), or its KV heads of every token
    row (an SWA page)."""
    if not kind.startswith("swa"):
        out, at = b"", 0
        for block in blocks:
            n = block // tp
            out += data[at + rank * n : at + (rank + 1) * n]
            at += block
        return out
    rows = np.frombuffer(data, np.uint8).reshape(TOKENS, HEADS, -1)
    heads = list(global_heads(rank, tp, HEADS))
    return rows[:, heads[0] : heads[-1] + 1].tobytes()


def fill_kv(side: Side, rank: Rank, pages: list[int], aux: int) -> None:
    pool, row = side.pools[rank], HEAD_DIM * 4
    heads = list(global_heads(rank.tp_rank, side.group.tp, HEADS))
    for layer in range(4):
        for kv, bufs in enumerate((pool.k_buffers, pool.v_buffers)):
            view = bufs[layer].numpy().view(np.uint8)
            for pos, page in enumerate(pages):
                for t in range(TOKENS):
                    for local, head in enumerate(heads):
                        view[page * TOKENS + t, local] = np.frombuffer(
                            kv_chunk(ROOM, layer, kv, pos * TOKENS + t, head, row), np.uint8
                        )
    for item, buf in enumerate(pool.aux.values()):
        buf.numpy().view(np.uint8)[aux] = np.frombuffer(aux_chunk(ROOM, item, 64), np.uint8)


def kv_mismatches(side: Side, rank: Rank, pages: list[int], aux: int) -> list[str]:
    pool, row, errors = side.pools[rank], HEAD_DIM * 4, []
    heads = list(global_heads(rank.tp_rank, side.group.tp, HEADS))
    for layer in range(4):
        for kv, bufs in enumerate((pool.k_buffers, pool.v_buffers)):
            view = bufs[layer].numpy().view(np.uint8)
            for pos, page in enumerate(pages):
                for t in range(TOKENS):
                    for local, head in enumerate(heads):
                        if view[page * TOKENS + t, local].tobytes() != kv_chunk(
                            ROOM, layer, kv, pos * TOKENS + t, head, row
                        ):
                            errors.append(
                                f"{rank.rank_id} layer {layer} buffer {kv} token {pos * TOKENS + t} head {head}"
                            )
    for item, buf in enumerate(pool.aux.values()):
        if buf.numpy().view(np.uint8)[aux].tobytes() != aux_chunk(ROOM, item, 64):
            errors.append(f"{rank.rank_id} aux item {item}")
    return errors


@pytest.mark.parametrize(
    ("kind", "prefill_tp", "decode_tp", "model", "src_idx", "dst_idx"),
    [
        ("mamba", 2, 1, MAMBA, [2], [3]),  # a request's slot, in another place on each side
        ("swa", 1, 2, SWA, [6, 3], [1, 4]),  # the window's two pages, in the SWA sub-pool
        ("swa-mxfp8", 1, 2, SWA_MXFP8, [6, 3], [1, 4]),  # and their block scales, one list of pages
        ("swa-mxfp8", 2, 2, SWA_MXFP8, [6, 3], [1, 4]),  # equal TP, as SGLang's Mooncake moves them
        ("gdn", 2, 1, GDN, [2], [3]),  # each prefill rank's q, k, v shares to their places
        ("gdn", 1, 2, GDN, [2], [3]),  # each decode rank's q, k, v shares out of one item
    ],
    ids=["mamba-tp2-tp1", "swa-tp1-tp2", "swa-mxfp8-tp1-tp2", "swa-mxfp8-tp2-tp2", "gdn-tp2-tp1", "gdn-tp1-tp2"],
)
def test_typed_state_moves_byte_exact_under_sglangs_classes(
    kind: str,
    prefill_tp: int,
    decode_tp: int,
    model: dict[str, Any],
    src_idx: list[int],
    dst_idx: list[int],
    token_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    classes = sglang_classes()
    spec = {"prefill": {"tp": prefill_tp}, "decode": {"tp": decode_tp},
            "transfer": {"transport": "tcp", "timeoutSeconds": 20}, "model": model}  # fmt: skip
    with LocalFabric(spec) as lc:
        token_file.write_text(lc.token)
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token_file))
        geo = lc.spec.model
        components = 2 if kind == "swa-mxfp8" else 1
        dec = Side(lc, Role.DECODE, kind, classes, monkeypatch)
        pre = Side(lc, Role.PREFILL, kind, classes, monkeypatch)
        server = classes["BOOTSTRAP_SERVER"]("127.0.0.1", 0)
        try:
            receivers = {r: classes["RECEIVER"](m, f"127.0.0.1:{server.port}", ROOM) for r, m in dec.managers.items()}
            for rx in receivers.values():
                rx.init(0)
            assert set(poll_until(list(receivers.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            dst_pages = {r: dec.pools[r].allocate_pages(PAGES)[::-1] for r in dec.ranks}
            for r, rx in receivers.items():
                # One index list a registered component, as SGLang's decode builds them (_swa_payload twice).
                rx.send_metadata(np.asarray(dst_pages[r], np.int32), 2, [np.asarray(dst_idx, np.int32)] * components)
            senders = {r: classes["SENDER"](m, f"127.0.0.1:{server.port}", ROOM) for r, m in pre.managers.items()}
            assert set(poll_until(list(senders.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            for r, tx in senders.items():
                pages = pre.pools[r].allocate_pages(PAGES)
                fill_kv(pre, r, pages, aux=0)
                items = pre.state_items(r)
                for t, whole_bytes in enumerate(geo.state_tensors):
                    for n, i in enumerate(src_idx):
                        mine = share(whole(t, n, whole_bytes), kind, prefill_tp, r.tp_rank, geo.state_blocks(t))
                        as_bytes(items[t])[i * len(mine) : (i + 1) * len(mine)] = np.frombuffer(mine, np.uint8)
                tx.init(PAGES, 0)
                tx.send(np.asarray(pages[:2], np.int32))  # a chunked prefill's first chunk
                tx.send(np.asarray(pages[2:], np.int32), [np.asarray(src_idx, np.int32)] * components)
            done = poll_until([*senders.values(), *receivers.values()], {KVPoll.Success})
            assert done == [KVPoll.Success] * len(done), [o.reason for o in (*senders.values(), *receivers.values())]
            errors = [e for r in dec.ranks for e in kv_mismatches(dec, r, dst_pages[r], 2)]
            for r in dec.ranks:
                items = dec.state_items(r)
                for t, whole_bytes in enumerate(geo.state_tensors):
                    got = as_bytes(items[t])
                    item = len(got) // (items[t].shape[0])
                    for n, i in enumerate(dst_idx):
                        want = share(whole(t, n, whole_bytes), kind, decode_tp, r.tp_rank, geo.state_blocks(t))
                        if got[i * item : (i + 1) * item].tobytes() != want:
                            errors.append(f"{r.rank_id} state tensor {t} index {i}")
                    untouched = np.delete(got.reshape(-1, item), dst_idx, axis=0)
                    if untouched.any():
                        errors.append(f"{r.rank_id} state tensor {t}: bytes outside the room's indices")
            assert errors == []
            # Per kind, from the geometry alone: every decode rank's KV heads of every page of every
            # layer (K and V), each decode rank's item of every state tensor at each index, and one
            # aux row per decode rank; the duties' prediction says the same, as do both roles' agents.
            page = TOKENS * HEAD_DIM * 4  # one head
            want = {
                "kv": PAGES * 4 * 2 * HEADS * page,
                "state": decode_tp * len(dst_idx) * sum(geo.state_item_bytes(decode_tp)),
                "aux": decode_tp * 3 * 64,
            }
            assert want["state"] == len(dst_idx) * sum(geo.state_tensors)  # every tensor head-sharded
            predicted = pair_traffic(lc.spec, PAGES, state_slots=len(dst_idx)).values()
            assert want == {k: sum(getattr(b, k) for b in predicted) for k in want}
            for role in ("prefill", "decode"):
                got_bytes = {k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in want}
                assert got_bytes == want, role
        finally:
            server.close()
            pre.close()
            dec.close()
