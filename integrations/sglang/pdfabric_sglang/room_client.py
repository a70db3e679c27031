"""What a sender and a receiver share (``RoomClient``): one SGLang request's room at the node
agent, its state read from the agent's typed room view and concluded once, the agent calls guarded
so that an agent that refuses, is down or restarting fails the request with the reason, never the
server. SGLang's ``KVPoll`` codes as typed ints. Above the manager: a room calls its manager, never
the other way round."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import KVTransferError

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol.board import BoardEnd
from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest
from pdfabric_core.rankmap import Rank
from pdfabric_sglang.manager import AGENT_ERRORS, PdfabricKVManager

log = logging.getLogger("pdfabric.sglang")

# SGLang's KVPoll codes as typed ints (SGLang ships no type information).
FAILED: int = int(KVPoll.Failed)
BOOTSTRAPPING: int = int(KVPoll.Bootstrapping)
WAITING_FOR_INPUT: int = int(KVPoll.WaitingForInput)
SUCCESS: int = int(KVPoll.Success)


@functools.lru_cache(maxsize=4096)
def group_of(rank_id: str) -> tuple[int, int]:
    """The replica and DP group of a rank id (``decode-<replica>-dp<group>-tp<n>``). Cached: a
    sender decode is ready for asks this on every scheduler poll, and a cluster has few rank ids
    (parsing one was 60% of such a poll, benchmarks/bench_sglang_backends.py (b))."""
    rank = Rank.from_id(rank_id)
    return rank.replica, rank.dp_rank


class RoomClient:
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
        # The submit, handed to the manager's worker (AgentCalls), not answered yet; a refusal
        # lands in ``refused`` and the next poll concludes with it.
        self.submit_pending = False
        self.refused = ""
        self.moving_since: float | None = None  # when the agent began moving the room's bytes
        # The last in-progress view a poll read and what it answered: SGLang polls every request
        # of a queue each scheduler iteration, most of them against a view that has not changed.
        self._polled_view: RoomView | None = None
        self._polled_state = WAITING_FOR_INPUT
        # Where the agent writes the room's successful end in shared memory (board.py); None: the
        # manager has no board, or every slot is taken, and the room's end comes by the feed.
        self.board_slot = mgr.board.take() if mgr.board is not None else None
        self._board_end: Callable[[], BoardEnd | None] | None = (
            mgr.board.reader(self.board_slot, self.room)
            if mgr.board is not None and self.board_slot is not None
            else None
        )

    @property
    def mgr(self) -> PdfabricKVManager:
        return self.kv_mgr

    def _conclude(self, state: int, reason: str = "") -> int:
        if self.concluded is None:
            self.concluded, self.reason = state, reason
            self.finished_at = time.monotonic()
            slot, self.board_slot, self._board_end = self.board_slot, None, None
            if slot is not None and self.mgr.board is not None:
                self.mgr.board.give(slot)  # a late write of this room there matches no later room
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

    def _peer_to_tell(self) -> tuple[int, int] | None:
        """For a room not submitted yet: the peer replica and DP group the agent tells of the abort."""
        return None

    def _abort_at_agent(self, reason: str) -> None:
        if not self._agent_holds_room() or self.concluded is not None:
            return
        mgr, room, peer = self.mgr, self.room, self._peer_to_tell()

        def abort() -> None:
            try:
                mgr.calls_client.abort(mgr.rank_id, room, reason, *(peer or ()))
            except AGENT_ERRORS as exc:
                log.warning("pdfabric: abort of room %d at the agent: %s", room, exc)

        mgr.calls.call(abort)  # after this room's submit, if that is still on its way

    def _submit(self, msg: SendRequest | ReceiveRequest, what: str, before: Callable[[], None] | None = None) -> None:
        """Hand the room (or a chunk of it) to the agent without waiting for it: the answer goes
        into the manager's room table, a refusal into ``refused``. ``before`` runs first on the
        worker (a wait for the forward that writes the chunk's pages), never on the scheduler."""
        self.submit_pending = True

        def answered(answer: Callable[[], RoomView]) -> None:
            try:
                view = answer()
            except AGENT_ERRORS as exc:
                self.refused = f"the agent did not take the {what}: {exc}"
            else:
                if self.mgr.events is not None:
                    self.mgr.events.put(view)
            self.submit_pending = False

        def submit() -> None:
            if before is not None:
                before()
            answered(lambda: self.mgr.submit(msg))

        # Nothing to wait for and no call ahead: the request leaves now, from this thread.
        if before is not None or not self.mgr.calls.call_now(lambda: self.mgr.begin_submit(msg), answered):
            self.mgr.calls.call(submit)

    def _view(self) -> RoomView | None:
        """The agent's view of the room: from the manager's room table while the agent's room feed
        keeps it (a lookup), else asked (None when the agent has none yet: 404). Concludes Failed
        when the agent cannot be asked."""
        mgr = self.kv_mgr
        events = mgr.events
        if events is not None and events.synced.is_set():
            return events.view(self.room)
        try:
            return mgr.client.poll(mgr.rank_id, self.room)
        except AgentRefused as exc:
            if exc.status == 404:
                return None
            self._conclude(FAILED, f"agent refused the poll: {exc}")
        except (OSError, ValueError) as exc:
            self._conclude(FAILED, f"agent {self.mgr.config.address} unreachable: {exc}")
        return None

    def _agent_state(self) -> int:
        """The submitted room's state at the agent (its codes are SGLang's KVPoll values)."""
        if self.refused:
            return self._conclude(FAILED, self.refused)
        if self._board_end is not None:  # taken away once concluded
            end = self._board_end()
            if end is not None:
                return self._conclude_from_board(end)
        if self.submit_pending:
            return WAITING_FOR_INPUT  # the agent has not answered the submit yet
        view = self._view()
        if view is not None and view is self._polled_view:
            return self._polled_state  # inline, not a call: this runs for every request every iteration
        if self.concluded is not None:
            return self.concluded
        if view is None:  # a submitted room the agent no longer knows: it restarted
            return self._conclude(FAILED, "the agent lost the room (restarted?)")
        if view.finished:
            if view.succeeded:
                self.bytes_moved = sum(view.moved.values())
                self.moving_since = view.first_byte_at
                if view.aux_rows is not None and not self._land_aux_row(view.aux_rows):
                    return self.concluded if self.concluded is not None else FAILED
            return self._conclude(int(view.state), view.reason)
        # Submitted, the agent still waiting for a decode rank's room info: in progress, as SGLang's
        # prefill inflight queue needs (it takes no Bootstrapping once sent).
        return self._answer(view, WAITING_FOR_INPUT if view.state is RoomState.BOOTSTRAPPING else int(view.state))

    def _conclude_from_board(self, end: BoardEnd) -> int:
        """Conclude Success from the room board: what the feed's Success view would say, read in
        this poll instead of after the feed's thread woke."""
        self.bytes_moved, self.moving_since = end.moved, end.first_byte_at
        if end.aux_rows is not None and not self._land_aux_row(end.aux_rows):
            return self.concluded if self.concluded is not None else FAILED
        if self.mgr.board is not None:
            self.mgr.board.reads += 1
        return self._conclude(SUCCESS)

    def _answer(self, view: RoomView, state: int) -> int:
        """Answer ``state`` for an in-progress ``view``, and remember both: a poll that reads the same
        view object again (the feed replaces a view that changes) answers the same at once."""
        self._polled_view, self._polled_state = view, state
        return state

    def _land_aux_row(self, rows: tuple[bytes, ...]) -> bool:
        """A decode room's aux row the agent hands back (private aux buffers): the receiver writes
        it before the room is Success; False when it could not (the room is concluded Failed)."""
        return True

    def get_transfer_metric(self) -> KVTransferMetric:
        """SGLang's metric: the bytes the agent counted, and the latency from the first byte moved
        (a sender: the agent's start of the room; a receiver: its submit) to the end seen here."""
        latency = None
        start = self.moving_since or self.submitted_at
        if start is not None and self.finished_at is not None and self.concluded == SUCCESS:
            latency = max(0.0, self.finished_at - start)
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
        """SGLang is done with the request: its row of the manager's room table goes."""
        if self.mgr.events is not None:
            self.mgr.events.forget(self.room)
