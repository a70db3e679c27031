"""SGLang's classes move KV, state and aux byte-exact through real agents, for every rule (issue 11),
and for MLA latents (issue 25).

Each rank's pool is the reference engine's (SGLang's [page][token][head][dim] buffers, or with
kvKind MLA one [token][latent] buffer per layer as SGLang's MLATokenToKVPool has, a Mamba-like
slot state, MetadataBuffers-like aux rows) in the agents' shared-memory directory; the pdfabric
manager registers it from SGLang's own KVArgs (``is_mla_backend`` for MLA), and senders and
receivers are driven as SGLang's schedulers drive them. Content is a function of logical
coordinates only (room, global layer, K/V or latent, request token, global KV head; state layer;
aux item: ``pdfabric_devcluster.synthetic``'s pattern), so a decode rank checks its bytes whatever
TP split, CP shard or PP stage sent them; every prefill rank of an MLA model writes the same
latent, as every attention-TP rank of SGLang's holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdfabric_core.policy.rank_mapping import cp_page_shard, global_heads, pp_layer_range
from pdfabric_core.policy.types import KvKind, Role
from pdfabric_core.rankmap import Rank, replica_ranks
from pdfabric_core.traffic import pair_traffic
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import aux_chunk, expected_bytes, kv_chunk, state_chunk
from tests.e2e.sglang_rooms import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = {
    "layers": 4,
    "kvHeads": 4,
    "headDim": 16,
    "dtype": "float32",
    "pageSizeTokens": 16,
    "stateBytesPerRequest": 2048,
    "stateLayers": 4,
    "auxRowBytes": [64, 64, 64],
}
# DeepSeek's latent shape, narrowed: kv_lora_rank + qk_rope_head_dim = 24 elements per token.
MLA_MODEL = {**MODEL, "kvKind": "MLA", "kvLoraRank": 16, "qkRopeHeadDim": 8}
PAGES = 5  # the request's pages (80 tokens)
ROOM = 4242


def as_bytes(t: Any) -> np.ndarray[Any, Any]:
    return t.numpy().view(np.uint8)


class Side:
    """The pools and managers of one role's replica 0, one per rank."""

    def __init__(self, lc: LocalFabric, role: Role, monkeypatch: pytest.MonkeyPatch, token_file: Path) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from pdfabric_refengine.mla_draft import with_draft
        from pdfabric_sglang.conn import PdfabricKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        spec = lc.spec
        group = spec.prefill if role is Role.PREFILL else spec.decode
        geo = spec.model
        self.role, self.group, self.ranks = role, group, replica_ranks(spec, role, 0)
        self.pools: dict[Rank, Any] = {}
        self.drafts: dict[Rank, Any] = {}  # the draft KV pool (model.draftLayers) of the last PP stage
        self.managers: dict[Rank, Any] = {}
        mode = DisaggregationMode.PREFILL if role is Role.PREFILL else DisaggregationMode.DECODE
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token_file))
        is_mla = geo.kv_kind is KvKind.MLA
        for rank in self.ranks:
            layers = pp_layer_range(geo.layers, group.pp, rank.pp_rank)
            heads = len(global_heads(rank.tp_rank, group.tp, geo.tp_kv_heads))
            pool = KVPool(layers=len(layers), local_heads=heads, head_dim=geo.head_width, num_pages=16,
                          shm_dir=lc.shm_dir, state_layers=geo.state_layers,
                          state_slot_bytes=geo.state_bytes_per_request // geo.state_layers, state_slots=4,
                          mla=is_mla)  # fmt: skip
            self.pools[rank] = pool
            # What a launcher sets in each rank's own process.
            monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
            monkeypatch.setenv("PDFABRIC_CP_RANK", str(rank.cp_rank))
            args = kv_args(pool, engine_rank=rank.tp_rank, page_size=geo.page_size_tokens, kv_head_num=heads,
                           total_kv_head_num=geo.kv_heads, pp_rank=rank.pp_rank, prefill_start_layer=layers.start)  # fmt: skip
            if geo.draft_layers_on(group.pp, rank.pp_rank):  # SGLang appends the draft pool's buffers
                self.drafts[rank] = KVPool(layers=geo.draft_layers, local_heads=heads, head_dim=geo.head_width,
                                           num_pages=16, shm_dir=lc.shm_dir, mla=is_mla)  # fmt: skip
                args = with_draft(args, self.drafts[rank])
            self.managers[rank] = PdfabricKVManager(args, mode, None, is_mla)
            # As for SGLang's CPU MetadataBuffers: the aux rows travel with each room (aux_inline),
            # the agent maps none of the engine's aux buffers; the decode checks below read them.
            reg = self.managers[rank].registration
            assert reg.aux_inline and not reg.aux and reg.aux_slots == pool.aux_slots

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for pool in (*self.pools.values(), *self.drafts.values()):
            pool.close()


def kv_buffers(pool: Any) -> list[list[Any]]:
    """The pool's KV buffers by kind, each per layer: K and V, or the MLA latent."""
    return [pool.k_buffers, pool.v_buffers] if pool.v_buffers else [pool.k_buffers]


def kv_pools(side: Side, rank: Rank, geo: Any) -> list[tuple[Any, int]]:
    """The rank's KV pools and the model layer of each one's layer 0: the target's (its PP
    stage's layers), then the draft's (numbered after the model's layers)."""
    first = pp_layer_range(geo.layers, side.group.pp, rank.pp_rank).start
    return [(side.pools[rank], first), *(((side.drafts[rank], geo.layers),) if rank in side.drafts else ())]


def fill(side: Side, rank: Rank, pages: list[int], positions: range, slot: int, aux: int, geo: Any) -> None:
    pool = side.pools[rank]
    heads = list(global_heads(rank.tp_rank, side.group.tp, geo.tp_kv_heads))
    row = geo.head_width * geo.dtype_bytes  # one head (or latent) of one token
    for kv_pool, first in kv_pools(side, rank, geo):
        for layer in range(kv_pool.layers):
            for kv, bufs in enumerate(kv_buffers(kv_pool)):
                view = as_bytes(bufs[layer])  # [token row, local head, row bytes]
                for page, pos in zip(pages, positions, strict=True):
                    for t in range(16):
                        for local, head in enumerate(heads):
                            view[page * 16 + t, local] = np.frombuffer(
                                kv_chunk(ROOM, first + layer, kv, pos * 16 + t, head, row), np.uint8
                            )
    for layer, buf in enumerate(pool.state_buffers[0]):
        as_bytes(buf)[slot] = np.frombuffer(state_chunk(ROOM, layer, 0, pool.state_slot_bytes), np.uint8)
    for item, buf in enumerate(pool.aux.values()):
        as_bytes(buf)[aux] = np.frombuffer(aux_chunk(ROOM, item, 64), np.uint8)


def mismatches(side: Side, rank: Rank, pages: list[int], slot: int, aux: int, geo: Any) -> list[str]:
    pool = side.pools[rank]
    heads = list(global_heads(rank.tp_rank, side.group.tp, geo.tp_kv_heads))
    row = geo.head_width * geo.dtype_bytes
    errors = []
    for kv_pool, first in kv_pools(side, rank, geo):
        for layer in range(kv_pool.layers):
            for kv, bufs in enumerate(kv_buffers(kv_pool)):
                view = as_bytes(bufs[layer])
                for pos, page in enumerate(pages):
                    for t in range(16):
                        for local, head in enumerate(heads):
                            want = kv_chunk(ROOM, first + layer, kv, pos * 16 + t, head, row)
                            if view[page * 16 + t, local].tobytes() != want:
                                errors.append(
                                    f"{rank.rank_id} layer {first + layer} buffer {kv} token {pos * 16 + t} head {head}"
                                )
    for layer, buf in enumerate(pool.state_buffers[0]):
        if as_bytes(buf)[slot].tobytes() != state_chunk(ROOM, layer, 0, pool.state_slot_bytes):
            errors.append(f"{rank.rank_id} state layer {layer}")
    for item, buf in enumerate(pool.aux.values()):
        if as_bytes(buf)[aux].tobytes() != aux_chunk(ROOM, item, 64):
            errors.append(f"{rank.rank_id} aux item {item}")
    return errors


@pytest.mark.parametrize(
    ("prefill", "decode", "model"),
    [
        ({"tp": 1}, {"tp": 1}, MODEL),
        ({"tp": 2}, {"tp": 4}, MODEL),
        ({"tp": 4}, {"tp": 2}, MODEL),
        ({"tp": 1, "cp": 4, "allCpRanksTransfer": True}, {"tp": 1}, MODEL),
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True, "dsaCacheLayerSplit": True}, {"tp": 1}, MODEL),
        ({"tp": 1, "pp": 2}, {"tp": 1}, MODEL),
        # MLA: decode takes the latent from one prefill rank; the other completes with nothing.
        ({"tp": 2}, {"tp": 1}, MLA_MODEL),
        ({"tp": 1}, {"tp": 2}, MLA_MODEL),  # the whole latent to each decode rank
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, MLA_MODEL),  # page shards, state once
        # A draft KV group (EAGLE/MTP) appended after the target's buffers: the target's rules.
        ({"tp": 2}, {"tp": 4}, {**MODEL, "draftLayers": 1}),  # head slices of the draft's K and V
        ({"tp": 1, "pp": 2}, {"tp": 1}, {**MODEL, "draftLayers": 1}),  # the last stage's draft only
        ({"tp": 1, "cp": 2, "allCpRanksTransfer": True}, {"tp": 1}, {**MODEL, "draftLayers": 1}),
        ({"tp": 2}, {"tp": 1}, {**MLA_MODEL, "draftLayers": 1}),  # one source per draft latent page
    ],
    ids=[
        "tp1-tp1", "tp2-tp4", "tp4-tp2", "cp4-all-ranks-dedup", "cp2-layer-split", "pp2-pp1",
        "mla-tp2-tp1", "mla-tp1-tp2", "mla-cp2-tp1",
        "draft-tp2-tp4", "draft-pp2-pp1", "draft-cp2-all-ranks", "draft-mla-tp2-tp1",
    ],
)  # fmt: skip
def test_sglang_classes_move_kv_state_aux_byte_exact(
    prefill: dict[str, Any],
    decode: dict[str, Any],
    model: dict[str, Any],
    token_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer, PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    spec = {
        "prefill": prefill,
        "decode": decode,
        "transfer": {"transport": "tcp", "timeoutSeconds": 20},
        "model": model,
    }
    with LocalFabric(spec) as lc:
        token_file.write_text(lc.token)
        geo = lc.spec.model
        dec = Side(lc, Role.DECODE, monkeypatch, token_file)
        pre = Side(lc, Role.PREFILL, monkeypatch, token_file)
        server = PdfabricKVBootstrapServer("127.0.0.1", 0)
        try:
            receivers = {r: PdfabricKVReceiver(m, f"127.0.0.1:{server.port}", ROOM) for r, m in dec.managers.items()}
            for rx in receivers.values():
                rx.init(0)
            assert poll_until(list(receivers.values()), {KVPoll.WaitingForInput}) == [KVPoll.WaitingForInput] * len(
                receivers
            )
            dst = {r: (dec.pools[r].allocate_pages(PAGES)[::-1], 2, 3) for r in dec.ranks}  # pages, state slot, aux row
            for r, rx in receivers.items():
                pages, slot, aux = dst[r]
                rx.send_metadata(np.asarray(pages, np.int32), aux, [np.asarray([slot], np.int32)])
            senders = {r: PdfabricKVSender(m, f"127.0.0.1:{server.port}", ROOM) for r, m in pre.managers.items()}
            assert poll_until(list(senders.values()), {KVPoll.WaitingForInput}) == [KVPoll.WaitingForInput] * len(
                senders
            )
            for r, tx in senders.items():
                shard = cp_page_shard(PAGES, pre.group.cp, r.cp_rank, all_ranks_send=pre.group.all_cp_ranks_transfer)
                pages = pre.pools[r].allocate_pages(len(shard))
                fill(pre, r, pages, shard, slot=1, aux=0, geo=geo)
                tx.init(len(shard), 0)
                half = len(pages) // 2
                if half:
                    tx.send(np.asarray(pages[:half], np.int32))  # a chunked prefill's first chunk
                tx.send(np.asarray(pages[half:], np.int32), [np.asarray([1], np.int32)])  # the last chunk
            done = poll_until([*senders.values(), *receivers.values()], {KVPoll.Success})
            assert done == [KVPoll.Success] * len(done), [o.reason for o in (*senders.values(), *receivers.values())]
            assert [e for r in dec.ranks for e in mismatches(dec, r, *dst[r], geo=geo)] == []
            # The agents counted what the geometry says moves, state once (CP dedup), which is the
            # status's prediction too, and SGLang's KVTransferMetric reports those very bytes.
            want = expected_bytes(lc.spec, pages=PAGES, state_slots=1, aux=True)
            predicted = pair_traffic(lc.spec, PAGES).values()
            assert (want.kv, want.state, want.aux) == tuple(
                sum(getattr(b, k) for b in predicted) for k in ("kv", "state", "aux")
            )
            for role in ("prefill", "decode"):
                got = {
                    k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in ("kv", "state", "aux")
                }
                assert got == {"kv": want.kv, "state": want.state, "aux": want.aux}, role
            assert lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total") == want.state_skipped
            assert (
                sum(rx.get_transfer_metric().transfer_total_bytes for rx in receivers.values())
                == want.kv + want.state + want.aux
            )
        finally:
            server.close()
            pre.close()
            dec.close()
