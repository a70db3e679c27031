"""CUDA IPC of pools between processes, and the shared completion board.

A pool is exported as the legacy IPC handle of the cudaMalloc allocation that holds it plus the
pool's offset inside that allocation (torch's caching allocator may place a tensor inside a larger
segment). Pools from cuMemCreate (torch's expandable segments, fabric memory) have no legacy
handle: export fails and the caller keeps the engine path.

The completion board is a small file in the agent's shared-memory directory that the sender pins
and maps for its kernels and the receiver reads from the CPU (`pdfabric_agent.memory.completion`): the
kernel's last block stores the request's sequence number there after a system-scope fence, so
seeing the number means the data have landed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.completion import BOARD_BYTES, BOARD_SLOTS

_PAGE = 4096


class ExportDoc(TypedDict):
    """`PoolExport` as JSON: the handle in hex."""

    handle: str
    offset: int
    nbytes: int
    device: int
    owner_pid: int


@dataclass(frozen=True)
class PoolExport:
    """What travels (pickled, or as JSON with the handle in hex) from the pool owner to the sender."""

    handle: bytes
    offset: int
    nbytes: int
    device: int
    owner_pid: int

    def to_json(self) -> ExportDoc:
        return {
            "handle": self.handle.hex(),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "device": self.device,
            "owner_pid": self.owner_pid,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PoolExport:
        """From a parsed JSON document (``to_json``'s, read back: any JSON until checked here)."""
        return cls(
            bytes.fromhex(d["handle"]), int(d["offset"]), int(d["nbytes"]), int(d["device"]), int(d["owner_pid"])
        )


def export_pool(ptr: int, nbytes: int, device: int) -> PoolExport:
    cuda.primary_context(device)
    base, size = cuda.address_range(ptr)
    if ptr + nbytes > base + size:
        raise cuda.CudaError(f"pool at {ptr:#x}+{nbytes} spans more than one allocation")
    return PoolExport(cuda.ipc_get_handle(base), ptr - base, nbytes, device, os.getpid())


# CUDA opens a handle once per process and device: an engine's buffer is opened by the agent that
# registered it and again by this process's sender mapping the peer (one agent serving both
# ranks), so openings are shared and counted: (handle, device) -> [base, users].
_OPENED: dict[tuple[bytes, int], list[int]] = {}
_OPENED_LOCK = threading.Lock()


def _open(handle: bytes, device: int) -> int:
    with _OPENED_LOCK:
        entry = _OPENED.get((handle, device))
        if entry is None:
            cuda.primary_context(device)
            entry = _OPENED[(handle, device)] = [cuda.ipc_open_handle(handle), 0]
        entry[1] += 1
        return entry[0]


def _release(handle: bytes, device: int) -> None:
    with _OPENED_LOCK:
        entry = _OPENED.get((handle, device))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            cuda.primary_context(device)
            cuda.ipc_close(entry[0])
            del _OPENED[(handle, device)]


class PeerMappings:
    """Opened peer allocations of one user in this process, keyed by handle (each opened once)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._bases: dict[bytes, int] = {}

    def map(self, export: PoolExport) -> int:
        if export.owner_pid == os.getpid():
            raise ValueError("a process cannot open its own IPC handle; pass the local pointer instead")
        base = self._bases.get(export.handle)
        if base is None:
            base = self._bases[export.handle] = _open(export.handle, self.device)
        return base + export.offset

    def close(self) -> None:
        for handle in self._bases:
            _release(handle, self.device)
        self._bases.clear()


class CompletionBoard:
    """BOARD_SLOTS monotonically rising u64 sequence numbers in shared memory."""

    def __init__(self, name: str | None = None, *, create: bool = True, directory: str = "/dev/shm") -> None:
        self.name = name or f"pdfabric-board-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, self.name)
        size = -(-BOARD_BYTES // _PAGE) * _PAGE
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self._words = (ctypes.c_uint64 * BOARD_SLOTS).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._words)
        self._owner = create
        self._device_ptr: dict[int, int] = {}

    def read(self, slot: int) -> int:
        return self._words[slot]

    def device_pointer(self, device: int, slot: int) -> int:
        """The address a kernel on `device` stores a slot's sequence number through (pins once)."""
        if device not in self._device_ptr:
            cuda.primary_context(device)
            # PORTABLE registration is valid in every context, so one registration serves all devices.
            if not self._device_ptr:
                try:
                    self._device_ptr[device] = cuda.host_register(self.addr, self.size)
                except cuda.CudaError as exc:
                    # Pages of a file on disk cannot be pinned; those of a tmpfs (/dev/shm) can.
                    raise cuda.CudaError(
                        f"completion board {self.path} cannot be pinned for the GPU ({exc}); "
                        "the shared-memory directory (PDFABRIC_SHM_DIR) must be a tmpfs such as /dev/shm"
                    ) from None
            else:
                self._device_ptr[device] = next(iter(self._device_ptr.values()))
        return self._device_ptr[device] + 8 * slot

    def close(self) -> None:
        if self._device_ptr:
            with contextlib.suppress(cuda.CudaError):
                cuda.host_unregister(self.addr)
            self._device_ptr.clear()
        del self._words
        self._mm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
