"""The reference engine's ``direct`` backend: SGLang's sender and receiver calls made on the agent's
engine API alone, without SGLang (a GPU machine without SGLang's kernels). The room's state codes
are SGLang's KVPoll values (``RoomState``)."""

from __future__ import annotations

import time
import types
from typing import Any

from pdfabric_agent.protocol.views import RoomState, RoomView
from pdfabric_core.rankmap import Rank


class DirectRank:
    """One rank's buffers registered with its agent through the engine API (no SGLang)."""

    def __init__(self, role: str, ka: Any, gpu: int | None) -> None:
        from pdfabric_sglang.kvargs import rank_id_for, registration

        from pdfabric_agent.client.api import AgentClient
        from pdfabric_agent.client.engine_env import FabricConfig
        from pdfabric_core.policy.types import Role

        cfg = FabricConfig()
        probe = AgentClient(cfg.address, cfg.token, "")
        uid = probe.info().cluster_uid
        probe.close()
        self.client = AgentClient(cfg.address, cfg.token, uid)
        self.rank_id = rank_id_for(Role(role), cfg, ka)
        self.client.register_memory(registration(self.rank_id, ka, is_mla=False, gpu=gpu))


class _DirectRoom:
    """What SGLang's sender and receiver calls do, on the agent's engine API (the room's state
    codes are KVPoll's)."""

    def __init__(self, mgr: DirectRank, bootstrap_addr: str, room: int) -> None:
        self.mgr, self.room, self.reason = mgr, room, ""
        self.submitted_at = self.finished_at = 0.0
        self.code: int | None = None
        self.bytes = 0
        self.view: RoomView | None = None

    def _room_code(self) -> int:
        from pdfabric_agent.client.api import AgentRefused

        try:
            self.view = self.mgr.client.poll(self.mgr.rank_id, self.room)
        except AgentRefused as exc:
            if exc.status == 404:
                return int(RoomState.BOOTSTRAPPING)  # the other side has not announced the room yet
            self.code, self.reason = int(RoomState.FAILED), str(exc)
            return self.code
        view = self.view
        if view.finished and self.submitted_at:
            self.code, self.finished_at, self.reason = int(view.state), time.monotonic(), view.reason
            self.bytes = sum(view.moved.values())
        return int(view.state)

    def get_transfer_metric(self) -> Any:
        ok = self.code == RoomState.SUCCESS
        return types.SimpleNamespace(
            transfer_latency_s=self.finished_at - self.submitted_at if ok else None,
            transfer_total_bytes=self.bytes if ok else None,
        )

    def failure_exception(self) -> None:
        raise RuntimeError(f"room {self.room} on {self.mgr.rank_id} failed: {self.reason}")

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk


class DirectSender(_DirectRoom):
    def __init__(self, mgr: DirectRank, bootstrap_addr: str, room: int) -> None:
        super().__init__(mgr, bootstrap_addr, room)
        self.pages: list[int] = []
        self.decode_replica = 0
        self.num_pages = 0
        self.aux_index: int | None = None

    def poll(self) -> int:
        if self.code is not None:
            return self.code
        code = self._room_code()
        if not self.submitted_at and self.view is not None and self.view.decode_ranks_ready:
            self.decode_replica = Rank.from_id(self.view.decode_ranks_ready[0]).replica
        return code

    def init(self, num_pages: int, aux_index: int | None) -> None:
        self.num_pages, self.aux_index = num_pages, aux_index

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        if not self.submitted_at:
            self.submitted_at = time.monotonic()
        self.pages.extend(int(p) for p in kv_indices)
        if len(self.pages) == self.num_pages:
            self.mgr.client.send(
                self.mgr.rank_id, self.room, self.pages, decode_replica=self.decode_replica, aux_index=self.aux_index
            )


class DirectReceiver(_DirectRoom):
    """Expects prefill replica 0: the direct backend runs no bootstrap server to ask which prefill
    replica a request came from (SGLang's classes do), so it serves one prefill replica only."""

    def init(self, prefill_dp_rank: int) -> None:
        pass

    def poll(self) -> int:
        if self.code is not None:
            return self.code
        return self._room_code() if self.submitted_at else int(RoomState.WAITING_FOR_INPUT)  # until the metadata

    def send_metadata(self, kv_indices: Any, aux_index: int | None, state_indices: Any = None) -> None:
        self.submitted_at = time.monotonic()
        self.mgr.client.receive(self.mgr.rank_id, self.room, [int(p) for p in kv_indices], aux_index=aux_index)
