"""``PdfabricKVReceiver`` (decode): ``init`` takes the prefill replica from the manager's table of
prefill bootstrap addresses, ``send_metadata`` submits the room's destination pages, aux row and
state slots; an abort tells the prefill side even before the room was submitted."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import BaseKVReceiver

from pdfabric_agent.protocol.wire import ReceiveRequest
from pdfabric_sglang.kvargs import write_aux_row
from pdfabric_sglang.manager import AGENT_CALL_TIMEOUT_S, PdfabricKVManager
from pdfabric_sglang.peers import PrefillPeer
from pdfabric_sglang.room_client import (
    BOOTSTRAPPING,
    FAILED,
    WAITING_FOR_INPUT,
    RoomClient,
)


class PdfabricKVReceiver(RoomClient, BaseKVReceiver):
    def __init__(
        self, mgr: PdfabricKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any
    ) -> None:
        RoomClient.__init__(self, mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_replica: int | None = None
        self.prefill_dp = 0  # the prefill DP group SGLang's decode queue resolved (``init``)
        self.inited = False
        # Deferred decode KV release: SGLang counts the prefill sources it awaits (one agent room)
        # and holds a failed room's pages while abort_notified.
        self.bootstrap_infos: list[PrefillPeer] = []
        self.abort_notified = False
        self.require_staging = False
        self.aux_index: int | None = None  # the room's MetadataBuffers row, once submitted

    def init(self, prefill_dp_rank: int = 0) -> None:
        """``prefill_dp_rank``: the request's prefill DP group as SGLang's decode queue resolved it
        (the router's ``disagg_prefill_dp_rank``, ``room % dp_size`` under follow_bootstrap_room,
        or the prefill bootstrap server's ``/query_dp_ranks``): the room's sources are that group's
        prefill ranks."""
        self.inited = True
        self.prefill_dp = int(prefill_dp_rank or 0)
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

    def _peer_to_tell(self) -> tuple[int, int] | None:
        if self.submitted_at is not None or self.prefill_replica is None:
            return None
        return self.prefill_replica, self.prefill_dp

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
            peer_dp=self.prefill_dp,
            prefix_tokens=int(decode_prefix_len or 0),
            board_slot=self.board_slot,
        )
        self.aux_index = aux_index
        self.submitted_at = time.monotonic()
        self._submit(msg, "receive")

    def _land_aux_row(self, rows: tuple[bytes, ...]) -> bool:
        """Into SGLang's own MetadataBuffers row, before SGLang reads it (it does once Success)."""
        if self.aux_index is None:
            return True
        try:
            write_aux_row(self.mgr.kv_args, self.aux_index, rows)
        except ValueError as exc:
            self._conclude(FAILED, f"the agent's aux row does not fit this engine's metadata buffers: {exc}")
            return False
        return True

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
