"""The connector's worker side: one per vLLM worker process (a TP rank), which is one pdfabric
engine rank. It registers the rank's KV cache with its node's agent (``memory``), follows the
rank's rooms on the agent's room feed, and acts on the scheduler's orders without ever waiting on
the agent in vLLM's step: submits and aborts go on a worker thread (``AgentCalls``, in order);
``get_finished``, which vLLM calls every step, reads the feed's table.

A prefill room is sent once the decode ranks announced it (the agent's view names them and the
prefix they hold); until then its pages stay held, at most the bootstrap timeout. A decode room
ends Success (``finished_recving``) or Failed: its pages are then load errors, and vLLM's
``kv_load_failure_policy`` decides."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.client.api import AgentClient, AgentRefused
from pdfabric_agent.client.calls import SUBMIT_TIMEOUT_S, AgentCalls
from pdfabric_agent.client.engine_env import FabricConfig, engine_instance
from pdfabric_agent.client.feed import RoomEvents
from pdfabric_agent.client.shares import UnshareableBuffer
from pdfabric_agent.protocol.labels import Refusal
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import MemoryAnswer, RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank
from pdfabric_vllm import stats
from pdfabric_vllm.memory import registration
from pdfabric_vllm.orders import Orders, ReceiveOrder, SendOrder

log = logging.getLogger("pdfabric.vllm")

AGENT_CALL_TIMEOUT_S = 2.0  # a poll from vLLM's step (the feed down): a hung agent must not hold the step
AGENT_ERRORS = (AgentRefused, OSError, ValueError)
FEED_WAIT_S = 2.0
REGISTER_WAIT_S = 30.0  # a restarted engine waits this long for its previous process's rooms to end
# In a step that computes nothing, how long ``finished`` waits for a room's news: vLLM steps such
# an engine again at once (its 1 ms pause aside), and two servers doing so kept both cores busy,
# the agents' own work queued behind them (a room's end was seen 250-500 ms late now and then).
IDLE_WAIT_S = 0.005


@dataclass
class Send:
    order: SendOrder
    since: float = field(default_factory=time.monotonic)
    submitted: bool = False
    refused: str = ""
    aborted: bool = False


@dataclass
class Receive:
    order: ReceiveOrder
    since: float = field(default_factory=time.monotonic)
    aborted: bool = False
    refused: str = ""


class WorkerSide:
    def __init__(self, role: Role, tp_rank: int, dp: int, *, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.config = FabricConfig(env)
        info = AgentClient(self.config.address, self.config.token, "").info()
        self.cluster_uid = info.cluster_uid
        self.rank_id = self.config.rank or Rank(role, self.config.replica, tp_rank, dp_rank=dp).rank_id
        info.rank(self.rank_id, f"the agent at {self.config.address}: set PDFABRIC_REPLICA or PDFABRIC_RANK")
        self.client = AgentClient(self.config.address, self.config.token, self.cluster_uid, AGENT_CALL_TIMEOUT_S)
        self.calls_client = AgentClient(
            self.config.address, self.config.token, self.cluster_uid, SUBMIT_TIMEOUT_S, shared=True
        )
        self.calls = AgentCalls(f"pdfabric-calls-{self.rank_id}")
        self.instance = engine_instance()
        self.events: RoomEvents | None = None
        self.registration: MemoryRegistration | None = None
        self.sends: dict[int, Send] = {}
        self.receives: dict[int, Receive] = {}
        self._done_sending: set[str] = set()
        self._done_receiving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats = stats.empty()  # since vLLM last asked (get_kv_connector_stats)
        self._idle_step = False

    # ------------------------------------------------------------------ registration
    def register(self, kv_caches: dict[str, Any], gpu: int | None) -> MemoryAnswer:
        self.events = RoomEvents(self.config.address, self.config.token, self.rank_id, self.instance)
        self.events.start(wait_s=FEED_WAIT_S)
        try:
            reg = registration(self.rank_id, kv_caches, gpu)
            self.registration = MemoryRegistration(**{**reg.__dict__, "instance": self.instance})
            answer = self._register()
        except (UnshareableBuffer, AgentRefused) as exc:
            self.events.close()
            raise RuntimeError(f"pdfabric: the KV cache of {self.rank_id} cannot be registered: {exc}") from None
        log.info(
            "pdfabric: %s registered %d KV buffers with agent %s", self.rank_id, answer.buffers, self.config.address
        )
        return answer

    def _register(self) -> MemoryAnswer:
        assert self.registration is not None
        started = time.monotonic()
        while True:
            try:
                return self.client.register_memory(self.registration)
            except AgentRefused as exc:
                if exc.status != 409 or time.monotonic() - started > REGISTER_WAIT_S:
                    raise
                log.info("pdfabric: %s waits for its previous engine to go: %s", self.rank_id, exc)
                time.sleep(1.0)

    # ------------------------------------------------------------------ orders
    def take(self, orders: Orders) -> None:
        self._idle_step = orders.idle
        for send in orders.sends:
            self.sends[send.room] = Send(send)
        for recv in orders.receives:
            self._receive(recv)
        for release in orders.releases:
            self._abort(release.room, release.reason, (release.prefill_replica, release.prefill_dp))
        for abort in orders.aborts:
            pending = self.receives.get(abort.room)
            if pending is not None and not pending.aborted:
                pending.aborted = True
                self._abort(abort.room, "the request was aborted", None)

    def _receive(self, order: ReceiveOrder) -> None:
        pending = self.receives[order.room] = Receive(order)
        msg = ReceiveRequest(
            self.rank_id,
            order.room,
            list(order.pages),
            [],
            None,
            order.prefill_replica,
            engine_memory=True,
            peer_dp=order.prefill_dp,
            prefix_tokens=order.prefix_tokens,
        )
        self._submit(msg, pending)

    def _send(self, pending: Send, view: RoomView) -> None:
        order = pending.order
        decode_replica, decode_dp = 0, 0
        if view.sends is not False and view.decode_ranks_ready:
            rank = Rank.from_id(view.decode_ranks_ready[0])
            decode_replica, decode_dp = rank.replica, rank.dp_rank
        skip = (view.decode_prefix_tokens or 0) // order.page_tokens
        msg = SendRequest(
            self.rank_id, order.room, list(order.pages[skip:]), [], None, decode_replica,
            engine_memory=True, peer_dp=decode_dp,
        )  # fmt: skip
        pending.submitted = True
        self._submit(msg, pending)

    def _submit(self, msg: SendRequest | ReceiveRequest, pending: Send | Receive) -> None:
        def call() -> None:
            try:
                view = self._submit_now(msg)
            except AGENT_ERRORS as exc:
                pending.refused = f"the agent did not take room {msg.room}: {exc}"
                return
            if self.events is not None:
                self.events.put(view)

        self.calls.call(call)

    def _submit_now(self, msg: SendRequest | ReceiveRequest) -> RoomView:
        try:
            return self.calls_client.submit(msg)
        except AgentRefused as exc:
            if exc.reason != Refusal.MEMORY_NOT_REGISTERED.value or self.registration is None:
                raise
            log.warning(
                "pdfabric: agent %s lost %s's memory (restarted); registering again", self.config.address, self.rank_id
            )
            self.calls_client.register_memory(self.registration)
            return self.calls_client.submit(msg)

    def _abort(self, room: int, reason: str, peer: tuple[int, int] | None) -> None:
        def call() -> None:
            try:
                self.calls_client.abort(self.rank_id, room, reason, *(peer or ()))
            except AGENT_ERRORS as exc:
                log.warning("pdfabric: abort of room %d at the agent: %s", room, exc)

        self.calls.call(call)

    # ------------------------------------------------------------------ progress
    def _view(self, room: int) -> RoomView | None:
        events = self.events
        if events is not None and events.synced.is_set():
            return events.view(room)
        try:
            return self.client.poll(self.rank_id, room)
        except AgentRefused as exc:
            if exc.status == 404:
                return None
            return RoomView(rank=self.rank_id, room=room, state=RoomState.FAILED, reason=str(exc))
        except (OSError, ValueError) as exc:
            log.debug("pdfabric: agent unreachable for room %d: %s", room, exc)
            return None

    def progress(self) -> None:
        """Hand over the sends whose decode announced itself; conclude what ended."""
        now = time.monotonic()
        for room, pending in list(self.sends.items()):
            if self._give_up_refused(room, pending):
                continue
            view = self._view(room)
            if pending.aborted:
                if (view is None and self._unknown(room)) or (view is not None and view.finished):
                    self._end_send(room, pending, pending.refused)
            elif view is not None and view.state is RoomState.FAILED:
                self._end_send(room, pending, view.reason or "failed")
            elif view is not None and pending.submitted and view.finished:
                self._end_send(room, pending, "", sum(view.moved.values()))
            elif not pending.submitted and view is not None and (view.decode_ranks_ready or view.sends is False):
                self._send(pending, view)
            elif not pending.submitted and now - pending.since > self.config.bootstrap_timeout_s:
                pending.refused = f"decode did not announce room {room} within {self.config.bootstrap_timeout_s:g} s"
        for room, recv in list(self.receives.items()):
            if self._give_up_refused(room, recv):
                continue
            view = self._view(room)
            if recv.aborted:
                if view is None and self._unknown(room):
                    self._end_receive(room, recv, recv.refused or "aborted")
                elif view is not None and view.finished and (view.succeeded or view.sources_quiet is not False):
                    self._end_receive(room, recv, recv.refused or view.reason or "aborted")
            elif view is None or not view.finished:
                continue
            elif not view.succeeded:
                if view.sources_quiet is not False:  # vLLM's again once no source writes into them
                    self._end_receive(room, recv, view.reason or "failed")
            else:
                self._end_receive(room, recv, "", sum(view.moved.values()))

    def _give_up_refused(self, room: int, pending: Send | Receive) -> bool:
        """A room whose submit went unanswered: the agent may have taken it all the same (an answer
        that timed out), so it is given up there, and its pages wait for the agent's word that
        nothing reads or writes them. True the step this happens."""
        if not pending.refused or pending.aborted:
            return False
        pending.aborted = True
        self._abort(room, pending.refused, None)
        return True

    def _unknown(self, room: int) -> bool:
        """Whether the agent says it has no such room (nothing can write into its pages)."""
        try:
            self.client.poll(self.rank_id, room)
        except AgentRefused as exc:
            return exc.status == 404
        except (OSError, ValueError):
            return True  # the agent is down: its transfer engine writes nothing
        return False

    def _end_send(self, room: int, pending: Send, failure: str, kv_bytes: int = 0) -> None:
        del self.sends[room]
        self._done_sending.add(pending.order.req_id)
        stats.record(self._stats, failed=bool(failure), kv_bytes=kv_bytes, seconds=time.monotonic() - pending.since)
        if failure:
            log.warning("pdfabric: room %d of %s (prefill) failed: %s", room, pending.order.req_id, failure)
        self._forget(room)

    def _end_receive(self, room: int, recv: Receive, failure: str, kv_bytes: int = 0) -> None:
        del self.receives[room]
        self._done_receiving.add(recv.order.req_id)
        stats.record(self._stats, failed=bool(failure), kv_bytes=kv_bytes, seconds=time.monotonic() - recv.since)
        if failure:
            if not recv.aborted or recv.refused:
                self._load_errors.update(recv.order.pages)
            log.warning("pdfabric: room %d of %s (decode) failed: %s", room, recv.order.req_id, failure)
        self._forget(room)

    def _forget(self, room: int) -> None:
        if self.events is not None:
            self.events.forget(room)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        events = self.events
        if self._idle_step and (self.sends or self.receives) and events is not None and events.synced.is_set():
            events.wait_change(IDLE_WAIT_S)
        self._idle_step = False
        self.progress()
        sent, self._done_sending = self._done_sending, set()
        received, self._done_receiving = self._done_receiving, set()
        return sent or None, received or None

    def take_stats(self) -> stats.Stats | None:
        """The rooms that ended since the last call, for vLLM's connector stats; None when none did."""
        if stats.is_empty(self._stats):
            return None
        data, self._stats = self._stats, stats.empty()
        return data

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.calls.close()
