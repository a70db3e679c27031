"""The dma-buf hand-over: an engine passes the dma-buf fds of its GPU KV and state allocations to its
node's agent over a Unix domain socket (``SCM_RIGHTS``), for the agent to register them with the NIC
(GPUDirect RDMA on rdma; docs/sglang.md, "Engine GPU memory on rdma").

One connection carries one exchange: the engine sends a frame (a 4-byte big-endian length, then a
JSON ``DmabufHandover``) with one fd per allocation attached to its first byte; the agent answers
with a frame of its own, a ``HandoverAnswer`` or a refusal (``{"status", "reason", "error"}``, the
statuses and reasons of the engine door). The message names the cluster and carries the engine
token, as every engine-door request does; fds are never taken from a message that fails a check
(the receiver closes every fd it got before it answers a refusal).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pdfabric_agent.protocol.errors import ApiError, malformed
from pdfabric_agent.protocol.fields import MAX_STR, check_object, check_str, field_int, field_str, too_large
from pdfabric_agent.protocol.labels import Refusal

SCM_MAX_FD = 253  # Linux: the most fds one SCM_RIGHTS message carries
MAX_FRAME = 1 << 16
_LEN = struct.Struct(">I")


def socket_path(shm_dir: str, cluster_uid: str) -> str:
    """Where a cluster's agent takes hand-overs: beside its pool files in the shared-memory directory,
    which its engines share (``PDFABRIC_SHM_DIR``); the engine learns the uid from /v1/info."""
    return os.path.join(shm_dir, f"pdfabric-{cluster_uid[:8]}-nic.sock")


@dataclass(frozen=True)
class Allocation:
    """One GPU allocation handed over: ``nbytes`` exported from its start, at device address ``base``
    in the engine (the NIC registration's iova: peers address it with the engine's own pointers, as
    SGLang's KVArgs give them) on GPU ``device``; ``ipc_handle`` (hex, optional) ties it to the CUDA
    IPC export the engine registers on /v1/memory."""

    nbytes: int
    base: int
    device: int
    ipc_handle: str = ""

    @classmethod
    def parse(cls, value: Any, name: str) -> Self:
        d = check_object(value, name)
        handle = d.get("ipc_handle", "")
        if not isinstance(handle, str) or len(handle) > 256 or any(c not in "0123456789abcdef" for c in handle):
            raise malformed(f"{name}.ipc_handle must be a CUDA IPC handle in lowercase hex")
        nbytes, base = field_int(d, "nbytes", minimum=1), field_int(d, "base")
        if base % 4096:
            raise malformed(f"{name}.base must be page-aligned (a dma-buf is exported from an allocation's start)")
        return cls(nbytes, base, field_int(d, "device", maximum=1 << 16), handle)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"nbytes": self.nbytes, "base": self.base, "device": self.device}
        if self.ipc_handle:
            body["ipc_handle"] = self.ipc_handle
        return body


@dataclass(frozen=True)
class DmabufHandover:
    """Engine -> agent: rank `rank`'s GPU allocations, one dma-buf fd each, in order."""

    KIND: ClassVar[str] = "dmabuf-handover"

    cluster: str
    token: str
    rank: str
    allocations: tuple[Allocation, ...]

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        if body.get("kind") != cls.KIND:
            raise malformed(f"field 'kind' must be {cls.KIND!r}")
        raw = body.get("allocations")
        if not isinstance(raw, list) or not raw:
            raise malformed("field 'allocations' must be a non-empty list, one entry per fd")
        if len(raw) > SCM_MAX_FD:
            raise too_large(f"{len(raw)} allocations; one hand-over carries at most {SCM_MAX_FD} fds")
        token = body.get("token")
        if not isinstance(token, str) or len(token) > 4096:
            raise ApiError(401, Refusal.UNAUTHORIZED, "missing or wrong engine token")
        return cls(
            cluster=check_str(body.get("cluster"), "cluster", limit=MAX_STR),
            token=token,
            rank=field_str(body, "rank"),
            allocations=tuple(Allocation.parse(a, f"allocations[{i}]") for i, a in enumerate(raw)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.KIND,
            "cluster": self.cluster,
            "token": self.token,
            "rank": self.rank,
            "allocations": [a.to_json() for a in self.allocations],
        }


@dataclass(frozen=True)
class Registered:
    """One allocation as the NIC holds it: the keys peers address it with, at ``iova``."""

    nbytes: int
    exporter: str  # the dma-buf's exporter, from the kernel
    nic: str
    iova: int
    lkey: int
    rkey: int

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("nbytes", "exporter", "nic", "iova", "lkey", "rkey")}

    @classmethod
    def parse(cls, value: Any) -> Self:
        d = check_object(value, "registered")
        return cls(
            field_int(d, "nbytes"), field_str(d, "exporter"), field_str(d, "nic"),
            field_int(d, "iova"), field_int(d, "lkey"), field_int(d, "rkey"),
        )  # fmt: skip


@dataclass(frozen=True)
class HandoverAnswer:
    rank: str
    registered: tuple[Registered, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "registered": [r.to_json() for r in self.registered]}

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        raw = body.get("registered")
        if not isinstance(raw, list):
            raise malformed("field 'registered' must be a list")
        return cls(field_str(body, "rank"), tuple(Registered.parse(r) for r in raw))


def refusal_json(exc: ApiError) -> dict[str, Any]:
    return {"status": exc.status, "reason": exc.reason.value, "error": exc.message}


# ---------------------------------------------------------------- framing
def send_frame(sock: socket.socket, doc: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """One frame; `fds` ride on its first byte (the receiver's ``recv_frame`` takes them there)."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"a frame of {len(body)} bytes; at most {MAX_FRAME}")
    if len(fds) > SCM_MAX_FD:
        raise ValueError(f"{len(fds)} fds; one message carries at most {SCM_MAX_FD}")
    data = _LEN.pack(len(body)) + body
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket, max_fds: int = SCM_MAX_FD) -> tuple[dict[str, Any], list[int]]:
    """A frame and the fds that came with it (close-on-exec; the caller owns them, also when this
    raises: then they are closed here). ``ApiError`` for a frame that is not one; ``OSError`` /
    ``TimeoutError`` from the socket (its timeout bounds every read)."""
    fds: list[int] = []
    try:
        data, ancdata, flags, _ = sock.recvmsg(
            _LEN.size + MAX_FRAME, socket.CMSG_SPACE(max_fds * 4), socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(array.array("i", payload[:usable]))
        if flags & socket.MSG_CTRUNC:
            raise too_large(f"more fds than the {max_fds} one hand-over may carry")
        if len(data) < _LEN.size:
            data += _recv_exactly(sock, _LEN.size - len(data))
        (length,) = _LEN.unpack_from(data)
        if length > MAX_FRAME:
            raise too_large(f"a frame of {length} bytes; at most {MAX_FRAME}")
        body = data[_LEN.size :]
        if len(body) < length:
            body += _recv_exactly(sock, length - len(body))
        if len(body) > length:
            raise malformed("bytes after the frame: one exchange per connection")
        try:
            doc = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError):
            raise malformed("the frame is not a JSON document") from None
        if not isinstance(doc, dict):
            raise malformed("the frame must be a JSON object")
        return doc, fds
    except BaseException:
        close_fds(fds)
        raise


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = sock.recv(min(n, MAX_FRAME))
        if not chunk:
            raise malformed("the connection closed inside a frame")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
