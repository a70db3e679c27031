"""The SGLang backend's parts that its scheduler leans on, one at a time (the e2e servers test runs
them under SGLang's real scheduler):

- the agent refuses a room for engine memory it does not hold (it restarted), and the message
  says what to do; the flag travels on the wire and nothing else is taken for it;
- decode's prefill table is filled off the calling thread, and a prefill of another PDCluster is
  refused for good while an unreachable one is retried;
- the CPU engine's allocations land in shared-memory files the agent can map;
- a sender or receiver whose agent is down, refuses or restarted fails the request with the
  reason; a failure learned from another rank says so; a Failed early view is Failed; decode's
  radix prefix reaches the prefill; deferred release follows the agent's ``sources_quiet``.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.client.calls import AgentCalls
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from tests.unit.agents import D, P, make_agent

# ---------------------------------------------------------------- the agent: engine memory


def test_a_room_for_engine_memory_is_refused_when_none_is_registered(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, "n1", [Rank(Role.PREFILL, 0, 0)])
    with pytest.raises(ApiError) as err:
        agent.submit_send(SendRequest(P, 7, [0, 1], [], 0, 0, engine_memory=True))
    assert err.value.status == 409
    assert err.value.reason is Refusal.MEMORY_NOT_REGISTERED
    assert "register it again (POST /v1/memory)" in err.value.message
    assert agent.rooms.prefill == {}  # nothing half-created
    decode = make_agent(tmp_path, "n2", [Rank(Role.DECODE, 0, 0)])
    with pytest.raises(ApiError) as err:
        decode.submit_receive(ReceiveRequest(D, 7, [0, 1], [], 0, 0, engine_memory=True))
    assert err.value.reason is Refusal.MEMORY_NOT_REGISTERED


def test_engine_memory_flag_on_the_wire() -> None:
    msg = SendRequest(P, 7, [0, 1], [], 0, 0, engine_memory=True)
    assert SendRequest.parse(msg.to_json()) == msg
    plain = SendRequest(P, 7, [0, 1], [], 0, 0)
    assert "engine_memory" not in plain.to_json()  # older agents see the body they know
    assert SendRequest.parse(plain.to_json()).engine_memory is False
    with pytest.raises(ApiError) as err:
        SendRequest.parse({**msg.to_json(), "engine_memory": "yes"})
    assert err.value.status == 400 and "engine_memory must be true or false" in err.value.message


# ---------------------------------------------------------------- decode's prefill table


@pytest.fixture
def bootstrap() -> Iterator[dict[str, Any]]:
    """A prefill bootstrap server's replica answer, changeable by the test."""
    state: dict[str, Any] = {"doc": {"replica": 2, "cluster": "uid-1"}, "calls": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["calls"] += 1
            body = json.dumps(state["doc"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["addr"] = f"127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def until(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return value


def test_prefill_table_fills_in_the_background(bootstrap: dict[str, Any]) -> None:
    from pdfabric_sglang.peers import PrefillPeer, PrefillPeers

    peers = PrefillPeers("uid-1")
    assert peers.ensure(bootstrap["addr"]) is False  # the lookup started; the caller does not wait
    until(lambda: peers.ensure(bootstrap["addr"]))
    assert peers.table[bootstrap["addr"]] == PrefillPeer(replica=2, cluster="uid-1")
    # What SGLang's decode queue reads off it: one DP group, every room to DP rank 0.
    assert (peers.table[bootstrap["addr"]].dp_size, peers.table[bootstrap["addr"]].follow_bootstrap_room) == (1, True)
    calls = bootstrap["calls"]
    assert peers.ensure(bootstrap["addr"]) and bootstrap["calls"] == calls  # cached


def test_another_clusters_prefill_is_refused_for_good(bootstrap: dict[str, Any]) -> None:
    from pdfabric_sglang.peers import PrefillPeers

    bootstrap["doc"] = {"replica": 0, "cluster": "uid-other"}
    peers = PrefillPeers("uid-1")
    peers.ensure(bootstrap["addr"])
    until(lambda: peers.error(bootstrap["addr"]) is not None or peers.ensure(bootstrap["addr"]))
    error = peers.error(bootstrap["addr"])
    assert error is not None and not error.retryable and "uid-other" in str(error)
    calls = bootstrap["calls"]
    assert peers.ensure(bootstrap["addr"]) is False and bootstrap["calls"] == calls  # not asked again


def test_an_unreachable_prefill_is_retried() -> None:
    from pdfabric_sglang.peers import PrefillPeers

    from pdfabric_devcluster.procs import free_port

    addr = f"127.0.0.1:{free_port()}"
    peers = PrefillPeers("uid-1")
    peers.ensure(addr)
    until(lambda: peers.error(addr) is not None)
    assert peers.error(addr).retryable  # type: ignore[union-attr]
    assert peers.ensure(addr) is False  # a new lookup started


# ---------------------------------------------------------------- CPU pools in shared memory


def test_cpu_allocations_land_in_shared_memory_files(tmp_path: Path) -> None:
    import torch

    from pdfabric_agent.client.shares import process_mappings, share_of
    from pdfabric_agent.client.shm import shared_cpu_allocations
    from pdfabric_agent.protocol.wire import ShareKind

    with shared_cpu_allocations(str(tmp_path)):
        kv = torch.zeros((8, 2, 16), dtype=torch.bfloat16, device="cpu")
        rows = torch.zeros(4, 16, dtype=torch.uint64, device="cpu")
        private = torch.zeros((4,), dtype=torch.float32)  # no explicit device: left alone
        pinned = torch.empty((4,), dtype=torch.float32, device="cpu", requires_grad=True)  # other options too
    after = torch.zeros((2,), device="cpu")  # outside the block: the real allocator again
    assert kv.shape == (8, 2, 16) and kv.dtype == torch.bfloat16 and not kv.any()
    assert rows.shape == (4, 16) and rows.dtype == torch.uint64
    maps = process_mappings()
    share = share_of(kv.data_ptr(), kv.numel() * kv.element_size(), None, maps)
    assert share.kind is ShareKind.SHM and Path(share.path).parent == tmp_path
    kv[3, 1, 5] = 7.0  # the file is the memory: what the agent maps is what SGLang writes
    with open(share.path, "rb") as fh:
        raw = np.frombuffer(fh.read(), dtype=np.uint16)
    assert raw[(3 * 2 + 1) * 16 + 5] == np.array([7.0], dtype=np.float32).view(np.uint32)[0] >> 16
    for t in (private, pinned, after):
        with pytest.raises(ValueError):
            share_of(t.data_ptr(), 16, None, maps)
    assert len(list(tmp_path.iterdir())) == 2


def test_files_of_gone_processes_are_removed_by_the_next_allocation(tmp_path: Path) -> None:
    import subprocess
    import sys

    import torch

    from pdfabric_agent.client.shm import PREFIX, shared_cpu_allocations

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    orphan = tmp_path / f"{PREFIX}{dead_pid}-abc"  # a killed engine's KV pool
    orphan.write_bytes(b"x" * 64)
    other = tmp_path / "pdfabric-uid-1-prefill-0-tp0-cp0-kv"  # the agent's own pool: not ours to remove
    other.write_bytes(b"x")
    with shared_cpu_allocations(str(tmp_path)):
        torch.zeros((4,), dtype=torch.float32, device="cpu")
    names = {p.name for p in tmp_path.iterdir()}
    assert orphan.name not in names and other.name in names
    assert any(n.startswith(f"{PREFIX}{os.getpid()}-") for n in names)  # this process's new file


# ---------------------------------------------------------------- senders and receivers


class FakeClient:
    """The agent client's calls a room makes, answered by the test (a unit test of the classes)."""

    def __init__(self) -> None:
        self.views: dict[int, Any] = {}
        self.submitted: list[Any] = []
        self.aborted: list[int] = []
        self.told: list[int | None] = []  # the peer replica named with each abort
        self.told_dp: list[int] = []  # the peer DP group named with each abort
        self.submit_error: Exception | None = None

    def poll(self, rank: str, room: int, wait_s: float = 0.0) -> RoomView:
        """The test's view of the room, in the agent's wire form, read as the real client reads it."""
        view = self.views.get(room)
        if isinstance(view, Exception):
            raise view
        if view is None:
            raise AgentRefused(404, "unknown_room", f"room {room} is unknown on {rank}")
        return RoomView.parse({"rank": rank, "room": room, **view})

    def submit(self, msg: Any) -> RoomView:
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(msg)
        return RoomView(rank=msg.rank, room=msg.room, state=RoomState.BOOTSTRAPPING)

    def begin_submit(self, msg: Any) -> Callable[[], RoomView]:
        view = self.submit(msg)
        return lambda: view

    def abort(
        self, rank: str, room: int, reason: str = "", peer_replica: int | None = None, peer_dp: int = 0
    ) -> RoomView:
        self.aborted.append(room)
        self.told.append(peer_replica)
        self.told_dp.append(peer_dp)
        return RoomView(rank=rank, room=room, state=RoomState.FAILED, reason=reason)


def manager(role: Role) -> Any:
    """A manager as the sender and receiver see it, around a FakeClient (no agent, no buffers)."""
    from pdfabric_sglang.conn import PdfabricKVManager
    from pdfabric_sglang.kvargs import AttentionRanks
    from pdfabric_sglang.peers import PrefillPeer, PrefillPeers

    mgr = PdfabricKVManager.__new__(PdfabricKVManager)
    mgr.client = FakeClient()  # type: ignore[assignment]
    mgr.calls_client = mgr.client
    mgr.rank_id = P if role is Role.PREFILL else D
    mgr.config = SimpleNamespace(address="127.0.0.1:1")  # type: ignore[assignment]
    mgr.bootstrap_timeout_s = 300.0
    mgr.parallel = AttentionRanks(0, 0, 1)  # one DP group: SGLang published no parallel state
    mgr.peers = PrefillPeers("uid-1")
    mgr.peers.table["p:1"] = PrefillPeer(replica=0, cluster="uid-1")
    mgr.prefill_info_table = mgr.peers.table
    mgr._room_openings = OrderedDict()
    # SGLang's CPU MetadataBuffers: private rows (two items of 64 and 32 bytes, 4 rows) that travel
    # with the rooms, as the manager registers them (aux_inline).
    mgr._aux_buffers = [np.zeros((4, 64), np.uint8), np.zeros((4, 32), np.uint8)]  # type: ignore[attr-defined]
    mgr.kv_args = SimpleNamespace(
        aux_data_ptrs=[b.ctypes.data for b in mgr._aux_buffers],  # type: ignore[attr-defined]
        aux_data_lens=[b.nbytes for b in mgr._aux_buffers],  # type: ignore[attr-defined]
        aux_item_lens=[b[0].nbytes for b in mgr._aux_buffers],  # type: ignore[attr-defined]
    )
    mgr.registration = SimpleNamespace(aux_inline=True)  # type: ignore[assignment]
    # Submits and aborts run at once on the test's thread; no room feed: polls ask the client.
    mgr.calls = AgentCalls("test", inline=True)
    mgr.events = None
    return mgr


def test_a_sender_whose_agent_is_down_fails_with_the_reason() -> None:
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 5)
    mgr.client.views[5] = ConnectionRefusedError(111, "Connection refused")
    assert tx.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError) as err:
        tx.failure_exception()
    assert "unreachable" in str(err.value) and not err.value.is_from_another_rank


def test_a_sender_send_the_agent_cannot_take_fails_the_request() -> None:
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 5)
    mgr.client.views[5] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D]}
    assert tx.poll() == KVPoll.WaitingForInput
    tx.init(2, 0)
    mgr.client.submit_error = ConnectionResetError(104, "reset")
    tx.send(np.array([0, 1], np.int32))  # the last chunk: no exception escapes into the scheduler
    assert tx.poll() == KVPoll.Failed and "did not take the send" in tx.reason


def test_a_failed_early_view_is_failed() -> None:
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 5)
    mgr.client.views[5] = {"state": "Failed", "code": 0, "reason": "decode aborted", "decode_ranks_ready": []}
    assert tx.poll() == KVPoll.Failed and tx.reason == "decode aborted"


def test_a_failure_from_another_rank_says_so_and_aborts_this_ranks_room() -> None:
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 5)
    mgr.client.views[5] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D]}
    tx.poll()
    tx.init(1, 0)
    tx.send(np.array([3], np.int32))
    mgr.client.views[5] = {"state": "Transferring", "code": 3}
    assert tx.poll() == KVPoll.Transferring
    with pytest.raises(KVTransferError) as err:  # SGLang's all-reduce said Failed: another rank failed
        tx.failure_exception()
    assert err.value.is_from_another_rank
    assert mgr.client.aborted == [5] and tx.poll() == KVPoll.Failed


def test_a_submitted_room_the_agent_lost_fails() -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.DECODE)
    rx = PdfabricKVReceiver(mgr, "p:1", 9)
    rx.init(0)
    assert rx.poll() == KVPoll.WaitingForInput
    rx.send_metadata(np.array([1, 2], np.int32), 0, None)
    assert mgr.client.submitted[0].engine_memory is True
    assert rx.poll() == KVPoll.Failed and "restarted" in rx.reason  # 404 after submit


def test_a_decode_radix_prefix_reaches_the_prefill_sender() -> None:
    """Decode holds 32 tokens of the prompt (its radix cache): it submits the pages after them with
    the prefix; the prefill's agent view carries it, and SGLang's prefill pops it to send from
    there."""
    from pdfabric_sglang.conn import PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    dec = manager(Role.DECODE)
    rx = PdfabricKVReceiver(dec, "p:1", 9)
    rx.init(0)
    rx.send_metadata(np.array([1, 2], np.int32), 0, None, decode_prefix_len=32)
    (sent,) = dec.client.submitted
    assert (sent.kv_pages, sent.prefix_tokens) == ([1, 2], 32)
    pre = manager(Role.PREFILL)
    tx = PdfabricKVSender(pre, "p:1", 9)
    pre.client.views[9] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D], "decode_prefix_tokens": 32}
    assert tx.poll() == KVPoll.WaitingForInput
    assert tx.pop_decode_prefix_len() == 32 and tx.pop_decode_prefix_len() == 0  # popped once


def test_the_prefix_travels_decode_agent_to_prefill_agent() -> None:
    from tests.unit.agents import room_info

    msg = ReceiveRequest(D, 9, [1, 2], [], 0, 0, engine_memory=True, prefix_tokens=32)
    assert ReceiveRequest.parse(msg.to_json()) == msg
    assert "prefix_tokens" not in ReceiveRequest(D, 9, [1, 2], [], 0, 0).to_json()
    info = room_info(9, prefix_tokens=32)
    assert type(info).parse(info.to_json()).prefix_tokens == 32
    assert type(info).parse({**info.to_json(), "prefix_tokens": None}).prefix_tokens == 0  # an older agent


def test_deferred_release_waits_for_the_agents_quiet_sources() -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver

    mgr = manager(Role.DECODE)
    rx = PdfabricKVReceiver(mgr, "p:1", 9)
    rx.init(0)
    rx.send_metadata(np.array([1, 2], np.int32), 0, None)
    rx.abort()
    rx.ensure_abort_notified(force_arm=True)
    assert rx.abort_notified and mgr.client.aborted == [9] and len(rx.bootstrap_infos) == 1
    mgr.client.views[9] = {"state": "Failed", "code": 0, "sources_quiet": False}
    assert mgr.is_abort_release_safe(9, 1) is False  # a source may still be writing
    mgr.client.views[9] = {"state": "Failed", "code": 0, "sources_quiet": True}
    assert mgr.is_abort_release_safe(9, 1) is True
    mgr.client.views[9] = ConnectionRefusedError(111, "refused")
    assert mgr.is_abort_release_safe(9, 1) is False  # unknown: SGLang's deadline releases it
    assert mgr.is_abort_release_safe(10, 1) is True  # a room the agent never took


# ---------------------------------------------------------------- prefill ranks with nothing to move


def prefill_agent(tmp_path: Path, raw: dict[str, Any], ranks: list[Rank]) -> Any:
    """The agent serving ``ranks`` of a spec ``raw`` (the engine path, in process): the prefill
    ranks are on one agent, the decode ranks on another."""
    from pdfabric_core.rankmap import AgentEntry
    from pdfabric_core.spec import parse_spec
    from tests.unit.agents import make_agent

    spec = parse_spec(raw)
    prefill = tuple(Rank(Role.PREFILL, 0, t) for t in range(spec.prefill.tp))
    decode = tuple(Rank(Role.DECODE, 0, t) for t in range(spec.decode.tp))
    entries = (AgentEntry("a1", "n1", prefill), AgentEntry("a2", "n2", decode))
    return make_agent(tmp_path, "n1", ranks, raw=raw, entries=entries, cluster="sglang-backend")


REPLICATED = {
    "prefill": {"tp": 4},
    "decode": {"tp": 2},
    "transfer": {"transport": "tcp"},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 8, "pageSizeTokens": 2, "dtype": "float32"},
}


def test_a_prefill_rank_whose_replicated_heads_another_rank_sends_is_ready_at_once(tmp_path: Path) -> None:
    """Prefill TP 4 -> decode TP 2 with 2 KV heads: ranks 1 and 3 hold copies of the heads ranks 0
    and 2 send. No decode rank announces a room to them, and SGLang takes the MIN of all ranks'
    polls: they are WaitingForInput at once, and their send is Success with nothing moved."""
    ranks = [Rank(Role.PREFILL, 0, t) for t in range(4)]
    agent = prefill_agent(tmp_path, REPLICATED, ranks)
    quiet = {r.rank_id: agent.sender.early_view(r.rank_id, 11) for r in ranks}
    assert quiet["prefill-0-tp0-cp0"] is None and quiet["prefill-0-tp2-cp0"] is None  # wait for decode
    for rank_id in ("prefill-0-tp1-cp0", "prefill-0-tp3-cp0"):
        view = quiet[rank_id]
        assert view is not None and view.state is RoomState.WAITING_FOR_INPUT and view.sends is False
        assert "replicated" in view.reason
        done = agent.submit_send(SendRequest(rank_id, 11, [0, 1], [], 0, 0))
        assert done.state is RoomState.SUCCESS and sum(done.moved.values()) == 0
        assert agent.sender.early_view(rank_id, 11) is None  # sent: the poll answers the room, Success
    # Decode rank 1 has the number of a prefill rank with no route, but it is no prefill rank: its
    # polls answer its own rooms (an early answer here left decode rooms WaitingForInput).
    decode = prefill_agent(tmp_path, REPLICATED, [Rank(Role.DECODE, 0, 1)])
    assert decode.sender.early_view("decode-0-tp1", 11) is None


def test_the_engine_sender_of_a_rank_that_sends_nothing_completes() -> None:
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 12)
    mgr.client.views[12] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [], "sends": False}
    assert tx.poll() == KVPoll.WaitingForInput
    tx.init(1, 0)
    tx.send(np.array([4], np.int32))
    assert mgr.client.submitted[0].peer_replica == 0
    mgr.client.views[12] = {"state": "Success", "code": 4, "bytes": {}}
    assert tx.poll() == KVPoll.Success


def test_a_pp_stage_that_sends_before_seeing_decode_submits_from_its_next_poll() -> None:
    """SGLang's PP stages after the first follow stage 0's poll: the last chunk can come before
    this stage's room saw decode's announcement. The send waits; the next poll submits it."""
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 13)
    tx.init(2, 0)
    tx.send(np.array([4, 5], np.int32))  # decode has not announced the room at this rank's agent
    assert mgr.client.submitted == [] and tx.concluded is None
    assert tx.poll() == KVPoll.Bootstrapping
    mgr.client.views[13] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": ["decode-1-tp0"]}
    assert tx.poll() == KVPoll.WaitingForInput  # submitted now
    assert [(m.kv_pages, m.peer_replica) for m in mgr.client.submitted] == [([4, 5], 1)]
    mgr.client.views[13] = {"state": "Success", "code": 4, "bytes": {"kv": 64}}
    assert tx.poll() == KVPoll.Success


@pytest.mark.parametrize(
    ("role", "engine_rank", "attention", "want"),
    [
        (Role.PREFILL, 1, None, "prefill-0-tp1-cp0"),  # not SGLang's scheduler: KVArgs.engine_rank
        (Role.PREFILL, 1, (1, 0, 1), "prefill-0-tp1-cp0"),  # no CP, no DP: the same
        (Role.PREFILL, 1, (0, 1, 2), "prefill-0-tp0-cp1"),  # CP2 in one server: engine_rank 1 is TP 0, CP 1
        # TP 4 with attention DP 2: SGLang's tp_rank 3 is DP group 1, attention TP 1. Prefill's
        # engine_rank is the tp_rank (3), decode's the attention TP rank (1): both name one rank.
        (Role.PREFILL, 3, (1, 0, 1, 1, 2), "prefill-0-dp1-tp1-cp0"),
        (Role.DECODE, 1, (1, 0, 1, 1, 2), "decode-0-dp1-tp1"),
        (Role.DECODE, 1, (1, 0, 1, 0, 2), "decode-0-tp1"),  # DP group 0 keeps the id it had without DP
    ],
)
def test_the_rank_id_is_sglangs_dp_group_and_attention_ranks_never_engine_rank(
    role: Role, engine_rank: int, attention: tuple[int, ...] | None, want: str
) -> None:
    from pdfabric_sglang.kvargs import AttentionRanks, rank_id_for

    cfg = SimpleNamespace(rank=None, replica=0, cp_rank=0)
    args = SimpleNamespace(engine_rank=engine_rank, pp_rank=0)
    ranks = AttentionRanks(*attention) if attention else None
    assert rank_id_for(role, cfg, args, ranks) == want  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("published", "want"),
    [
        # Attention DP (--attn-dp-size 2): the group is the attention-DP rank.
        (
            {"attn_tp_rank": 0, "attn_dp_rank": 1, "dp_size": 1, "dp_rank": None, "num_dp_ranks": 2},
            (0, 0, 1, 1, 2, True),
        ),
        # System DP (--dp-size 2, separate replicas, round robin): the group is the system DP rank.
        (
            {"attn_tp_rank": 1, "attn_dp_rank": 0, "dp_size": 2, "dp_rank": 1, "num_dp_ranks": 2},
            (1, 0, 1, 1, 2, False),
        ),
        # CP 2, no DP.
        (
            {"attn_tp_rank": 0, "attn_cp_rank": 1, "attn_cp_size": 2, "attn_dp_rank": 0, "dp_size": 1},
            (0, 1, 2, 0, 1, True),
        ),
    ],
    ids=["attention-dp", "system-dp", "cp2"],
)
def test_attention_ranks_are_read_from_sglangs_parallel_state(
    published: dict[str, Any], want: tuple[int, int, int, int, int, bool]
) -> None:
    from pdfabric_sglang.manager import attention_ranks
    from sglang.srt.runtime_context import get_parallel

    assert attention_ranks() is None  # nothing published in this process
    method = "follow_bootstrap_room" if want[5] else "round_robin"
    names = {"attn_cp_rank": 0, "attn_cp_size": 1, "dp_rank": None, "num_dp_ranks": 1, **published}
    with get_parallel().override(**names, load_balance_method=method):
        assert attention_ranks() == want


def test_an_abort_before_the_submit_reaches_the_agent_on_both_sides() -> None:
    """SGLang aborts a request before its room was submitted: the prefill sender gives the room up
    at its agent (decode's announcement is refused or failed), and the decode receiver names the
    prefill replica so that side's agents are told; neither waits for a deadline."""
    from pdfabric_sglang.conn import PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    pmgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(pmgr, "p:1", 21)
    tx.abort()
    assert (pmgr.client.aborted, pmgr.client.told) == ([21], [None])
    assert tx.poll() == KVPoll.Failed
    dmgr = manager(Role.DECODE)
    rx = PdfabricKVReceiver(dmgr, "p:1", 22)  # SGLang aborts it before init: the table says
    rx.abort()
    assert (dmgr.client.aborted, dmgr.client.told) == ([22], [0])
    assert rx.poll() == KVPoll.Failed


def test_a_reopened_room_is_a_fresh_agent_room_the_same_on_both_sides() -> None:
    """Rebootstrap opens SGLang's bootstrap room again on both sides: the n-th opening is the same
    fresh agent room at the prefill sender and the decode receiver (the agent's rooms are
    single-use), and the first opening is the bootstrap room itself."""
    from pdfabric_sglang.conn import PdfabricKVReceiver, PdfabricKVSender

    pmgr, dmgr = manager(Role.PREFILL), manager(Role.DECODE)
    first = (PdfabricKVSender(pmgr, "p:1", 2**62 + 5).room, PdfabricKVReceiver(dmgr, "p:1", 2**62 + 5).room)
    again = (PdfabricKVSender(pmgr, "p:1", 2**62 + 5).room, PdfabricKVReceiver(dmgr, "p:1", 2**62 + 5).room)
    assert first == (2**62 + 5, 2**62 + 5)
    assert again[0] == again[1] != first[0] and 0 <= again[0] < 2**63
    assert dmgr.current_room(2**62 + 5) == again[1]


def test_private_metadata_rows_travel_with_the_send_and_land_before_success() -> None:
    """SGLang's CPU MetadataBuffers are private memory: the sender reads the room's row (SGLang
    wrote it with set_buf before the last chunk) and hands it with the send; the receiver writes
    the row the agent hands back into its own buffers before it says Success, so SGLang's decode
    reads the first token where it always does."""
    from pdfabric_sglang.conn import PdfabricKVReceiver, PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    pre = manager(Role.PREFILL)
    pre._aux_buffers[0][2] = np.arange(64, dtype=np.uint8)
    pre._aux_buffers[1][2] = 7
    tx = PdfabricKVSender(pre, "p:1", 21)
    pre.client.views[21] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D]}
    assert tx.poll() == KVPoll.WaitingForInput
    tx.init(1, 2)
    tx.send(np.array([3], np.int32))
    (msg,) = pre.client.submitted
    assert msg.aux_rows == (bytes(range(64)), bytes([7] * 32))
    assert SendRequest.parse(msg.to_json()).aux_rows == msg.aux_rows  # base64 on the wire

    dec = manager(Role.DECODE)
    rx = PdfabricKVReceiver(dec, "p:1", 21)
    rx.init(0)
    rx.send_metadata(np.array([1], np.int32), 3, None)
    dec.client.views[21] = {"state": "Transferring", "code": 3}
    assert rx.poll() == KVPoll.Transferring and not dec._aux_buffers[0].any()
    landed = RoomView(rank=D, room=21, state=RoomState.SUCCESS, aux_rows=msg.aux_rows).to_json()
    dec.client.views[21] = {k: v for k, v in landed.items() if k not in ("rank", "room")}
    assert rx.poll() == KVPoll.Success
    assert bytes(dec._aux_buffers[0][3]) == bytes(range(64)) and bytes(dec._aux_buffers[1][3]) == bytes([7] * 32)
    assert not dec._aux_buffers[0][2].any()  # only the room's own row


def test_an_aux_row_that_does_not_fit_the_receivers_buffers_fails_the_room() -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll

    dec = manager(Role.DECODE)
    rx = PdfabricKVReceiver(dec, "p:1", 22)
    rx.init(0)
    rx.send_metadata(np.array([1], np.int32), 0, None)
    short = RoomView(rank=D, room=22, state=RoomState.SUCCESS, aux_rows=(b"x" * 64, b"y" * 16)).to_json()
    dec.client.views[22] = {k: v for k, v in short.items() if k not in ("rank", "room")}
    assert rx.poll() == KVPoll.Failed and "does not fit this engine's metadata buffers" in rx.reason
    assert not dec._aux_buffers[1].any()


def test_the_manager_registers_sglangs_metadata_rows_inline_unless_they_are_on_the_gpu(tmp_path: Path) -> None:
    """SGLang's own rule: MetadataBuffers are on the GPU only with SGLANG_MOONCAKE_CUSTOM_MEM_POOL
    = INTRA_NODE_NVLINK; otherwise private CPU memory, registered as rows that travel inline."""
    from pdfabric_sglang.kvargs import metadata_on_gpu, registration

    assert metadata_on_gpu({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"})
    assert not metadata_on_gpu({}) and not metadata_on_gpu({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK"})
    bufs = manager(Role.PREFILL)._aux_buffers
    kv = np.zeros((2, 4, 256), np.uint8)  # private too: refused as KV, which must be mapped
    args = SimpleNamespace(
        kv_data_ptrs=[], kv_data_lens=[], kv_item_lens=[], page_size=16, engine_rank=0,
        aux_data_ptrs=[b.ctypes.data for b in bufs], aux_data_lens=[b.nbytes for b in bufs],
        aux_item_lens=[b[0].nbytes for b in bufs],
    )  # fmt: skip
    with pytest.raises(ValueError, match="KV buffers"):
        registration(P, args, is_mla=False, gpu=None, aux_inline=True)
    args.kv_data_ptrs = [kv[0].ctypes.data, kv[1].ctypes.data]
    args.kv_data_lens, args.kv_item_lens = [kv[0].nbytes] * 2, [256] * 2
    with pytest.raises(ValueError, match="private memory"):  # KV is never inline
        registration(P, args, is_mla=False, gpu=None, aux_inline=True)
    pool = tmp_path / "kv"  # the KV pool in a shared-memory file, as client.shm allocates it
    pool.write_bytes(bytes(2 * 4 * 256))
    with open(pool, "r+b") as fh, mmap.mmap(fh.fileno(), 2 * 4 * 256) as mem:
        shared = np.frombuffer(mem, np.uint8).reshape(2, 4, 256)
        args.kv_data_ptrs = [shared[0].ctypes.data, shared[1].ctypes.data]
        reg = registration(P, args, is_mla=False, gpu=None, aux_inline=True)
        del shared
    assert (reg.aux, reg.aux_slots, reg.aux_row_bytes, reg.aux_inline) == ([], 4, [64, 32], True)
    assert [k.path for k in (*reg.k, *reg.v)] == [str(pool)] * 2
    assert type(reg).parse(reg.to_json()) == reg


def test_the_scheduler_thread_never_waits_on_the_agent() -> None:
    """A submit goes on the rank's worker thread: ``send`` returns while the agent has not
    answered, polls say WaitingForInput meanwhile, and then read the room table the agent's feed
    keeps (here filled by hand, as the feed's thread would) without a request to the agent; an
    abort made after the submit reaches the agent after it, in order."""
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdfabric_agent.client.feed import RoomEvents

    mgr = manager(Role.PREFILL)
    mgr.calls = AgentCalls("test-calls")
    events = RoomEvents("127.0.0.1:1", "t", P)  # not started: the test is its feed
    events.synced.set()
    mgr.events = events
    agent_answers = threading.Event()
    calls: list[str] = []
    real_submit = mgr.client.submit

    def slow_submit(msg: Any) -> RoomView:
        agent_answers.wait(5)
        calls.append("submit")
        return real_submit(msg)

    def slow_begin(msg: Any) -> Callable[[], RoomView]:
        written.append(threading.current_thread().name)  # the request leaves from the caller's thread
        return lambda: slow_submit(msg)  # its answer is read on the worker

    written: list[str] = []
    mgr.client.submit = slow_submit  # type: ignore[method-assign]
    mgr.client.begin_submit = slow_begin  # type: ignore[method-assign]
    real_abort = mgr.client.abort
    mgr.client.abort = lambda *a, **k: (calls.append("abort"), real_abort(*a, **k))[1]  # type: ignore[method-assign]
    mgr.client.poll = lambda *a, **k: pytest.fail("a poll asked the agent while the feed keeps the table")  # type: ignore[method-assign]
    try:
        tx = PdfabricKVSender(mgr, "p:1", 31)
        events.put(RoomView(rank=P, room=31, state=RoomState.WAITING_FOR_INPUT, decode_ranks_ready=(D,)))
        assert tx.poll() == KVPoll.WaitingForInput
        tx.init(1, None)
        started = time.monotonic()
        tx.send(np.array([7], np.int32))
        assert time.monotonic() - started < 0.5 and calls == []  # send did not wait for the agent
        assert written == [threading.current_thread().name] and mgr.calls.written_now == 1  # no worker wake-up first
        assert tx.poll() == KVPoll.WaitingForInput and tx.submit_pending
        agent_answers.set()
        assert mgr.calls.wait_idle(5) and calls == ["submit"]
        assert tx.poll() == KVPoll.WaitingForInput  # the answer (Bootstrapping: decode info due) is in progress
        events.put(RoomView(rank=P, room=31, state=RoomState.SUCCESS, moved={"kv": 128, "state": 0, "aux": 0}))
        assert tx.poll() == KVPoll.Success and tx.bytes_moved == 128
        tx2 = PdfabricKVSender(mgr, "p:1", 32)
        events.put(RoomView(rank=P, room=32, state=RoomState.WAITING_FOR_INPUT, decode_ranks_ready=(D,)))
        tx2.poll()
        tx2.init(1, None)
        tx2.send(np.array([8], np.int32))
        tx2.abort()
        assert mgr.calls.wait_idle(5) and calls == ["submit", "submit", "abort"]
        assert mgr.calls.written_now == 2  # tx2's submit too: nothing was ahead of it
        tx.clear()
        assert events.view(31) is None  # SGLang is done with it: its row goes
    finally:
        mgr.calls.close()


def test_a_submit_the_agent_refuses_fails_the_room_at_the_next_poll() -> None:
    from pdfabric_sglang.conn import PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.DECODE)
    mgr.calls = AgentCalls("test-calls")
    mgr.client.submit_error = AgentRefused(409, "conflict", "room 33 is already Transferring on decode-0-tp0")
    try:
        rx = PdfabricKVReceiver(mgr, "p:1", 33)
        rx.init(0)
        rx.send_metadata(np.array([1], np.int32), 0, None)
        assert mgr.calls.wait_idle(5)
        assert rx.poll() == KVPoll.Failed and "did not take the receive" in rx.reason and "409" in rx.reason
    finally:
        mgr.calls.close()


def test_a_senders_transfer_latency_starts_at_the_first_byte_moved() -> None:
    """SGLang's KVTransferMetric: the sender's latency runs from the agent's start of the room (its
    ``transferring`` phase, on the node's monotonic clock), not from the first chunk handed over,
    so prefill compute between chunks is not counted as transfer."""
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 41)
    mgr.client.views[41] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D]}
    tx.poll()
    tx.init(1, None)
    tx.send(np.array([3], np.int32))
    tx.submitted_at = time.monotonic() - 5.0  # the first chunk, 5 s of prefill compute ago
    agent_start = time.monotonic() - 1.0  # the room's submit at the agent
    mgr.client.views[41] = {"state": "Success", "code": 4, "bytes": {"kv": 64}, "submitted_at": agent_start,
                            "phases_s": {"transferring": 0.75}}  # fmt: skip
    assert tx.poll() == KVPoll.Success
    latency = tx.get_transfer_metric().transfer_latency_s
    assert latency is not None and 0.2 <= latency < 1.0  # from the first byte (0.25 s ago), not 5 s


def test_a_senders_chunks_go_to_the_agent_as_sglang_sends_them() -> None:
    """Issue 23: each chunk is handed over when SGLang sends it (``SendChunk``: in order, the
    next ``page_offset``, state and aux row with the last); chunks before this rank saw decode's
    announcement go together with the next poll; an early cached-prefix chunk waits for SGLang's
    ``_early_send_wait_event`` (the forward writing its pages) before it is handed over."""
    from pdfabric_sglang.conn import PdfabricKVSender
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdfabric_agent.protocol.chunks import SendChunk

    mgr = manager(Role.PREFILL)
    tx = PdfabricKVSender(mgr, "p:1", 17)
    tx.init(7, 1)
    tx.send(np.array([9, 8], np.int32))  # before decode's announcement reached this rank: kept
    tx.send(np.array([7], np.int32))
    assert mgr.client.submitted == []
    mgr.client.views[17] = {"state": "WaitingForInput", "code": 2, "decode_ranks_ready": [D]}
    assert tx.poll() == KVPoll.WaitingForInput  # both chunks go as one
    order: list[str] = []

    class Forward:
        def synchronize(self) -> None:
            order.append(f"forward done before chunk {len(mgr.client.submitted) + 1}")

    tx._early_send_wait_event = Forward()
    tx.send(np.array([6, 5], np.int32))
    tx.send(np.array([4, 3], np.int32), [np.array([2], np.int32)])
    got = [(m.page_offset, m.kv_pages, m.final, m.state_indices, m.aux_index) for m in mgr.client.submitted]
    assert got == [(0, [9, 8, 7], False, [], None), (3, [6, 5], False, [], None), (5, [4, 3], True, [2], 1)]
    assert all(isinstance(m, SendChunk) for m in mgr.client.submitted)
    assert mgr.client.submitted[-1].aux_rows and not mgr.client.submitted[0].aux_rows  # the row with the last
    assert order == ["forward done before chunk 2"]  # only the cached-prefix chunk waits
    tx.send(np.array([], np.int32))  # nothing after the last chunk
    assert len(mgr.client.submitted) == 3
    assert len(tx.handed_at) == 5
