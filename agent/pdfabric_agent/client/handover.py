"""The engine side of the dma-buf hand-over: export each GPU allocation behind a rank's KV and state
buffers as a dma-buf fd (``memory.dmabuf``) and pass the fds to the node's agent over its Unix
socket (``protocol.handover``), which registers them with the NIC for GPUDirect RDMA.

``hand_over_gpu_buffers`` is what an engine calls (the SGLang plugin with KVArgs' pointers, the
reference engine with its tensors' pointers); ``hand_over`` sends fds already made (tests hand over
memfds and other fds through it). The engine's own fds are closed once sent: the agent holds its
own copies, and the NIC's registration the kernel's reference.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.dmabuf import DmabufExport, export_allocation
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.handover import (
    Allocation,
    DmabufHandover,
    HandoverAnswer,
    close_fds,
    recv_frame,
    send_frame,
)
from pdfabric_agent.protocol.labels import Refusal


class HandoverRefused(RuntimeError):
    """The agent refused the hand-over (``status``, ``reason`` as on the engine door), or the engine
    could not make it (status 0: an export failed, the socket is not there)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message = status, reason, message


def hand_over(path: str, msg: DmabufHandover, fds: Sequence[int], *, timeout_s: float = 10.0) -> HandoverAnswer:
    """Send `msg` with `fds` (one per allocation, in order; still the caller's to close) and read the
    agent's answer; ``HandoverRefused`` for a refusal or a door that is not there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            try:
                send_frame(sock, msg.to_json(), fds)
            except OSError:
                # A door that refuses at once (429 at its bound) writes its answer and closes without
                # reading ours: our write may break, its answer is still there to read.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            doc, stray = recv_frame(sock, max_fds=1)
            close_fds(stray)
    except ApiError as exc:
        raise HandoverRefused(0, exc.reason.value, f"the agent's answer is not a frame: {exc.message}") from None
    except OSError as exc:
        raise HandoverRefused(0, Refusal.INTERNAL.value, f"no hand-over with the agent at {path}: {exc}") from None
    if "status" in doc:
        raise HandoverRefused(int(doc["status"]), str(doc.get("reason", "")), str(doc.get("error", "")))
    return HandoverAnswer.parse(doc)


def export_buffers(ptrs: Sequence[int], device: int) -> list[DmabufExport]:
    """One dma-buf per distinct allocation among `ptrs` (buffers often share one), in first-seen
    order; ``HandoverRefused`` naming the buffer that cannot be exported (all fds made are closed)."""
    exports: list[DmabufExport] = []
    seen: set[int] = set()
    try:
        for i, ptr in enumerate(ptrs):
            try:
                cuda.primary_context(device)
                base, _ = cuda.address_range(ptr)
                if base in seen:
                    continue
                exports.append(export_allocation(ptr, device))
            except cuda.CudaError as exc:
                raise HandoverRefused(0, "not_exportable", f"buffer {i} at {ptr:#x} on GPU {device}: {exc}") from None
            seen.add(base)
    except BaseException:
        close_fds([e.fd for e in exports])
        raise
    return exports


def hand_over_gpu_buffers(
    path: str, *, token: str, cluster: str, rank: str, ptrs: Sequence[int], device: int, timeout_s: float = 10.0
) -> HandoverAnswer:
    """Export the allocations behind `ptrs` and hand them to the agent at `path` for the NIC."""
    exports = export_buffers(ptrs, device)
    try:
        allocations = []
        for e in exports:
            handle = ""
            with contextlib.suppress(cuda.CudaError):  # ties it to the /v1/memory share; optional
                handle = cuda.ipc_get_handle(e.base).hex()
            allocations.append(Allocation(e.nbytes, e.base, device, handle))
        msg = DmabufHandover(cluster, token, rank, tuple(allocations))
        return hand_over(path, msg, [e.fd for e in exports], timeout_s=timeout_s)
    finally:
        close_fds([e.fd for e in exports])
