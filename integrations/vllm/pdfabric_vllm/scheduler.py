"""The connector's scheduler side, in vLLM's engine core: which requests move KV through pdfabric,
and the orders each step hands the worker ranks (``orders``).

Push, as vLLM's MooncakeConnector and SGLang's backends move KV, not pull as its NixlConnector:
the prefill ranks' agents write into the decode ranks' pages once decode announced them, so
decode never reads a remote prefill's memory and prefill's blocks are held until the write ended
(``request_finished`` returns ``delay_free``; the worker reports them in ``finished_sending``).
Decode loads asynchronously: a request waits in ``WAITING_FOR_REMOTE_KVS`` until its ranks'
rooms succeed; a room that fails reports its pages as load errors, and vLLM's
``kv_load_failure_policy`` applies (recompute or fail)."""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

from pdfabric_core.policy.types import Role
from pdfabric_vllm.orders import AbortOrder, Orders, ReceiveOrder, ReleaseOrder, SendOrder
from pdfabric_vllm.params import ParamsError, RemotePrefill, wants_remote_decode, wants_remote_prefill

log = logging.getLogger("pdfabric.vllm")

# vLLM's request states in which a prefill's KV is whole (it ran to its token limit or a stop).
DONE_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerSide:
    def __init__(self, role: Role, replica: int, dp: int, block_size: int) -> None:
        self.role, self.replica, self.dp, self.block_size = role, replica, dp, block_size
        self._orders = Orders()
        self._matched: dict[str, tuple[RemotePrefill, int]] = {}  # decode: req -> (remote, local tokens)
        self._receiving: dict[str, int] = {}  # decode: req -> room, submitted and not reported yet
        self._holding: dict[str, int] = {}  # prefill: req -> room whose pages are held for decode
        self.refused: dict[str, str] = {}  # decode: req -> why its params name no room (logged once)

    # ------------------------------------------------------------------ decode
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.role is not Role.DECODE or not wants_remote_prefill(params):
            return 0, False
        try:
            remote = RemotePrefill.parse(params)
        except ParamsError as exc:
            if request.request_id not in self.refused:
                self.refused[request.request_id] = str(exc)
                log.warning("pdfabric: request %s computes its prompt here: %s", request.request_id, exc)
            return 0, False
        self._matched[request.request_id] = (remote, num_computed_tokens)
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        params = request.kv_transfer_params
        if matched is None or not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one transfer per request (vLLM may call this twice)
        remote, local_tokens = matched
        if num_external_tokens == 0:
            self._release(request.request_id, remote, "decode holds the whole prompt already (its prefix cache)")
            return
        # The pages after the prefix this server holds (whole pages: vLLM's prefix hits are).
        prefix_pages = local_tokens // self.block_size
        prompt_pages = -(-len(request.prompt_token_ids) // self.block_size)
        pages = tuple(blocks.get_block_ids()[0][prefix_pages:prompt_pages])
        self._orders.receives.append(
            ReceiveOrder(
                request.request_id,
                remote.room,
                remote.prefill_replica,
                remote.prefill_dp,
                pages,
                prefix_pages * self.block_size,
            )
        )
        self._receiving[request.request_id] = remote.room

    def _release(self, req_id: str, remote: RemotePrefill, reason: str) -> None:
        self._orders.releases.append(
            ReleaseOrder(req_id, remote.room, remote.prefill_replica, remote.prefill_dp, reason)
        )

    # ------------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output: Any) -> Orders:
        orders, self._orders = self._orders, Orders()
        orders.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        return orders

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            self._receiving.pop(req_id, None)
        for req_id in output.finished_sending or ():
            self._holding.pop(req_id, None)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        req_id = request.request_id
        self.refused.pop(req_id, None)
        if self.role is Role.DECODE:
            if wants_remote_prefill(params):
                # Never allocated (aborted while waiting): the prefill still holds the room's pages.
                with contextlib.suppress(ParamsError):  # no room named: nothing held for it
                    self._release(req_id, RemotePrefill.parse(params), "the request ended before decode took it")
                params["do_remote_prefill"] = False
            room = self._receiving.pop(req_id, None)
            if room is not None:
                # Aborted while its KV was on its way: vLLM holds its pages (WAITING_FOR_REMOTE_KVS)
                # until the worker reports it, which waits for the room's sources to be quiet.
                self._orders.aborts.append(AbortOrder(req_id, room))
            return False, None
        if not wants_remote_decode(params):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        pages = tuple(block_ids)  # the blocks of its computed tokens (one KV cache group)
        if status not in DONE_STATUSES or not pages:
            return False, None  # aborted, or nothing computed: nothing to hand over
        room = secrets.randbits(63)
        # The prompt's pages: decode receives those, not a page begun by the token prefill sampled.
        prompt_pages = -(-len(request.prompt_token_ids or ()) // self.block_size)
        self._orders.sends.append(SendOrder(req_id, room, pages[:prompt_pages], self.block_size))
        self._holding[req_id] = room
        remote = RemotePrefill(room, self.replica, self.dp, int(request.num_computed_tokens))
        return True, remote.to_params()

    def has_pending_push_work(self) -> bool:
        """Rooms still moving: vLLM steps its engine meanwhile (else a decode request waiting for its
        KV, or a prefill holding pages for decode, is not looked at until the next request comes),
        and each step's ``get_finished`` on the workers reads how the rooms stand."""
        return bool(self._receiving or self._holding)
