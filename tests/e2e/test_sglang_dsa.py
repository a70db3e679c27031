"""DeepSeek-V3.2 (DSA) through the fabric under SGLang's own classes (issue 25), byte-exact: every rank's
KV and state are SGLang's own ``DSATokenToKVPool`` built on CPU (tests/sglang_dsa.py: the packed
fp8 latent of 656 bytes a token, and the indexer's keys and scales, one page item of 8448 bytes a
layer), registered from the ``KVArgs`` SGLang's ``setup_state_kv_args`` fills (state type ``dsa``),
moved by SGLang's senders and receivers for the pdfabric backend through real agents on Mooncake
tcp loopback.

The indexer state is page state beside MLA: indexed by the request's KV pages (SGLang's
``_dsa_pages_payload``), whole on every attention-TP rank like the latent, so each decode rank
takes it with its latent from one prefill rank. Prefill CP with all-ranks transfer: CP rank c
holds the latent of its page shard only and the whole indexer state (CP all-gathers before it
writes state), which CP rank 0 alone sends (dedup); under the DSA cache layer split each CP rank
holds and sends only its own state layers, the others left zero on it, so a layer taken from
the wrong rank arrives as zeros. The layer split here is pdfabric's model of it (the latent
page-sharded over CP, every layer registered); SGLang's own ``LayerSplitDSATokenToKVPool`` also
splits the latent's layers and registers only its own, which pdfabric refuses (docs/sglang.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from pdfabric_core.policy.rank_mapping import cp_page_shard, state_layer_shard
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank, replica_ranks
from pdfabric_core.traffic import pair_traffic
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import aux_chunk
from tests.e2e.sglang_rooms import poll_until, sglang_classes
from tests.sglang_dsa import (
    INDEX_PAGE,
    PACKED_TOKEN,
    PAGE_TOKENS,
    dsa_kv_args,
    dsa_model,
    dsa_pool,
    index_pages,
    latent_pages,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOM, LAYERS, PAGES, POOL_PAGES = 7373, 2, 5, 6
LATENT_PAGE = PAGE_TOKENS * PACKED_TOKEN  # 41984
SRC = [3, 1, 6, 2, 5]  # the request's pages on every prefill rank (page 0 is SGLang's padding page)
DST = [4, 6, 1, 5, 2]  # and on every decode rank


def content(kind: int, layer: int, pos: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The whole page ``pos`` of the request for one layer: latent (kind 0) or indexer keys (1)."""
    return np.random.default_rng([ROOM, kind, layer, pos]).integers(0, 256, nbytes, dtype=np.uint8)


class Side:
    """One role's ranks: SGLang's DSA pool, an aux pool (the reference engine's rows), a manager each."""

    def __init__(self, lc: LocalFabric, role: Role, classes: dict[str, Any], mp: pytest.MonkeyPatch) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.ranks = replica_ranks(lc.spec, role, 0)
        self.pools: dict[Rank, Any] = {}
        self.aux: dict[Rank, Any] = {}
        self.managers: dict[Rank, Any] = {}
        mode = DisaggregationMode.PREFILL if role is Role.PREFILL else DisaggregationMode.DECODE
        for rank in self.ranks:
            self.pools[rank] = dsa_pool(lc.shm_dir, layers=LAYERS, pages=POOL_PAGES)
            aux = KVPool(layers=1, local_heads=1, head_dim=8, num_pages=1, page_size=PAGE_TOKENS, mla=True,
                         shm_dir=lc.shm_dir)  # fmt: skip
            self.aux[rank] = aux
            mp.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
            mp.setenv("PDFABRIC_CP_RANK", str(rank.cp_rank))
            args = kv_args(aux, engine_rank=rank.tp_rank, page_size=PAGE_TOKENS, kv_head_num=1, total_kv_head_num=1)
            self.managers[rank] = classes["MANAGER"](dsa_kv_args(self.pools[rank], args), mode, None, True)
            parts = self.managers[rank].registration.state_parts
            assert (parts.kind.value, parts.source, parts.item_bytes) == ("page", "dsa", (INDEX_PAGE,) * LAYERS)

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for aux in self.aux.values():
            aux.close()


def fill_prefill(side: Side, rank: Rank, cp: int, layer_split: bool) -> range:
    """A prefill rank's share: the latent of its CP page shard, the indexer keys of every page for
    the state layers it owns, its aux row; returns its page shard."""
    shard = cp_page_shard(PAGES, cp, rank.cp_rank, all_ranks_send=True)
    owned = state_layer_shard(LAYERS, cp, rank.cp_rank, dsa_cache_layer_split=layer_split)
    pool = side.pools[rank]
    for layer in range(LAYERS):
        for pos in range(PAGES):
            if pos in shard:
                latent_pages(pool, layer)[SRC[pos]] = torch_of(content(0, layer, pos, LATENT_PAGE))
            if layer in owned:
                index_pages(pool, layer)[SRC[pos]] = torch_of(content(1, layer, pos, INDEX_PAGE))
    for item, buf in enumerate(side.aux[rank].aux.values()):
        buf.numpy().view(np.uint8)[0] = np.frombuffer(aux_chunk(ROOM, item, 64), np.uint8)
    return shard


def torch_of(a: np.ndarray[Any, Any]) -> Any:
    import torch

    return torch.from_numpy(a)


def mismatches(side: Side, rank: Rank) -> list[str]:
    """Decode's pages against the whole request, every other page of both kinds left zero."""
    pool, errors = side.pools[rank], []
    for layer in range(LAYERS):
        for kind, pages, nbytes in (
            (0, latent_pages(pool, layer), LATENT_PAGE),
            (1, index_pages(pool, layer), INDEX_PAGE),
        ):
            got = pages.numpy()
            for pos in range(PAGES):
                if not np.array_equal(got[DST[pos]], content(kind, layer, pos, nbytes)):
                    errors.append(f"{rank.rank_id} {('latent', 'indexer')[kind]} layer {layer} page {pos}")
            if np.delete(got, DST, axis=0).any():
                errors.append(f"{rank.rank_id} {('latent', 'indexer')[kind]} layer {layer}: bytes outside the room")
    for item, buf in enumerate(side.aux[rank].aux.values()):
        if buf.numpy().view(np.uint8)[2].tobytes() != aux_chunk(ROOM, item, 64):
            errors.append(f"{rank.rank_id} aux item {item}")
    return errors


@pytest.mark.parametrize(
    ("prefill", "decode_tp"),
    [
        ({"tp": 2}, 1),  # decode takes each page's latent and indexer keys from one prefill rank
        ({"tp": 1}, 2),  # each decode rank gets the whole latent and indexer state
        ({"cp": 2, "allCpRanksTransfer": True}, 1),  # latent page shards, indexer state from CP rank 0
        ({"cp": 2, "allCpRanksTransfer": True, "dsaCacheLayerSplit": True}, 1),  # each CP rank its state layers
    ],
    ids=["tp2-tp1", "tp1-tp2", "cp2-all-ranks-dedup", "cp2-layer-split"],
)
def test_sglangs_dsa_pool_moves_byte_exact_and_counted_per_kind(
    prefill: dict[str, Any], decode_tp: int, token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    classes = sglang_classes()
    spec = {"prefill": prefill, "decode": {"tp": decode_tp}, "transfer": {"transport": "tcp", "timeoutSeconds": 20},
            "model": dsa_model(LAYERS)}  # fmt: skip
    cp, split = prefill.get("cp", 1), bool(prefill.get("dsaCacheLayerSplit"))
    with LocalFabric(spec) as lc:
        token_file.write_text(lc.token)
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token_file))
        dec = Side(lc, Role.DECODE, classes, monkeypatch)
        pre = Side(lc, Role.PREFILL, classes, monkeypatch)
        server = classes["BOOTSTRAP_SERVER"]("127.0.0.1", 0)
        try:
            receivers = {r: classes["RECEIVER"](m, f"127.0.0.1:{server.port}", ROOM) for r, m in dec.managers.items()}
            for rx in receivers.values():
                rx.init(0)
            assert set(poll_until(list(receivers.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            dst = np.asarray(DST, np.int32)
            for rx in receivers.values():
                rx.send_metadata(dst, 2, [dst])  # the indexer state at the pages' own numbers
            senders = {r: classes["SENDER"](m, f"127.0.0.1:{server.port}", ROOM) for r, m in pre.managers.items()}
            assert set(poll_until(list(senders.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            for r, tx in senders.items():
                shard = fill_prefill(pre, r, cp, split)
                kv = np.asarray([SRC[p] for p in shard], np.int32)
                tx.init(len(kv), 0)
                tx.send(kv[:1])  # a chunked prefill's first chunk
                tx.send(kv[1:], [np.asarray(SRC, np.int32)])  # SGLang's _dsa_pages_payload: every page
            done = poll_until([*senders.values(), *receivers.values()], {KVPoll.Success})
            assert done == [KVPoll.Success] * len(done), [o.reason for o in (*senders.values(), *receivers.values())]
            assert [e for r in dec.ranks for e in mismatches(dec, r)] == []
            # Per kind from the geometry alone: each decode rank gets every page's packed latent and
            # indexer page of every layer once, one aux row; CP ranks past 0 skip the state unless split.
            state = decode_tp * PAGES * LAYERS * INDEX_PAGE
            want = {"kv": decode_tp * PAGES * LAYERS * LATENT_PAGE, "state": state, "aux": decode_tp * 3 * 64}
            predicted = pair_traffic(lc.spec, PAGES, state_slots=PAGES).values()
            assert want == {k: sum(getattr(b, k) for b in predicted) for k in want}
            for role in ("prefill", "decode"):
                got = {k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in want}
                assert got == want, role
            skipped = (cp - 1) * state if cp > 1 and not split else 0
            assert lc.metric_sum("pdfabric_state_dedup_skipped_bytes_total") == skipped
        finally:
            server.close()
            pre.close()
            dec.close()
