"""SGLang's DP groups through real agents (issue 25): a prefill and a decode server of two DP groups
each (attention DP: ``--attn-dp-size 2``), every rank's manager built under SGLang's own parallel
state (``get_parallel().override``, what SGLang's scheduler publishes for the rank), so each rank
takes its id from its DP group, never from ``engine_rank`` (prefill's is its TP rank 0 or 1, decode's
its attention TP rank 0 for both groups). Both decode DP groups live on one agent: each registers
its own memory and receives its own room's bytes, byte-exact, from the prefill DP group that
SGLang's decode resolves (``follow_bootstrap_room``: room % 2; or the bootstrap server's
``/register_dp_rank`` + ``/query_dp_ranks``). A second engine for a live rank is refused with the
reason; the rank's engine restarted registers again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdfabric_core.policy.types import Role
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.synthetic import aux_chunk, kv_chunk, state_chunk
from tests.e2e.sglang_rooms import poll_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = {
    "layers": 2,
    "kvHeads": 2,
    "headDim": 16,
    "dtype": "float32",
    "pageSizeTokens": 16,
    "stateBytesPerRequest": 1024,
    "stateLayers": 2,
    "auxRowBytes": [64, 64],
}
SPEC = {
    "prefill": {"tp": 1, "dp": 2},
    "decode": {"tp": 1, "dp": 2},
    "transfer": {"transport": "tcp", "timeoutSeconds": 20},
    "model": MODEL,
}
ROW = 16 * 4  # one head of one token: head dim x float32
PAGES = 3
# room -> (the prefill DP group that takes it, the decode DP group that takes it). Under
# follow_bootstrap_room the prefill group is room % 2; with the query routes it is the DP
# controller's choice, here against the room's parity (so only the query can find it).
FOLLOW = {10: (0, 1), 11: (1, 0)}
QUERY = {10: (1, 1), 11: (0, 0)}


def as_bytes(t: Any) -> np.ndarray[Any, Any]:
    return t.numpy().view(np.uint8)


@contextmanager
def sglang_rank(dp: int, follow: bool) -> Iterator[None]:
    """SGLang's parallel state of the attention TP rank 0 of DP group ``dp`` of a server of two."""
    from sglang.srt.runtime_context import get_parallel

    method = "follow_bootstrap_room" if follow else "round_robin"
    with get_parallel().override(
        attn_tp_rank=0, attn_cp_rank=0, attn_cp_size=1, attn_dp_rank=dp, dp_size=1, dp_rank=None,
        num_dp_ranks=2, load_balance_method=method,
    ):  # fmt: skip
        yield


class Server:
    """One role's server: a pool and a manager per DP group, as SGLang's schedulers build them."""

    def __init__(self, lc: LocalFabric, role: Role, follow: bool, mp: pytest.MonkeyPatch, token: Path) -> None:
        from pdfabric_refengine import KVPool

        geo = lc.spec.model
        self.lc, self.role, self.follow, self.token = lc, role, follow, token
        self.pools = [
            KVPool(layers=geo.layers, local_heads=geo.kv_heads, head_dim=geo.head_dim, num_pages=8,
                   shm_dir=lc.shm_dir, state_layers=geo.state_layers,
                   state_slot_bytes=geo.state_bytes_per_request // geo.state_layers, state_slots=2)
            for _ in range(2)
        ]  # fmt: skip
        mp.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(token))
        self.managers = [self.manager(dp, mp) for dp in range(2)]

    def manager(self, dp: int, mp: pytest.MonkeyPatch) -> Any:
        from pdfabric_refengine import kv_args
        from pdfabric_sglang.conn import PdfabricKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        geo = self.lc.spec.model
        rank_id = f"{self.role}-0-dp{dp}-tp0" if dp else f"{self.role}-0-tp0"
        rank_id += "-cp0" if self.role is Role.PREFILL else ""
        mp.setenv("PDFABRIC_AGENT_ADDRESS", self.lc.agents[self.lc.agent_of(rank_id)].address)
        # SGLang's engine_rank: prefill's is the TP rank (DP group 1's is 1), decode's the attention
        # TP rank (0 in both groups).
        engine_rank = dp if self.role is Role.PREFILL else 0
        args = kv_args(self.pools[dp], engine_rank=engine_rank, page_size=geo.page_size_tokens,
                       kv_head_num=geo.kv_heads, total_kv_head_num=geo.kv_heads)  # fmt: skip
        mode = DisaggregationMode.PREFILL if self.role is Role.PREFILL else DisaggregationMode.DECODE
        with sglang_rank(dp, self.follow):
            mgr = PdfabricKVManager(args, mode, None, False)
        assert mgr.rank_id == rank_id
        return mgr

    def close(self) -> None:
        for mgr in self.managers:
            mgr.close()
        for pool in self.pools:
            pool.close()


def fill(pool: Any, room: int, pages: list[int], slot: int, aux: int) -> None:
    for layer in range(pool.layers):
        for kv, bufs in enumerate((pool.k_buffers, pool.v_buffers)):
            view = as_bytes(bufs[layer])
            for pos, page in enumerate(pages):
                for t in range(16):
                    for head in range(pool.local_heads):
                        chunk = kv_chunk(room, layer, kv, pos * 16 + t, head, ROW)
                        view[page * 16 + t, head] = np.frombuffer(chunk, np.uint8)
    for layer, buf in enumerate(pool.state_buffers[0]):
        as_bytes(buf)[slot] = np.frombuffer(state_chunk(room, layer, 0, pool.state_slot_bytes), np.uint8)
    for item, buf in enumerate(pool.aux.values()):
        as_bytes(buf)[aux] = np.frombuffer(aux_chunk(room, item, 64), np.uint8)


def mismatches(pool: Any, room: int, pages: list[int], slot: int, aux: int) -> list[str]:
    errors = []
    for layer in range(pool.layers):
        for kv, bufs in enumerate((pool.k_buffers, pool.v_buffers)):
            view = as_bytes(bufs[layer])
            for pos, page in enumerate(pages):
                for t in range(16):
                    for head in range(pool.local_heads):
                        if view[page * 16 + t, head].tobytes() != kv_chunk(room, layer, kv, pos * 16 + t, head, ROW):
                            errors.append(f"room {room} layer {layer} {'KV'[kv]} token {pos * 16 + t} head {head}")
    for layer, buf in enumerate(pool.state_buffers[0]):
        if as_bytes(buf)[slot].tobytes() != state_chunk(room, layer, 0, pool.state_slot_bytes):
            errors.append(f"room {room} state layer {layer}")
    for item, buf in enumerate(pool.aux.values()):
        if as_bytes(buf)[aux].tobytes() != aux_chunk(room, item, 64):
            errors.append(f"room {room} aux item {item}")
    return errors


def resolve_prefill_dp(mgr: Any, port: int, room: int) -> int:
    """The prefill DP group as SGLang's decode queue finds it: its fast path (the router's rank, one
    group, or room % dp_size), else the bootstrap server's ``/query_dp_ranks``, until it answers."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10.0
    while not mgr.try_ensure_parallel_info(addr):
        assert time.monotonic() < deadline, f"the prefill at {addr} was never resolved"
        time.sleep(0.01)
    req = SimpleNamespace(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)
    req.disagg_prefill_dp_rank = None
    fast = DecodePreallocQueue._resolve_prefill_dp_rank(SimpleNamespace(kv_manager=mgr), req)
    while fast is None:
        assert time.monotonic() < deadline, f"the prefill bootstrap server never named room {room}'s DP group"
        fast = CommonKVReceiver.query_prefill_dp_ranks(addr, [room]).get(str(room))
        time.sleep(0.01)
    return int(fast)


@pytest.mark.parametrize("follow", [True, False], ids=["follow-bootstrap-room", "query-dp-ranks"])
def test_two_decode_dp_groups_each_receive_their_own_room_and_a_live_rank_is_not_taken(
    follow: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer, PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    routes = FOLLOW if follow else QUERY
    token = tmp_path / "token"
    with LocalFabric(SPEC) as lc:
        token.write_text(lc.token)
        # Both decode DP groups on one agent: before DP ranks, they were one rank id there.
        assert lc.agent_of("decode-0-tp0") == lc.agent_of("decode-0-dp1-tp0")
        dec = Server(lc, Role.DECODE, follow, monkeypatch, token)
        pre = Server(lc, Role.PREFILL, follow, monkeypatch, token)
        with sglang_rank(0, follow):
            server = PdfabricKVBootstrapServer("127.0.0.1", 0)
        addr = f"127.0.0.1:{server.port}"
        try:
            # Prefill takes each request on its DP group; under follow_bootstrap_room a request
            # dispatched to another group fails, as SGLang's sender does.
            if follow:
                wrong = PdfabricKVSender(pre.managers[1], addr, 10)
                assert int(wrong.poll()) == KVPoll.Failed and "follow_bootstrap_room conflict" in wrong.reason
            senders = {room: PdfabricKVSender(pre.managers[p], addr, room) for room, (p, _) in routes.items()}
            found = {room: resolve_prefill_dp(dec.managers[d], server.port, room) for room, (_, d) in routes.items()}
            assert found == {room: p for room, (p, _) in routes.items()}
            receivers = {room: PdfabricKVReceiver(dec.managers[d], addr, room) for room, (_, d) in routes.items()}
            for room, rx in receivers.items():
                rx.init(found[room])
            assert poll_until(list(receivers.values()), {KVPoll.WaitingForInput}) == [KVPoll.WaitingForInput] * 2
            # Both decode groups put the request in the same places of their own memory.
            dst = {room: (dec.pools[d].allocate_pages(PAGES), 1, 1) for room, (_, d) in routes.items()}
            for room, rx in receivers.items():
                pages, slot, aux = dst[room]
                rx.send_metadata(np.asarray(pages, np.int32), aux, [np.asarray([slot], np.int32)])
            assert poll_until(list(senders.values()), {KVPoll.WaitingForInput}) == [KVPoll.WaitingForInput] * 2
            for room, tx in senders.items():
                pool = pre.pools[routes[room][0]]
                pages = pool.allocate_pages(PAGES)
                fill(pool, room, pages, slot=0, aux=0)
                tx.init(PAGES, 0)
                tx.send(np.asarray(pages, np.int32), [np.asarray([0], np.int32)])
            done = poll_until([*senders.values(), *receivers.values()], {KVPoll.Success})
            assert done == [KVPoll.Success] * 4, [o.reason for o in (*senders.values(), *receivers.values())]
            assert {s.decode_dp for s in senders.values()} == {0, 1}
            for room, (_, d) in routes.items():
                assert mismatches(dec.pools[d], room, *dst[room]) == []
            # A second engine claims decode DP group 1's rank while its engine is live: refused.
            with pytest.raises(RuntimeError) as err:
                dec.manager(1, monkeypatch)
            assert "HTTP 409 rank_taken" in str(err.value)
            assert "decode-0-dp1-tp0 is registered by engine instance" in str(err.value)
            taken = lc.metric_sum("pdfabric_api_refusals_total", reason="rank_taken")
            assert taken >= 2  # refused again while the manager waited for the holder to go
            # Its engine exits (its room feed closes) and starts again: the rank is its, at once.
            dec.managers[1].close()
            dec.managers[1] = dec.manager(1, monkeypatch)
            assert lc.metric_sum("pdfabric_api_refusals_total", reason="rank_taken") == taken
        finally:
            server.close()
            pre.close()
            dec.close()
