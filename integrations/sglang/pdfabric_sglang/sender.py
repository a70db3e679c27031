"""``PdfabricKVSender`` (prefill): Bootstrapping until the decode side announced the room to the
agent, WaitingForInput once every decode rank did (the agent names them, so the sender learns the
decode replica the router chose), then the agent's state of the room. ``send`` takes chunks; the
room is submitted with the last one (the agent moves a room's pages in one plan)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import BaseKVSender

from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import SendRequest
from pdfabric_sglang.kvargs import read_aux_row
from pdfabric_sglang.room_client import (
    BOOTSTRAPPING,
    FAILED,
    WAITING_FOR_INPUT,
    RoomClient,
    replica_of,
)

if TYPE_CHECKING:
    from pdfabric_sglang.manager import PdfabricKVManager


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
            self._submit_send()  # the last chunk came before this rank saw decode's announcement
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
            self._submit_send()

    def _submit_send(self) -> None:
        assert self.decode_replica is not None and self.last_state_slots is not None
        msg = SendRequest(
            self.mgr.rank_id,
            self.room,
            self.pages,
            self.last_state_slots,
            self.aux_index,
            self.decode_replica,
            engine_memory=True,
            aux_rows=self._aux_row(),
        )
        self.submitted_at = self.first_chunk_at
        self._submit(msg, "send")

    def _aux_row(self) -> tuple[bytes, ...]:
        """The room's metadata row, read here when the engine keeps its rows private (SGLang wrote
        it with ``set_buf`` before handing over the last chunk)."""
        if self.aux_index is None or not self.mgr.registration.aux_inline:
            return ()
        return read_aux_row(self.mgr.kv_args, self.aux_index)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still submits the room
