"""SGLang's transfer-backend contract (``sglang.srt.disaggregation.base.conn``) on the node agent.

- ``PdfabricKVManager``: one per engine rank. Registers the rank's ``KVArgs`` buffers with the
  agent (``/v1/memory``), which checks them against the PDCluster's model and moves that rank's
  rooms in them from then on. The rendezvous is the PDCluster's rank map, not a bootstrap table.
- ``PdfabricKVSender`` (prefill): SGLang's bootstrap room is the agent's room id. ``poll`` reports
  Bootstrapping until the decode side announced the room to the agent, WaitingForInput once every
  decode rank did (the agent names them, so the sender learns the decode replica the router chose),
  then the agent's state of the room. ``send`` takes chunks; the room is submitted with the last
  one (the agent moves a room's pages in one plan).
- ``PdfabricKVReceiver`` (decode): asks the prefill's bootstrap server which prefill replica it is
  (``init``), then ``send_metadata`` submits the room's destination pages, aux row and state slots.
- ``PdfabricKVBootstrapServer`` (prefill): answers that question, nothing more.

Both sides fill SGLang's ``KVTransferMetric``: latency from the first chunk handed to the backend
(sender) or the metadata submit (receiver) to the agent's confirmed completion, and the bytes the
agent counted for the room, once each (skipped CP state is not counted).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError

from pdfabric_agent.client import AgentClient, AgentRefused
from pdfabric_agent.wire import ReceiveRequest, SendRequest
from pdfabric_core.policy.types import Role
from pdfabric_sglang.kvargs import ENV_CP_RANK, ENV_RANK, ENV_REPLICA, FabricConfig, gpu_of, rank_id_for, registration
from pdfabric_sglang.shares import UnshareableBuffer

log = logging.getLogger("pdfabric.sglang")

REPLICA_PATH = "/pdfabric/v1/replica"
FINAL = (KVPoll.Success, KVPoll.Failed)


class PdfabricKVManager(BaseKVManager):
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
        self.client = AgentClient(self.config.address, self.config.token, self.cluster_uid)
        self.rank_id = rank_id_for(self.role, self.config, args)
        if self.rank_id not in info["ranks"]:
            raise RuntimeError(
                f"pdfabric: agent {info['agent']} does not serve rank {self.rank_id} "
                f"(it serves {sorted(info['ranks'])}); check {ENV_REPLICA}/{ENV_CP_RANK} or set {ENV_RANK}"
            )
        try:
            reg = registration(self.rank_id, args, is_mla=bool(is_mla_backend), gpu=gpu_of(args))
            answer = self.client.register_memory(reg)
        except (UnshareableBuffer, AgentRefused) as exc:
            raise RuntimeError(f"pdfabric: the buffers of {self.rank_id} cannot be registered: {exc}") from None
        self.layout = answer["memory"]["layout"]
        self.bootstrap_timeout_s = self.config.bootstrap_timeout_s
        log.info(
            "pdfabric: %s registered %d buffers with agent %s", self.rank_id, answer["memory"]["buffers"], info["agent"]
        )

    def register_to_bootstrap(self) -> None:
        """Nothing to register: the PDCluster's rank map tells every agent where each rank is."""


class _RoomClient:
    """What sender and receiver share: a room of the manager's rank, its outcome and metric."""

    def __init__(self, mgr: PdfabricKVManager, bootstrap_room: int | None) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room or 0)
        self.submitted_at: float | None = None
        self.finished_at: float | None = None
        self.concluded: int | None = None  # a KVPoll value once final
        self.reason = ""
        self.bytes_moved: int | None = None
        self.created = time.monotonic()

    def _conclude(self, state: int, reason: str = "") -> int:
        if self.concluded is None:
            self.concluded, self.reason = state, reason
            self.finished_at = time.monotonic()
        return self.concluded

    def _agent_state(self) -> int:
        """The submitted room's state at the agent (its codes are SGLang's KVPoll values)."""
        try:
            view = self.mgr.client.poll(self.mgr.rank_id, self.room)
        except AgentRefused as exc:
            return self._conclude(KVPoll.Failed, f"agent refused the poll: {exc}")
        code = int(view["code"])
        if code in FINAL:
            if code == KVPoll.Success:
                self.bytes_moved = sum(int(n) for n in view.get("bytes", {}).values())
            return self._conclude(code, view.get("reason", ""))
        return code

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None
        if self.submitted_at is not None and self.finished_at is not None and self.concluded == KVPoll.Success:
            latency = self.finished_at - self.submitted_at
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes_moved)

    def failure_exception(self) -> None:
        raise KVTransferError(self.room, f"pdfabric room {self.room} on {self.mgr.rank_id} failed: {self.reason}")

    def abort(self) -> None:
        if self.submitted_at is not None and self.concluded is None:
            try:
                self.mgr.client.abort(self.mgr.rank_id, self.room, "aborted by SGLang")
            except AgentRefused as exc:
                log.warning("pdfabric: abort of room %d: %s", self.room, exc)
        self._conclude(KVPoll.Failed, "aborted by SGLang")


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
        self.first_chunk_at = 0.0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def poll(self) -> int:
        if self.concluded is not None:
            return self.concluded
        if self.submitted_at is not None:
            return self._agent_state()
        try:
            view = self.mgr.client.poll(self.mgr.rank_id, self.room)
        except AgentRefused as exc:
            if exc.status != 404:
                return self._conclude(KVPoll.Failed, str(exc))
            view = None  # decode has not announced the room yet
        if view is not None and view.get("decode_ranks_ready"):
            self.decode_replica = replica_of(view["decode_ranks_ready"][0])
            if view["state"] == "WaitingForInput":
                return KVPoll.WaitingForInput
        if time.monotonic() - self.created > self.mgr.bootstrap_timeout_s:
            return self._conclude(
                KVPoll.Failed, f"decode did not announce the room within {self.mgr.bootstrap_timeout_s:g} s"
            )
        return KVPoll.Bootstrapping

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None:
        if self.concluded is not None:
            return
        if self.submitted_at is None and not self.pages:
            self.first_chunk_at = time.monotonic()
        self.pages.extend(int(p) for p in np.asarray(kv_indices).reshape(-1))
        if self.num_pages is None or len(self.pages) < self.num_pages:
            return  # not the last chunk: the room goes with it
        state = (
            [int(s) for s in np.asarray(state_indices[0]).reshape(-1)]
            if state_indices and state_indices[0] is not None
            else []
        )
        if self.decode_replica is None:
            self._conclude(KVPoll.Failed, "the last chunk came before decode announced the room")
            return
        msg = SendRequest(self.mgr.rank_id, self.room, self.pages, state, self.aux_index, self.decode_replica)
        try:
            self.mgr.client.submit(msg)
        except AgentRefused as exc:
            self._conclude(KVPoll.Failed, f"agent refused the send: {exc}")
            return
        self.submitted_at = self.first_chunk_at

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still submits the room


def replica_of(rank_id: str) -> int:
    """The replica in a rank id (``decode-<replica>-tp<n>``)."""
    try:
        return int(rank_id.split("-")[1])
    except (IndexError, ValueError):
        raise ValueError(f"not a pdfabric rank id: {rank_id!r}") from None


class PdfabricKVReceiver(_RoomClient, BaseKVReceiver):
    def __init__(self, mgr: PdfabricKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        _RoomClient.__init__(self, mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_replica: int | None = None
        self.inited = False
        self.conclude_state: int | None = None  # SGLang's decode reads it after init

    def init(self, prefill_dp_rank: int) -> None:
        self.inited = True
        self._resolve()

    def _resolve(self) -> None:
        """Ask the prefill's bootstrap server which replica it is; it may not be up yet (then
        Bootstrapping, until the bootstrap timeout)."""
        try:
            self.prefill_replica = prefill_replica_at(self.bootstrap_addr, self.mgr.cluster_uid, timeout_s=1.0)
        except ValueError as exc:  # another PDCluster's prefill: no retry helps
            self.conclude_state = self._conclude(KVPoll.Failed, f"prefill bootstrap {self.bootstrap_addr}: {exc}")
        except OSError as exc:
            if time.monotonic() - self.created > self.mgr.bootstrap_timeout_s:
                self.conclude_state = self._conclude(
                    KVPoll.Failed, f"prefill bootstrap {self.bootstrap_addr} unreachable: {exc}"
                )

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        if self.concluded is not None or self.prefill_replica is None:
            return
        pages = [int(p) for p in np.asarray(kv_indices).reshape(-1)]
        state = (
            [int(s) for s in np.asarray(state_indices[0]).reshape(-1)]
            if state_indices and state_indices[0] is not None
            else []
        )
        msg = ReceiveRequest(self.mgr.rank_id, self.room, pages, state, aux_index, self.prefill_replica)
        self.submitted_at = time.monotonic()
        try:
            self.mgr.client.submit(msg)
        except AgentRefused as exc:
            self.conclude_state = self._conclude(KVPoll.Failed, f"agent refused the receive: {exc}")

    def poll(self) -> int:
        if self.concluded is not None:
            return self.concluded
        if self.prefill_replica is None:
            if self.inited:
                self._resolve()
            return self.concluded if self.concluded is not None else KVPoll.Bootstrapping
        if self.submitted_at is None:
            return KVPoll.WaitingForInput
        state = self._agent_state()
        if state in FINAL:
            self.conclude_state = state
        return state


def prefill_replica_at(bootstrap_addr: str, cluster_uid: str, timeout_s: float = 5.0) -> int:
    """Which prefill replica serves behind a bootstrap address (the router gives decode that address)."""
    with urllib.request.urlopen(f"http://{bootstrap_addr}{REPLICA_PATH}", timeout=timeout_s) as resp:
        doc = json.loads(resp.read())
    if doc.get("cluster") != cluster_uid:
        raise ValueError(f"it serves PDCluster {doc.get('cluster')!r}, not this decode's {cluster_uid!r}")
    return int(doc["replica"])


class PdfabricKVBootstrapServer(BaseKVBootstrapServer):
    """On prefill: tells decode engines which prefill replica this is (``REPLICA_PATH``)."""

    def __init__(self, host: str, port: int) -> None:
        config = FabricConfig()
        client = AgentClient(config.address, config.token, "")
        doc = {"replica": config.replica, "cluster": client.info()["cluster"]["uid"]}
        client.close()
        body = json.dumps(doc).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, payload = (200, body) if self.path == REPLICA_PATH else (404, b'{"error": "not found"}')
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="pdfabric-bootstrap", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
