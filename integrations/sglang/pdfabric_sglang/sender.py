"""``PdfabricKVSender`` (prefill): Bootstrapping until the decode side announced the room to the
agent, WaitingForInput once every decode rank did (the agent names them, so the sender learns the
decode replica the router chose), then the agent's state of the room. ``send`` takes chunks and
hands each to the agent as it comes (``SendChunk``, on the manager's worker: the scheduler never
waits), so the agent moves each chunk while the next is computed; state and aux go with the last.
Chunks that come before this rank saw decode's announcement wait here and go together with the
next ``send`` or ``poll``. An early cached-prefix chunk (SGLang's ``_early_send_wait_event``) is
handed over only once the forward that writes its pages is done: the worker waits for the event,
so no byte of it moves before."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import BaseKVSender
from sglang.srt.environ import envs

from pdfabric_agent.protocol.chunks import SendChunk
from pdfabric_agent.protocol.views import RoomState
from pdfabric_sglang.kvargs import read_aux_row
from pdfabric_sglang.manager import AGENT_CALL_TIMEOUT_S, PdfabricKVManager
from pdfabric_sglang.peers import REGISTER_DP_RANK_PATH, post_generate
from pdfabric_sglang.room_client import (
    BOOTSTRAPPING,
    FAILED,
    WAITING_FOR_INPUT,
    RoomClient,
    group_of,
    log,
)


class PdfabricKVSender(RoomClient, BaseKVSender):
    def __init__(
        self,
        mgr: PdfabricKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        RoomClient.__init__(self, mgr, bootstrap_room)
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []
        self.decode_replica: int | None = None
        self.decode_dp = 0  # the decode rank's DP group (its agent announced the room from there)
        self.decode_prefix_len = 0
        self.first_chunk_at = 0.0
        self.last_state_slots: list[int] | None = None  # set with the last chunk
        self.handed = 0  # pages handed to the agent so far (the next chunk's page_offset)
        self.final_handed = False
        self.handed_at: list[float] = []  # when SGLang handed each chunk over (a trace, for tests)
        # SGLang sets this before a cached-prefix send under overlap scheduling (a CUDA event of
        # the forward that may still write those pages); the chunk's hand-over waits for it.
        self._early_send_wait_event: Any = None
        self._waits: list[Any] = []
        self._tell_dp_group(bootstrap_addr, req_has_disagg_prefill_dp_rank)

    def _tell_dp_group(self, bootstrap_addr: str, routed: bool) -> None:
        """Decode finds this request's prefill DP group as SGLang's decode does (``init``'s
        ``prefill_dp_rank``): the router named it (``disagg_prefill_dp_rank``); or it is ``room %
        dp_groups`` (``follow_bootstrap_room``: a request dispatched to another group fails, as in
        SGLang); or this group registers it with its bootstrap server (``/register_dp_rank``), where
        decode's queue asks (``/query_dp_ranks``). One rank of the group registers, off the
        scheduler's thread."""
        par = self.mgr.parallel
        if par.dp_groups <= 1 or routed:
            return
        if par.follow_bootstrap_room and not envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get():
            implied = self.bootstrap_room % par.dp_groups
            if implied != par.dp_group:
                self.fail(
                    f"follow_bootstrap_room conflict: dispatched to DP group {par.dp_group}, but bootstrap room "
                    f"{self.bootstrap_room} implies {implied}; set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 "
                    f"for mixed routing"
                )
            return
        if (par.tp_rank, par.cp_rank, int(getattr(self.mgr.kv_args, "pp_rank", 0) or 0)) != (0, 0, 0):
            return
        url = f"http://{bootstrap_addr}{REGISTER_DP_RANK_PATH}"
        payload: dict[str, object] = {"bootstrap_room": self.bootstrap_room, "dp_rank": par.dp_group}

        def register() -> None:
            status, answer = post_generate(url, payload, AGENT_CALL_TIMEOUT_S)
            if status != 200:
                log.warning("pdfabric: %s answered %s: %s", url, status or "nothing", answer[:200])

        self.mgr.calls.call(register)

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
        if state == WAITING_FOR_INPUT and (self.pages or self.last_state_slots is not None):
            self._hand_over()  # chunks came before this rank saw decode's announcement
            return self.concluded if self.concluded is not None else WAITING_FOR_INPUT
        return state

    def _bootstrap_state(self) -> int:
        """Before the room is submitted: Bootstrapping until decode announced it to the agent,
        then WaitingForInput (and which decode replica takes it)."""
        view = self._view()
        if view is not None and view is self._polled_view:
            return self._polled_state  # decode's announcement, as read last poll (RoomClient._answer)
        if (done := self._final()) is not None:  # the agent could not be asked
            return done
        if view is not None:
            if view.state is RoomState.FAILED:  # decode gave the room up before we sent
                return self._conclude(FAILED, view.reason or "the decode side failed the room")
            if view.sends is False:  # this rank moves nothing (replicated heads, a quiet CP rank)
                self.decode_replica = 0  # any: the agent concludes the room at once, to no decode rank
                return WAITING_FOR_INPUT
            if view.decode_ranks_ready:
                self.decode_replica, self.decode_dp = group_of(view.decode_ranks_ready[0])
                self.decode_prefix_len = view.decode_prefix_tokens or 0
                if view.state is RoomState.WAITING_FOR_INPUT:
                    return self._answer(view, WAITING_FOR_INPUT)
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
        wait, self._early_send_wait_event = self._early_send_wait_event, None
        if wait is not None:
            self._waits.append(wait)
        if self.submitted_at is None and not self.pages:
            self.first_chunk_at = time.monotonic()
        self.handed_at.append(time.monotonic())
        self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
        if self.num_pages is not None and len(self.pages) >= self.num_pages:
            self.last_state_slots = (
                [int(s) for s in np.asarray(state_indices[0]).reshape(-1)]
                if state_indices and state_indices[0] is not None
                else []
            )
        # SGLang may send before this rank saw decode's announcement itself: a PP stage after the
        # first follows stage 0's poll, and a TP or CP rank follows the all-reduced poll. Ask the
        # agent's table now; if decode's word has not reached this rank's room yet, poll hands over.
        if self.decode_replica is not None or self._bootstrap_state() == WAITING_FOR_INPUT:
            self._hand_over()

    def _hand_over(self) -> None:
        """The pages not handed to the agent yet, as the room's next chunk (the last with the
        state slots and the aux row); the first opens the room at the agent."""
        assert self.decode_replica is not None
        final = self.last_state_slots is not None
        offset = self.handed
        if self.final_handed or (len(self.pages) == offset and not final):
            return
        msg = SendChunk(
            self.mgr.rank_id,
            self.room,
            self.pages[offset:],
            self.last_state_slots or [],
            self.aux_index if final else None,
            self.decode_replica,
            engine_memory=True,
            peer_dp=self.decode_dp,
            page_offset=offset,
            final=final,
            board_slot=self.board_slot if offset == 0 else None,  # the room's, named when it opens
        )
        if final:
            msg = self._with_aux_row(msg)
        self.handed, self.final_handed = len(self.pages), final
        if self.submitted_at is None:
            self.submitted_at = self.first_chunk_at
        waits, self._waits = self._waits, []
        self._submit(msg, "send", self._waiter(waits) if waits else None)

    def _waiter(self, waits: list[Any]) -> Callable[[], None]:
        """On the worker, before the chunk goes: the forward that writes its pages is done (as
        SGLang's Mooncake worker synchronizes the event before reading the pages). A room that
        failed meanwhile does not wait: its chunk is refused by the agent anyway."""

        def wait() -> None:
            for event in waits:
                if self.concluded != FAILED:
                    event.synchronize()

        return wait

    def _with_aux_row(self, msg: SendChunk) -> SendChunk:
        """The final chunk with the room's metadata row, when the engine keeps its rows private
        (SGLang wrote it with ``set_buf`` before handing over the last chunk): written into the
        room's board slot when it has one (the agent reads it there), else carried in the body."""
        if self.aux_index is None or not self.mgr.registration.aux_inline:
            return msg
        row = read_aux_row(self.mgr.kv_args, self.aux_index)
        board = self.mgr.board
        if board is None or self.board_slot is None:
            return dataclasses.replace(msg, aux_rows=row)
        board.write_rows(self.board_slot, row)
        return dataclasses.replace(msg, aux_on_board=True)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still submits the room
