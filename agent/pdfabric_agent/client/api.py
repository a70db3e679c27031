"""Small Python client for a serving engine (and for tests, demo and benchmarks).

Blocking, standard library only, so a serving engine takes no new dependency. Each thread keeps
one keep-alive connection to the agent (``http1``: a request costs no TCP handshake and little
Python; a long poll is one request on it):

    c = AgentClient("127.0.0.1:7400", token, cluster_uid)
    pools = c.map_pools("decode-0-tp0")          # the rank's registered pools, mapped here
    c.receive("decode-0-tp0", room=7, kv_pages=[...], state_indices=[...], aux_index=3, prefill_replica=0)
    c.send("prefill-0-tp0-cp0", room=7, kv_pages=[...], state_indices=[...], aux_index=1, decode_replica=0)
    c.wait("decode-0-tp0", 7, timeout_s=30)      # -> final view, state "Success" or "Failed"
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdfabric_agent.client.http1 import Connection, Response, StaleConnection
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.info import AgentInfo, RankInfo
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.views import MemoryAnswer, RoomView
from pdfabric_agent.protocol.wire import INFO_PATH, AbortRequest, ReceiveRequest, RoomSubmit, SendRequest, room_path

WAIT_BACKOFF_MIN_S = 0.01  # `wait`: pause after a poll answered at once, doubling up to the max
WAIT_BACKOFF_MAX_S = 0.5
REGISTER_TIMEOUT_S = 30.0  # `register_memory`: at least this long, whatever the client's timeout


class AgentRefused(RuntimeError):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


A = TypeVar("A")


def _answer(parse: Callable[[Any], A], doc: dict[str, Any]) -> A:
    """The typed answer, or ``AgentRefused`` (malformed) when the agent's is not one."""
    try:
        return parse(doc)
    except ValueError as exc:
        raise AgentRefused(200, "malformed", f"the agent's answer: {exc}") from None


class GpuPool:
    """A rank's GPU pool opened in this process through CUDA IPC (same node, the GPU visible here).
    ``ptr`` is a device address valid in this process; ``torch.as_tensor(pool, device=...)`` views
    it as uint8 without a copy (``__cuda_array_interface__``); ``read`` / ``write`` copy bytes."""

    def __init__(self, ptr: int, size: int, gpu: int) -> None:
        self.ptr, self.size, self.gpu = ptr, size, gpu

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def _check(self, offset: int, n: int) -> None:
        if not 0 <= offset <= offset + n <= self.size:
            raise ValueError(f"{n} bytes at {offset} are outside this pool of {self.size} bytes")

    def _span(self, key: slice) -> tuple[int, int]:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a GPU pool is indexed by a contiguous byte slice")
        start, stop, _ = key.indices(self.size)
        return start, max(0, stop - start)

    def __getitem__(self, key: slice) -> bytes:  # the mmap idiom: pools.kv[a:b]
        return self.read(*self._span(key))

    def __setitem__(self, key: slice, data: bytes) -> None:
        start, n = self._span(key)
        if len(data) != n:
            raise ValueError(f"{len(data)} bytes do not fill a slice of {n}")
        self.write(start, data)

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, n: int) -> bytes:
        from pdfabric_agent.memory import cuda

        self._check(offset, n)
        buf = (ctypes.c_char * n)()
        cuda.primary_context(self.gpu)
        cuda.memcpy_dtoh(ctypes.addressof(buf), self.ptr + offset, n)
        return buf.raw

    def write(self, offset: int, data: bytes) -> None:
        from pdfabric_agent.memory import cuda

        self._check(offset, len(data))
        buf = ctypes.create_string_buffer(data, len(data))
        cuda.primary_context(self.gpu)
        cuda.memcpy_htod(self.ptr + offset, ctypes.addressof(buf), len(data))


@dataclass
class MappedPools:
    """A rank's pools mapped here: mmaps of the shared-memory files (CPU pools) or GpuPools."""

    layout: PoolLayout
    kv: mmap.mmap | GpuPool
    state: mmap.mmap | GpuPool
    aux: mmap.mmap | GpuPool
    _ipc: Any = None  # the CUDA IPC mappings behind GpuPools, closed with them

    def close(self) -> None:
        for m in (self.kv, self.state, self.aux):
            if isinstance(m, mmap.mmap):
                m.close()
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def map_rank_pools(rank_id: str, rank: RankInfo, gpu: int | None = None) -> MappedPools:
    """``AgentClient.map_pools`` from a rank's entry of /v1/info (its pools)."""
    mapped: dict[str, mmap.mmap | GpuPool] = {}
    ipc = None
    try:
        for kind, pool in rank.pools.items():
            if pool.device == "cpu":
                mapped[kind] = _map(pool.handle, pool.size)
                continue
            if not pool.handle:
                raise RuntimeError(
                    f"{rank_id} {kind} pool on {pool.device} has no CUDA IPC export "
                    "(allocated with expandable segments?); it cannot be mapped by a client"
                )
            from pdfabric_agent.memory.ipc import PeerMappings, PoolExport

            device = pool.gpu if gpu is None else gpu
            if device is None:
                raise RuntimeError(f"{rank_id} {kind} pool on {pool.device} names no GPU; pass gpu=")
            if ipc is None:
                ipc = PeerMappings(device)
            mapped[kind] = GpuPool(ipc.map(PoolExport.from_json(json.loads(pool.handle))), pool.size, device)
    except BaseException:
        for m in mapped.values():
            if isinstance(m, mmap.mmap):
                m.close()
        if ipc is not None:
            ipc.close()
        raise
    return MappedPools(rank.layout, mapped["kv"], mapped["state"], mapped["aux"], ipc)


class _ThreadConnection(threading.local):
    conn: Connection | None = None


class AgentClient:
    """``shared``: one connection for every thread, whose callers take turns (an engine's calls
    channel, where a request written on one thread is answered on another: ``_begin``); else one
    connection per thread."""

    def __init__(
        self, address: str, token: str, cluster_uid: str, timeout_s: float = 10.0, *, shared: bool = False
    ) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"agent address {address!r} is not host:port")
        self.host, self.port = host.strip("[]"), int(port)
        self.token = token
        self.cluster_uid = cluster_uid
        self.timeout_s = timeout_s
        self._local = _ThreadConnection()  # one connection per thread
        self._shared = Connection(self.host, self.port) if shared else None

    def _connection(self) -> Connection:
        if self._shared is not None:
            return self._shared
        if self._local.conn is None:
            self._local.conn = Connection(self.host, self.port)
        return self._local.conn

    def close(self) -> None:
        """Close this thread's connection (others close when their threads' clients go away)."""
        conn = self._shared if self._shared is not None else self._local.conn
        if conn is not None:
            conn.close()

    def _encode(self, body: dict[str, Any] | None) -> tuple[bytes | None, dict[str, str]]:
        data = None if body is None else json.dumps({"cluster": self.cluster_uid, **body}).encode()
        headers = {"Authorization": f"Bearer {self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        return data, headers

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        data, headers = self._encode(body)
        conn = self._connection()
        try:
            resp = conn.request(method, path, data, headers, timeout_s or self.timeout_s)
        except StaleConnection:  # the agent closed the idle connection; the request never reached it
            resp = conn.request(method, path, data, headers, timeout_s or self.timeout_s)
        return self._decode(path, resp)

    def _begin(self, method: str, path: str, body: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        """``_call`` in two halves: the request is written now, on this thread; the returned call
        reads its answer (on any thread, once, before anything else uses this connection)."""
        data, headers = self._encode(body)
        conn, timeout_s = self._connection(), self.timeout_s
        try:
            reused = conn.send(method, path, data, headers, timeout_s)
        except StaleConnection:
            reused = conn.send(method, path, data, headers, timeout_s)

        def answer() -> dict[str, Any]:
            try:
                resp = conn.receive(method, reused, timeout_s)
            except StaleConnection:  # closed before the request was read: it was never processed
                resp = conn.request(method, path, data, headers, timeout_s)
            return self._decode(path, resp)

        return answer

    def _decode(self, path: str, resp: Response) -> dict[str, Any]:
        if resp.status >= 400:
            try:
                doc = json.loads(resp.body)
            except ValueError:
                doc = {}
            if not isinstance(doc, dict):
                doc = {}
            raise AgentRefused(resp.status, doc.get("reason", ""), doc.get("error", resp.reason))
        doc = json.loads(resp.body)
        if not isinstance(doc, dict):
            raise AgentRefused(resp.status, "malformed", f"the agent answered {path} with a non-object")
        return doc

    def info(self) -> AgentInfo:
        """GET /v1/info, parsed (``AgentRefused`` "malformed" for an answer that is not one)."""
        doc = self._call("GET", INFO_PATH)
        try:
            return AgentInfo.parse(doc)
        except ValueError as exc:
            raise AgentRefused(200, "malformed", str(exc)) from None

    def map_pools(self, rank_id: str, gpu: int | None = None) -> MappedPools:
        """Map a rank's pools here: CPU pools are shared-memory files; GPU pools are opened through
        CUDA IPC on ``gpu`` (default: the agent's index of the pool's GPU; pass this process's
        index of the same GPU when CUDA_VISIBLE_DEVICES differs). GPU pools need torch's CUDA
        driver bindings in this process (the agent's fast-path modules)."""
        return map_rank_pools(rank_id, self.info().rank(rank_id), gpu)

    def send(
        self,
        rank: str,
        room: int,
        kv_pages: list[int],
        *,
        decode_replica: int = 0,
        state_indices: list[int] | None = None,
        aux_index: int | None = None,
    ) -> RoomView:
        """Prefill side: send room `room` from these pages to decode replica `decode_replica`."""
        return self.submit(SendRequest(rank, room, kv_pages, state_indices or [], aux_index, decode_replica))

    def receive(
        self,
        rank: str,
        room: int,
        kv_pages: list[int],
        *,
        prefill_replica: int = 0,
        state_indices: list[int] | None = None,
        aux_index: int | None = None,
    ) -> RoomView:
        """Decode side: announce where room `room` from prefill replica `prefill_replica` lands."""
        return self.submit(ReceiveRequest(rank, room, kv_pages, state_indices or [], aux_index, prefill_replica))

    def register_memory(self, msg: MemoryRegistration) -> MemoryAnswer:
        """An engine's own buffers of one rank (``memory``): the agent maps and registers them and
        moves that rank's rooms in them from now on. It may take seconds on a busy node (every
        buffer mapped and registered with the engine), so it waits ``REGISTER_TIMEOUT_S`` whatever
        the client's call timeout (the engine plugins keep theirs at 2 s for the scheduler's calls;
        SGLang's prefill server failed its start on it once, beside three others starting)."""
        timeout_s = max(self.timeout_s, REGISTER_TIMEOUT_S)
        return _answer(MemoryAnswer.parse, self._call("POST", msg.PATH, msg.to_json(), timeout_s=timeout_s))

    def abort(
        self,
        rank: str,
        room: int,
        reason: str = "aborted by the engine",
        peer_replica: int | None = None,
        peer_dp: int = 0,
    ) -> RoomView:
        """Give a room up: the agent fails it now and tells its peers (for a decode room not
        submitted yet, the agents of prefill replica ``peer_replica``, DP group ``peer_dp``)."""
        msg = AbortRequest(rank, room, reason, peer_replica, peer_dp)
        return _answer(RoomView.parse, self._call("POST", AbortRequest.PATH, msg.to_json()))

    def submit(self, msg: RoomSubmit) -> RoomView:
        """A send or receive as its wire message (long page lists travel packed: base64 int32)."""
        return _answer(RoomView.parse, self._call("POST", msg.PATH, msg.to_json()))

    def begin_submit(self, msg: RoomSubmit) -> Callable[[], RoomView]:
        """``submit`` written now; the returned call reads the agent's answer (``_begin``)."""
        answer = self._begin("POST", msg.PATH, msg.to_json())
        return lambda: _answer(RoomView.parse, answer())

    def poll(self, rank: str, room: int, wait_s: float = 0.0) -> RoomView:
        """The room's state; with wait_s > 0 the agent answers once it is final or wait_s passed."""
        path = room_path(rank, room, wait_s)
        return _answer(RoomView.parse, self._call("GET", path, timeout_s=self.timeout_s + wait_s))

    def wait(self, rank: str, room: int, timeout_s: float = 30.0) -> RoomView:
        """Long-poll until the room is Success or Failed; raises TimeoutError at the deadline."""
        deadline = time.monotonic() + timeout_s
        pause = WAIT_BACKOFF_MIN_S
        while True:
            asked = time.monotonic()
            left = deadline - asked
            view = self.poll(rank, room, wait_s=max(0.0, min(left, 10.0)))
            if view.finished:
                return view
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"room {room} on {rank} still {view.state.title} after {timeout_s} s")
            if now - asked < WAIT_BACKOFF_MIN_S:
                # Answered at once without an outcome (a state the agent does not hold the poll
                # for): back off instead of asking again at full speed.
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, WAIT_BACKOFF_MAX_S)
            else:
                pause = WAIT_BACKOFF_MIN_S
