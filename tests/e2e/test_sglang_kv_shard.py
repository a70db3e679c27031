"""MLA KV cache sharding (SGLang's ``--enable-kv-cache-sharding``, issue 25) through SGLang's own
sender and receiver classes and real agents on Mooncake tcp loopback, byte-exact.

Each prefill attention-TP rank's pool holds only the pages it owns, where SGLang's allocator puts
them: logical page l (what the scheduler hands the sender) on rank l % N as its local page l // N.
The managers start under SGLang's parallel state with the option on (``attn_tp_size`` 2), so the
registration carries the shard group and the agent holds it to ``spec.prefill.kvCacheSharding``.
Decode is not sharded: each decode rank receives from BOTH prefill ranks, each writing the
request positions whose page it owns. Content is a function of the request position only, so a
page taken from the wrong rank or the wrong local page shows; the wrong-owner control builds the
pools with another owner rule and must fail the byte check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdfabric_core.policy.kv_shard import local_page, pages_per_source, shard_owner
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank, replica_ranks
from pdfabric_core.traffic import pair_traffic
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import aux_chunk, kv_chunk
from tests.e2e.sglang_rooms import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TP, LAYERS, PAGE_TOKENS, ROOM = 2, 3, 16, 5151
# DeepSeek's latent narrowed: 16 + 8 float32 elements a token; no state, no draft (not moved sharded).
MODEL = {"layers": LAYERS, "kvKind": "MLA", "kvLoraRank": 16, "qkRopeHeadDim": 8, "dtype": "float32",
         "pageSizeTokens": PAGE_TOKENS, "auxRowBytes": [64, 64, 64]}  # fmt: skip
ROW = 24 * 4  # one token's latent
PAGE = PAGE_TOKENS * ROW
LOCAL_PAGES = 8  # each prefill rank's pool: logical pages 0..15 over two ranks
SRC = [3, 4, 9, 6, 11]  # the request's logical pages: rank 1 owns positions 0, 2, 4, rank 0 positions 1, 3
DST = [4, 6, 1, 5, 2]  # its pages on every decode rank


def as_bytes(t: Any) -> np.ndarray[Any, Any]:
    return t.numpy().view(np.uint8)


def token_row(layer: int, pos: int, t: int) -> np.ndarray[Any, Any]:
    return np.frombuffer(kv_chunk(ROOM, layer, 0, pos * PAGE_TOKENS + t, 0, ROW), np.uint8)


class Side:
    """One role's pools (the reference engine's MLA pool) and pdfabric managers, one per rank."""

    def __init__(self, lc: LocalFabric, role: Role, mp: pytest.MonkeyPatch, pages: int) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from pdfabric_sglang.conn import PdfabricKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_parallel

        self.ranks = replica_ranks(lc.spec, role, 0)
        self.pools: dict[Rank, Any] = {}
        self.managers: dict[Rank, Any] = {}
        mode = DisaggregationMode.PREFILL if role is Role.PREFILL else DisaggregationMode.DECODE
        sharded = role is Role.PREFILL  # SGLang refuses the option on decode
        for rank in self.ranks:
            pool = KVPool(layers=LAYERS, local_heads=1, head_dim=24, num_pages=pages, page_size=PAGE_TOKENS,
                          shm_dir=lc.shm_dir, mla=True)  # fmt: skip
            self.pools[rank] = pool
            mp.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of(rank.rank_id)].address)
            mp.setenv("PDFABRIC_CP_RANK", "0")
            args = kv_args(pool, engine_rank=rank.tp_rank, page_size=PAGE_TOKENS, kv_head_num=1, total_kv_head_num=1)
            with get_parallel().override(enable_kv_cache_sharding=sharded, attn_tp_size=TP, attn_cp_size=1):
                self.managers[rank] = PdfabricKVManager(args, mode, None, True)
            assert self.managers[rank].registration.kv_shard_size == (TP if sharded else 1)

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for pool in self.pools.values():
            pool.close()


def fill_prefill(side: Side, rank: Rank, owner: Any) -> None:
    """The pages ``owner`` gives this rank, each at its local page l // N (SGLang's placement
    when ``owner`` is its own rule), and the aux row (rank 0 sends it)."""
    pool = side.pools[rank]
    for layer in range(LAYERS):
        view = as_bytes(pool.k_buffers[layer])  # [token row, 1, row bytes]
        for pos, page in enumerate(SRC):
            if owner(page) == rank.tp_rank:
                for t in range(PAGE_TOKENS):
                    view[local_page(page, TP) * PAGE_TOKENS + t, 0] = token_row(layer, pos, t)
    for item, buf in enumerate(pool.aux.values()):
        as_bytes(buf)[0] = np.frombuffer(aux_chunk(ROOM, item, 64), np.uint8)


def mismatches(side: Side, rank: Rank) -> list[str]:
    pool, errors = side.pools[rank], []
    for layer in range(LAYERS):
        view = as_bytes(pool.k_buffers[layer])
        for pos, page in enumerate(DST):
            for t in range(PAGE_TOKENS):
                if not np.array_equal(view[page * PAGE_TOKENS + t, 0], token_row(layer, pos, t)):
                    errors.append(f"{rank.rank_id} layer {layer} position {pos} token {t}")
        rows = np.delete(view.reshape(-1, PAGE_TOKENS * ROW), DST, axis=0)
        if rows.any():
            errors.append(f"{rank.rank_id} layer {layer}: bytes outside the room")
    for item, buf in enumerate(pool.aux.values()):
        if as_bytes(buf)[3].tobytes() != aux_chunk(ROOM, item, 64):
            errors.append(f"{rank.rank_id} aux item {item}")
    return errors


@dataclass
class ShardedRoom:
    """Room ``ROOM`` set up as SGLang's scheduler does it: each decode rank's receiver sent its
    pages (``DST``) and each prefill rank's sender bootstrapped, no page handed over yet."""

    lc: LocalFabric
    pre: Side
    dec: Side
    bootstrap: str
    receivers: dict[Rank, Any]
    senders: dict[Rank, Any]


@contextlib.contextmanager
def sharded_room(token_file: Path, monkeypatch: pytest.MonkeyPatch, *, verify: bool = False) -> Iterator[ShardedRoom]:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer, PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    spec = {"prefill": {"tp": TP, "kvCacheSharding": True}, "decode": {"tp": TP}, "model": MODEL,
            "transfer": {"transport": "tcp", "timeoutSeconds": 20, "verify": verify}}  # fmt: skip
    with LocalFabric(spec) as lc:
        token_file.write_text(lc.token)
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token_file))
        dec = Side(lc, Role.DECODE, monkeypatch, pages=8)
        pre = Side(lc, Role.PREFILL, monkeypatch, pages=LOCAL_PAGES)
        server = PdfabricKVBootstrapServer("127.0.0.1", 0)
        try:
            bootstrap = f"127.0.0.1:{server.port}"
            receivers = {r: PdfabricKVReceiver(m, bootstrap, ROOM) for r, m in dec.managers.items()}
            for rx in receivers.values():
                rx.init(0)
            assert set(poll_until(list(receivers.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            for rx in receivers.values():
                rx.send_metadata(np.asarray(DST, np.int32), 3)
            senders = {r: PdfabricKVSender(m, bootstrap, ROOM) for r, m in pre.managers.items()}
            assert set(poll_until(list(senders.values()), {KVPoll.WaitingForInput})) == {KVPoll.WaitingForInput}
            yield ShardedRoom(lc, pre, dec, bootstrap, receivers, senders)
        finally:
            server.close()
            pre.close()
            dec.close()


@pytest.mark.parametrize(
    ("chunks", "verify", "wrong_owner"),
    [
        ((5,), False, False),
        # SGLang's chunked prefill: rank 0 owns nothing of the first chunk, the second starts at position 1.
        ((1, 2, 2), False, False),
        # Checksummed: decode sums each source's pages at the positions its report names.
        ((2, 3), True, False),
        ((1, 4), False, True),  # pools built with another owner rule: the byte check must fail
    ],
    ids=["one-shot", "chunked", "chunked-verify", "wrong-owner-control"],
)
def test_sharded_mla_latent_moves_byte_exact_from_every_prefill_rank(
    chunks: tuple[int, ...], verify: bool, wrong_owner: bool, token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    with sharded_room(token_file, monkeypatch, verify=verify) as room:
        lc, pre, dec, senders, receivers = room.lc, room.pre, room.dec, room.senders, room.receivers
        owner = (lambda page: (page + 1) % TP) if wrong_owner else (lambda page: shard_owner(page, TP))
        kv = np.asarray(SRC, np.int32)
        for r, tx in senders.items():
            fill_prefill(pre, r, owner)
            tx.init(len(SRC), 0)
            start = 0
            for n in chunks:  # every rank is handed the same logical pages, as SGLang's scheduler does
                tx.send(kv[start : start + n])
                start += n
        done = poll_until([*senders.values(), *receivers.values()], {KVPoll.Success})
        assert done == [KVPoll.Success] * len(done), [o.reason for o in (*senders.values(), *receivers.values())]
        errors = [e for r in dec.ranks for e in mismatches(dec, r)]
        if wrong_owner:
            # Every position came from a page its real owner never filled: all of them wrong.
            assert len(errors) == TP * LAYERS * len(SRC) * PAGE_TOKENS, errors[:3]
            return
        assert errors == []
        # Checksummed: each decode rank compared each source's part at the positions it named.
        assert lc.metric_sum("pdfabric_integrity_checks_total", result="match") == (TP * TP if verify else 0)
        # Per source: the request's pages it owns, to each decode rank, every layer; rank 0 adds
        # the aux row (one per decode rank). Both sides count exactly that.
        owned = pages_per_source(SRC, TP)
        assert owned == [2, 3]
        aux = TP * 3 * 64
        for r in pre.ranks:
            want = owned[r.tp_rank] * TP * LAYERS * PAGE + (aux if r.tp_rank == 0 else 0)
            got = lc.metric_sum("pdfabric_peer_transfer_bytes_total", rank=r.rank_id, role="prefill")
            assert got == want, r.rank_id
            for d, mgr in dec.managers.items():  # what this decode rank's room took from this source
                by_source = mgr.client.poll(d.rank_id, ROOM).senders
                want_d = {"kv": owned[r.tp_rank] * LAYERS * PAGE, "aux": 3 * 64 if r.tp_rank == 0 else 0}
                assert {k: by_source[r.rank_id][k] for k in want_d} == want_d, (d.rank_id, r.rank_id)
        total = {"kv": TP * len(SRC) * LAYERS * PAGE, "aux": aux}
        for role in ("prefill", "decode"):
            got_total = {k: lc.metric_sum("pdfabric_transfer_bytes_total", role=role, kind=k) for k in total}
            assert got_total == total, role
        # The status: every decode rank receives the request's pages whatever their owners.
        predicted = pair_traffic(lc.spec, len(SRC))
        for d in range(TP):
            assert sum(b.kv for (_, dst), b in predicted.items() if dst == (d, 0)) == len(SRC) * LAYERS * PAGE


def test_an_abort_on_one_prefill_rank_fails_the_sharded_room_everywhere_and_frees_decode(
    token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang aborts the request on prefill rank 1 between chunks: every decode room fails (it
    waited for both sources), prefill rank 0's room fails with it, decode's sources go quiet and
    its pages take a new room."""
    from pdfabric_sglang.conn import PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll

    with sharded_room(token_file, monkeypatch) as room:
        pre, dec, bootstrap, senders, receivers = room.pre, room.dec, room.bootstrap, room.senders, room.receivers
        for r, tx in senders.items():
            fill_prefill(pre, r, lambda page: shard_owner(page, TP))
            tx.init(len(SRC), 0)
            tx.send(np.asarray(SRC[:2], np.int32))  # the first chunk: one page each
        aborted = next(tx for r, tx in senders.items() if r.tp_rank == 1)
        aborted.abort()
        ends = poll_until([*senders.values(), *receivers.values()], {KVPoll.Failed}, failed_ends=False)
        assert ends == [KVPoll.Failed] * len(ends), [o.reason for o in (*senders.values(), *receivers.values())]
        for d, mgr in dec.managers.items():
            assert mgr.calls.wait_idle(5.0)
            # Quiet once each source said its writes are over (a cancel answered fenced, or a
            # write in flight then reported fenced when it ended).
            deadline = time.monotonic() + 10.0
            while not (view := mgr.client.poll(d.rank_id, ROOM)).sources_quiet and time.monotonic() < deadline:
                time.sleep(0.02)
            assert view.state.title == "Failed" and view.sources_quiet, view
        # The claim on decode's pages is released: a new room takes the very same pages.
        for mgr in dec.managers.values():
            rx2 = PdfabricKVReceiver(mgr, bootstrap, ROOM + 1)
            rx2.init(0)
            rx2.send_metadata(np.asarray(DST, np.int32), 3)
            assert mgr.calls.wait_idle(5.0)
            assert int(rx2.poll()) != KVPoll.Failed, rx2.reason
            rx2.abort()
