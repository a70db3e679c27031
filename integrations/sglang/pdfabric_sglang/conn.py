"""SGLang's transfer-backend contract on the node agent: the whole surface SGLang 0.5.23's scheduler
uses (``prefill.py``, ``decode.py``, ``utils.py``), not just what ``base/conn.py`` declares.

- ``PdfabricKVManager``: one per engine rank. Registers the rank's ``KVArgs`` buffers with the
  agent (``/v1/memory``), which checks them against the PDCluster's model and moves that rank's
  rooms in them from then on. The rendezvous is the PDCluster's rank map, not a bootstrap table;
  decode's ``prefill_info_table`` holds, per prefill bootstrap address, which prefill replica it is
  (``peers.PrefillPeers``, looked up off the scheduler thread).
- ``PdfabricKVSender`` (prefill): SGLang's bootstrap room is the agent's room id (a room SGLang
  opens again, rebootstrap, is a fresh agent room the same on both sides: ``open_room``). ``poll`` reports
  Bootstrapping until the decode side announced the room to the agent, WaitingForInput once every
  decode rank did (the agent names them, so the sender learns the decode replica the router chose),
  then the agent's state of the room. ``send`` takes chunks; the room is submitted with the last
  one (the agent moves a room's pages in one plan).
- ``PdfabricKVReceiver`` (decode): ``init`` takes the prefill replica from the manager's table,
  ``send_metadata`` submits the room's destination pages, aux row and state slots.
- ``PdfabricKVBootstrapServer`` (prefill): tells decode which replica this is; ``/health`` for
  decode's heartbeat.

Every agent call is guarded: an agent that refuses, is down or restarting fails the request with
the reason (``KVTransferError``), never the server. A failure SGLang learns from another rank
through its all-reduce is raised with ``is_from_another_rank``, and this rank's room is aborted at
the agent. Deferred decode KV release (on by default in SGLang) is answered from the agent's own
knowledge of the room: its pages are released once every source's writes are over.

Both sides fill SGLang's ``KVTransferMetric``: latency from the first chunk handed to the backend
(sender) or the metadata submit (receiver) to the agent's confirmed completion, and the bytes the
agent counted for the room, once each (skipped CP state is not counted).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError

from pdfabric_agent.client.api import AgentClient, AgentRefused
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.views import MemoryAnswer, RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_sglang.bootstrap import PdfabricKVBootstrapServer
from pdfabric_sglang.kvargs import (
    ENV_CP_RANK,
    ENV_RANK,
    ENV_REPLICA,
    AttentionRanks,
    FabricConfig,
    gpu_of,
    rank_id_for,
    registration,
)
from pdfabric_sglang.peers import PrefillPeer, PrefillPeers, post_generate
from pdfabric_sglang.shares import UnshareableBuffer

__all__ = ["PdfabricKVBootstrapServer", "PdfabricKVManager", "PdfabricKVReceiver", "PdfabricKVSender"]

log = logging.getLogger("pdfabric.sglang")

# SGLang's KVPoll codes as typed ints (SGLang ships no type information).
FAILED: int = int(KVPoll.Failed)
BOOTSTRAPPING: int = int(KVPoll.Bootstrapping)
WAITING_FOR_INPUT: int = int(KVPoll.WaitingForInput)
SUCCESS: int = int(KVPoll.Success)
# A poll, submit or abort on the scheduler thread waits at most this long for the agent (it answers
# in milliseconds; a hung agent must not stall the server's loop for the client's default 10 s).
AGENT_CALL_TIMEOUT_S = 2.0
AGENT_ERRORS = (AgentRefused, OSError, ValueError)  # refused; down, restarting or timed out; garbled
MEMORY_NOT_REGISTERED = Refusal.MEMORY_NOT_REGISTERED.value


class PdfabricKVManager(BaseKVManager):
    # Failed decode rooms keep their pages until the agent says every source's writes are over.
    enable_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(
        self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False
    ) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.role = Role(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.config = FabricConfig()
        info_client = AgentClient(self.config.address, self.config.token, "")
        info = info_client.info()
        info_client.close()
        self.cluster_uid = info["cluster"]["uid"]
        self.client = AgentClient(self.config.address, self.config.token, self.cluster_uid, AGENT_CALL_TIMEOUT_S)
        self.rank_id = rank_id_for(self.role, self.config, args, attention_ranks())
        if self.rank_id not in info["ranks"]:
            raise RuntimeError(
                f"pdfabric: agent {info['agent']} does not serve rank {self.rank_id} "
                f"(it serves {sorted(info['ranks'])}); check {ENV_REPLICA}/{ENV_CP_RANK} or set {ENV_RANK}"
            )
        self.bootstrap_timeout_s = self.config.bootstrap_timeout_s
        try:
            self.registration = registration(self.rank_id, args, is_mla=bool(is_mla_backend), gpu=gpu_of(args))
            answer = self.register()
        except (UnshareableBuffer, AgentRefused) as exc:
            raise RuntimeError(f"pdfabric: the buffers of {self.rank_id} cannot be registered: {exc}") from None
        self.layout = answer.layout
        # Decode: prefill bootstrap address -> which prefill replica serves there (SGLang's decode
        # queue reads dp_size and follow_bootstrap_room from it for every request).
        self.peers = PrefillPeers(self.cluster_uid)
        self.prefill_info_table: dict[str, PrefillPeer] = self.peers.table
        self._room_openings: OrderedDict[int, int] = OrderedDict()  # bootstrap room -> openings - 1
        self._recompute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdfabric-recompute")
        log.info("pdfabric: %s registered %d buffers with agent %s", self.rank_id, answer.buffers, info["agent"])

    def register(self) -> MemoryAnswer:
        """Register this rank's buffers with the agent. A restarted engine finds the rank still
        busy with its previous process's rooms (409) until they end (at most the PDCluster's
        transfer timeout): it waits for them, up to the bootstrap timeout."""
        deadline = time.monotonic() + self.bootstrap_timeout_s
        while True:
            try:
                return self.client.register_memory(self.registration)
            except AgentRefused as exc:
                if exc.status != 409 or time.monotonic() > deadline:
                    raise
                log.info("pdfabric: %s waits for its previous rooms to end: %s", self.rank_id, exc)
                time.sleep(1.0)

    def submit(self, msg: SendRequest | ReceiveRequest) -> None:
        """Hand a room to the agent; an agent that restarted since this engine registered (it
        lost the registration and says so) gets the buffers again, then the room."""
        try:
            self.client.submit(msg)
        except AgentRefused as exc:
            if exc.reason != MEMORY_NOT_REGISTERED:
                raise
            log.warning(
                "pdfabric: agent %s lost %s's memory (restarted); registering again", self.config.address, self.rank_id
            )
            self.client.register_memory(self.registration)
            self.client.submit(msg)

    def register_to_bootstrap(self) -> None:
        """Nothing to register: the PDCluster's rank map tells every agent where each rank is."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill behind ``bootstrap_addr`` is known; starts the lookup (off the
        scheduler thread) when it is not. SGLang's decode queue calls it until True."""
        return self.peers.ensure(bootstrap_addr)

    def open_room(self, bootstrap_room: int) -> int:
        """The agent's room id for a sender or receiver of SGLang's ``bootstrap_room``. The agent's
        rooms are single-use; SGLang opens a room again when decode re-receives a retracted request
        (rebootstrap: the same bootstrap room, its prefill recomputed). Each side counts the times
        it opened the room, so the n-th opening is the same fresh agent room on both sides."""
        opened = self._room_openings.pop(bootstrap_room, -1) + 1
        self._room_openings[bootstrap_room] = opened
        while len(self._room_openings) > REMEMBERED_ROOMS:
            self._room_openings.popitem(last=False)
        return reopened_room(bootstrap_room, opened)

    def current_room(self, bootstrap_room: int) -> int:
        """The agent room of the latest opening of ``bootstrap_room``."""
        return reopened_room(bootstrap_room, self._room_openings.get(bootstrap_room, 0))

    def submit_prefill_recompute(self, receiver: PdfabricKVReceiver, payload: dict[str, Any]) -> None:
        """Rebootstrap: decode re-receives a retracted request, so its prefill must compute the
        prefix again and send it to the receiver's fresh room (``open_room``). SGLang's decode ranks
        all call this; one of them (attention TP 0, CP 0, PP stage 0) posts the request to the
        prefill server's ``/generate`` (its port from the bootstrap server), off the scheduler's
        thread. A post that fails fails the receiver with the reason."""
        attention = attention_ranks()
        if (attention is not None and (attention.tp_rank, attention.cp_rank) != (0, 0)) or int(
            getattr(self.kv_args, "pp_rank", 0) or 0
        ):
            return
        peer = self.peers.table.get(receiver.bootstrap_addr)
        if peer is None or peer.http_port is None:
            receiver.fail(f"rebootstrap: the prefill behind {receiver.bootstrap_addr} named no HTTP port")
            return
        host = receiver.bootstrap_addr.rsplit(":", 1)[0]
        url = f"http://{host}:{peer.http_port}/generate"

        def post() -> None:
            status, answer = post_generate(url, payload, self.bootstrap_timeout_s)
            if status != 200:
                receiver.fail(f"rebootstrap: {url} answered {status or 'nothing'}: {answer[:200]}")

        self._recompute.submit(post)

    # Deferred decode KV release: the agent knows when a failed room's sources are quiet.
    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        try:
            view = self.client.poll(self.rank_id, self.current_room(int(bootstrap_room)))
        except AgentRefused as exc:
            return exc.status == 404  # the agent never took the room: nothing can write into it
        except (OSError, ValueError):
            return False  # unknown: SGLang releases at its deadline
        return view.succeeded if view.sources_quiet is None else view.sources_quiet

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing kept per room here: the agent's room holds the state."""


class _RoomClient:
    """What sender and receiver share: a room of the manager's rank, its outcome and metric."""

    def __init__(self, mgr: PdfabricKVManager, bootstrap_room: int | None) -> None:
        self.kv_mgr = mgr  # SGLang's name: its queues read kv_mgr off senders and receivers
        self.bootstrap_room = int(bootstrap_room or 0)
        self.room = mgr.open_room(self.bootstrap_room)  # the agent's room: a fresh one if reopened
        self.submitted_at: float | None = None
        self.finished_at: float | None = None
        self.concluded: int | None = None  # a KVPoll value once final
        self.reason = ""
        self.bytes_moved: int | None = None
        self.created = time.monotonic()

    @property
    def mgr(self) -> PdfabricKVManager:
        return self.kv_mgr

    def _conclude(self, state: int, reason: str = "") -> int:
        if self.concluded is None:
            self.concluded, self.reason = state, reason
            self.finished_at = time.monotonic()
            if state == FAILED:
                log.warning("pdfabric: room %d on %s failed: %s", self.room, self.mgr.rank_id, reason)
        return self.concluded

    def _final(self) -> int | None:
        return self.concluded

    def fail(self, reason: str) -> None:
        """Conclude Failed and tell the agent (a room it took fails at once, its peers are told)."""
        self._abort_at_agent(reason)
        self._conclude(FAILED, reason)

    def _agent_holds_room(self) -> bool:
        """Whether the agent has something of this room to give up (senders and receivers say
        more: an abort before the submit reaches the other side too)."""
        return self.submitted_at is not None

    def _peer_to_tell(self) -> int | None:
        """For a room not submitted yet: the peer replica the agent tells of the abort."""
        return None

    def _abort_at_agent(self, reason: str) -> None:
        if not self._agent_holds_room() or self.concluded is not None:
            return
        try:
            self.mgr.client.abort(self.mgr.rank_id, self.room, reason, self._peer_to_tell())
        except AGENT_ERRORS as exc:
            log.warning("pdfabric: abort of room %d at the agent: %s", self.room, exc)

    def _view(self) -> RoomView | None:
        """The agent's view of the room; None when it has none yet (404). Concludes Failed when the
        agent cannot be asked."""
        try:
            return self.mgr.client.poll(self.mgr.rank_id, self.room)
        except AgentRefused as exc:
            if exc.status == 404:
                return None
            self._conclude(FAILED, f"agent refused the poll: {exc}")
        except (OSError, ValueError) as exc:
            self._conclude(FAILED, f"agent {self.mgr.config.address} unreachable: {exc}")
        return None

    def _agent_state(self) -> int:
        """The submitted room's state at the agent (its codes are SGLang's KVPoll values)."""
        view = self._view()
        if self.concluded is not None:
            return self.concluded
        if view is None:  # a submitted room the agent no longer knows: it restarted
            return self._conclude(FAILED, "the agent lost the room (restarted?)")
        if view.finished:
            if view.succeeded:
                self.bytes_moved = sum(view.moved.values())
            return self._conclude(int(view.state), view.reason)
        return int(view.state)

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.submitted_at is not None and self.finished_at is not None and self.concluded == SUCCESS:
            latency = self.finished_at - self.submitted_at
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes_moved)

    def failure_exception(self) -> None:
        if self.concluded != FAILED:
            # SGLang's all-reduce took the MIN over its ranks: another rank failed this request.
            self.fail("failed on another rank of this request")
            raise KVTransferError(
                self.bootstrap_room, f"pdfabric room {self.room} failed on another rank", is_from_another_rank=True
            )
        raise KVTransferError(
            self.bootstrap_room, f"pdfabric room {self.room} on {self.mgr.rank_id} failed: {self.reason}"
        )

    def abort(self) -> None:
        self.fail("aborted by SGLang")

    def clear(self) -> None:
        """SGLang is done with the request: nothing held here (the agent's room is final)."""


class PdfabricKVSender(_RoomClient, BaseKVSender):
    def __init__(
        self,
        mgr: PdfabricKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        _RoomClient.__init__(self, mgr, bootstrap_room)
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []
        self.decode_replica: int | None = None
        self.decode_prefix_len = 0
        self.first_chunk_at = 0.0
        self.last_state_slots: list[int] | None = None  # set with the last chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def _agent_holds_room(self) -> bool:
        # Submitted or not: the agent holds what decode announced for the room (or will, and must
        # then refuse it), so a request SGLang aborts before its last chunk fails at decode now,
        # not at decode's deadline.
        return True

    def pop_decode_prefix_len(self) -> int:
        """Tokens decode already holds (its radix cache): prefill sends the pages after them."""
        n, self.decode_prefix_len = self.decode_prefix_len, 0
        return n

    def poll(self) -> int:
        if self.concluded is not None:
            return self.concluded
        if self.submitted_at is not None:
            return self._agent_state()
        state = self._bootstrap_state()
        if state == WAITING_FOR_INPUT and self.last_state_slots is not None:
            self._submit()  # the last chunk came before this rank saw decode's announcement
            return self.concluded if self.concluded is not None else WAITING_FOR_INPUT
        return state

    def _bootstrap_state(self) -> int:
        """Before the room is submitted: Bootstrapping until decode announced it to the agent,
        then WaitingForInput (and which decode replica takes it)."""
        view = self._view()
        if (done := self._final()) is not None:  # the agent could not be asked
            return done
        if view is not None:
            if view.state is RoomState.FAILED:  # decode gave the room up before we sent
                return self._conclude(FAILED, view.reason or "the decode side failed the room")
            if view.sends is False:  # this rank moves nothing (replicated heads, a quiet CP rank)
                self.decode_replica = 0  # any: the agent concludes the room at once, to no decode rank
                return WAITING_FOR_INPUT
            if view.decode_ranks_ready:
                self.decode_replica = replica_of(view.decode_ranks_ready[0])
                self.decode_prefix_len = view.decode_prefix_tokens or 0
                if view.state is RoomState.WAITING_FOR_INPUT:
                    return WAITING_FOR_INPUT
        if time.monotonic() - self.created > self.mgr.bootstrap_timeout_s:
            return self._conclude(FAILED, f"decode did not announce the room within {self.mgr.bootstrap_timeout_s:g} s")
        return BOOTSTRAPPING

    def poll_pp_consensus(self) -> int:
        """PP stage 0's poll, which SGLang spreads to the other stages; every stage's agent room
        follows the same decode announcement, so this stage's own poll is the same answer."""
        return self.poll()

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        if self.concluded is not None:
            return
        if self.submitted_at is None and not self.pages:
            self.first_chunk_at = time.monotonic()
        self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
        if self.num_pages is None or len(self.pages) < self.num_pages:
            return  # not the last chunk: the room goes with it
        self.last_state_slots = (
            [int(s) for s in np.asarray(state_indices[0]).reshape(-1)]
            if state_indices and state_indices[0] is not None
            else []
        )
        # SGLang may send before this rank saw decode's announcement itself: a PP stage after the
        # first follows stage 0's poll, and a TP or CP rank follows the all-reduced poll. Ask the
        # agent now; if decode's word has not reached this rank's room yet, poll submits it.
        if self.decode_replica is not None or self._bootstrap_state() == WAITING_FOR_INPUT:
            self._submit()

    def _submit(self) -> None:
        assert self.decode_replica is not None and self.last_state_slots is not None
        msg = SendRequest(
            self.mgr.rank_id,
            self.room,
            self.pages,
            self.last_state_slots,
            self.aux_index,
            self.decode_replica,
            engine_memory=True,
        )
        try:
            self.mgr.submit(msg)
        except AGENT_ERRORS as exc:
            self._conclude(FAILED, f"the agent did not take the send: {exc}")
            return
        self.submitted_at = self.first_chunk_at

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still submits the room


REMEMBERED_ROOMS = 1 << 16  # bootstrap rooms whose openings a manager counts (rebootstrap comes soon after)
_ROOM_STRIDE = 0x9E3779B97F4A7C15  # odd: successive openings of one room land far apart


def reopened_room(bootstrap_room: int, opened: int) -> int:
    """The agent room of the ``opened``-th reopening of a bootstrap room (0: the room itself)."""
    return bootstrap_room if opened == 0 else (bootstrap_room + opened * _ROOM_STRIDE) % (1 << 63)


def attention_ranks() -> AttentionRanks | None:
    """This scheduler rank's attention TP and CP ranks from SGLang's parallel state; None where
    SGLang has published none (an engine that is not SGLang's scheduler)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return AttentionRanks(int(parallel.attn_tp_rank), int(parallel.attn_cp_rank), int(parallel.attn_cp_size))
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


def replica_of(rank_id: str) -> int:
    """The replica in a rank id (``decode-<replica>-tp<n>``)."""
    return Rank.from_id(rank_id).replica


class PdfabricKVReceiver(_RoomClient, BaseKVReceiver):
    def __init__(
        self, mgr: PdfabricKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any
    ) -> None:
        _RoomClient.__init__(self, mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_replica: int | None = None
        self.inited = False
        # Deferred decode KV release: SGLang counts the prefill sources it awaits (one agent room)
        # and holds a failed room's pages while abort_notified.
        self.bootstrap_infos: list[PrefillPeer] = []
        self.abort_notified = False
        self.require_staging = False

    def init(self, prefill_dp_rank: int = 0) -> None:
        self.inited = True
        self._resolve()

    def abort(self) -> None:
        if self.submitted_at is None and self.prefill_replica is None and self.concluded is None:
            # SGLang may abort before init (the prefill table still being filled): the prefill side
            # waits for this room all the same, so find out which replica it is, briefly.
            self.mgr.peers.wait(self.bootstrap_addr, AGENT_CALL_TIMEOUT_S)
            self._resolve()
        super().abort()

    def _agent_holds_room(self) -> bool:
        # Before send_metadata the prefill side may already wait for this room: its agents are told
        # (through this rank's agent), so its request fails now, not at its bootstrap deadline.
        return self.submitted_at is not None or self.prefill_replica is not None

    def _peer_to_tell(self) -> int | None:
        return self.prefill_replica if self.submitted_at is None else None

    def _resolve(self) -> None:
        """The prefill replica behind the bootstrap address, from the manager's table (SGLang's
        decode queue calls ``init`` once the table has it; other callers wait in ``poll``)."""
        peers = self.mgr.peers
        if peers.ensure(self.bootstrap_addr):
            peer = peers.table[self.bootstrap_addr]
            self.prefill_replica = peer.replica
            self.bootstrap_infos = [peer]
            return
        error = peers.error(self.bootstrap_addr)
        if error is not None and not error.retryable:  # another PDCluster's prefill: no retry helps
            self._conclude(FAILED, f"prefill bootstrap {self.bootstrap_addr}: {error}")
        elif time.monotonic() - self.created > self.mgr.bootstrap_timeout_s:
            self._conclude(FAILED, f"prefill bootstrap {self.bootstrap_addr} unreachable: {error}")

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        **_: Any,
    ) -> None:
        if self.concluded is not None or self.prefill_replica is None:
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        state = (
            [int(s) for s in np.asarray(state_indices[0]).reshape(-1)]
            if state_indices and state_indices[0] is not None
            else []
        )
        # With SGLang's decode radix cache, ``kv_indices`` are the pages after the prefix decode
        # holds; the prefill learns the prefix from the agent and sends from there.
        msg = ReceiveRequest(
            self.mgr.rank_id,
            self.room,
            pages,
            state,
            aux_index,
            self.prefill_replica,
            engine_memory=True,
            prefix_tokens=int(decode_prefix_len or 0),
        )
        self.submitted_at = time.monotonic()
        try:
            self.mgr.submit(msg)
        except AGENT_ERRORS as exc:
            self._conclude(FAILED, f"the agent did not take the receive: {exc}")

    def poll(self) -> int:
        if self.concluded is not None:
            return self.concluded
        if self.prefill_replica is None:
            if self.inited:
                self._resolve()
            return self.concluded if self.concluded is not None else BOOTSTRAPPING
        if self.submitted_at is None:
            return WAITING_FOR_INPUT
        return self._agent_state()

    @property
    def conclude_state(self) -> int | None:
        """What SGLang's decode reads after ``init``: the receiver's outcome, once it has one."""
        return self.concluded

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The agent fails the room and tells its sources; its pages wait for them to be quiet."""
        if self.submitted_at is not None:
            self._abort_at_agent("decode released the request")
            self.abort_notified = True
