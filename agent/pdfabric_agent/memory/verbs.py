"""A thin ctypes binding to libibverbs (rdma-core): only what registering a dma-buf with a NIC needs.

``ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`` (rdma-core 34+, symbol version
IBVERBS_1.12; Linux 5.12+ with a provider that implements it, mlx5 among them) registers bytes
[offset, offset + length) of a dma-buf as a memory region whose lkey / rkey address it at ``iova``
(the man page: iova must have the same page offset as offset). The kernel takes its own reference to
the dma-buf, so the caller's fd may be closed once registered.

Why ctypes, as ``memory.cuda``: the C ABI of libibverbs is stable, and four calls do not justify
building pyverbs. Nothing loads at import: a machine without libibverbs or without an RDMA device
imports this module, and every call that cannot be honoured raises ``VerbsError`` with ``kind``
(what the agent tells the engine) and the errno, never crashes.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 1 << 1
IBV_ACCESS_REMOTE_READ = 1 << 2
IBV_ACCESS_RELAXED_ORDERING = 1 << 20  # an optional flag: ignored by devices without it
# What a KV buffer needs: peers write into it (decode) and it is read locally (prefill).
KV_ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_RELAXED_ORDERING
LIBRARY = "libibverbs.so.1"


class IbvMr(ctypes.Structure):
    """struct ibv_mr (infiniband/verbs.h): what a registration returns."""

    _fields_ = [
        ("context", ctypes.c_void_p),
        ("pd", ctypes.c_void_p),
        ("addr", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("handle", ctypes.c_uint32),
        ("lkey", ctypes.c_uint32),
        ("rkey", ctypes.c_uint32),
    ]


# name -> (restype, argtypes), as infiniband/verbs.h declares them.
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ibv_get_device_list": (ctypes.POINTER(ctypes.c_void_p), [ctypes.POINTER(ctypes.c_int)]),
    "ibv_free_device_list": (None, [ctypes.POINTER(ctypes.c_void_p)]),
    "ibv_get_device_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ibv_open_device": (ctypes.c_void_p, [ctypes.c_void_p]),
    "ibv_close_device": (ctypes.c_int, [ctypes.c_void_p]),
    "ibv_alloc_pd": (ctypes.c_void_p, [ctypes.c_void_p]),
    "ibv_dealloc_pd": (ctypes.c_int, [ctypes.c_void_p]),
    "ibv_reg_dmabuf_mr": (
        ctypes.POINTER(IbvMr),
        [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_int],
    ),
    "ibv_dereg_mr": (ctypes.c_int, [ctypes.POINTER(IbvMr)]),
}


class Failure(enum.StrEnum):
    """Why a NIC registration cannot be honoured (the agent's refusal says which)."""

    NO_LIBRARY = "no_library"  # libibverbs is not loadable
    NO_DMABUF_VERBS = "no_dmabuf_verbs"  # rdma-core older than 34: no ibv_reg_dmabuf_mr
    NO_DEVICE = "no_device"  # no RDMA device (or not the one named)
    DEVICE = "device"  # opening the device or its protection domain failed
    NO_DMABUF_SUPPORT = "no_dmabuf_support"  # the kernel or the NIC's driver has no dma-buf MRs (EOPNOTSUPP)
    REFUSED = "refused"  # the registration itself failed (errno says why)


class VerbsError(RuntimeError):
    def __init__(self, failure: Failure, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.failure = failure
        self.errno = errno


def _errno_text(errno: int) -> str:
    return f"errno {errno} ({os.strerror(errno)})" if errno else "no errno"


def _no_list(errno: int) -> str:
    return f"no RDMA device is visible here (ibv_get_device_list returned none: {_errno_text(errno)})"


class Verbs:
    """The library with its signatures set; ``lib`` is anything with those functions (tests pass
    ctypes callbacks to see the arguments exactly as marshalled)."""

    def __init__(self, lib: Any, get_errno: Callable[[], int] = ctypes.get_errno) -> None:
        for name, (restype, argtypes) in SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                if name == "ibv_reg_dmabuf_mr":
                    raise VerbsError(
                        Failure.NO_DMABUF_VERBS,
                        "libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than 34): install rdma-core 34 or later",
                    ) from None
                raise VerbsError(Failure.NO_LIBRARY, f"libibverbs lacks {name}") from None
            fn.restype, fn.argtypes = restype, argtypes
        self.lib = lib
        self.get_errno = get_errno

    @classmethod
    def load(cls, name: str = LIBRARY) -> Verbs:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise VerbsError(
                Failure.NO_LIBRARY, f"{name} is not loadable here ({exc}): install rdma-core's libibverbs"
            ) from None
        return cls(lib)

    def device_names(self) -> list[str]:
        n = ctypes.c_int(0)
        devices = self.lib.ibv_get_device_list(ctypes.byref(n))
        if not devices:
            raise VerbsError(Failure.NO_DEVICE, _no_list(self.get_errno()))
        try:
            return [self.lib.ibv_get_device_name(devices[i]).decode(errors="replace") for i in range(n.value)]
        finally:
            self.lib.ibv_free_device_list(devices)

    def open(self, device: str | None = None) -> NicDomain:
        """A protection domain on `device` (the first RDMA device when None)."""
        n = ctypes.c_int(0)
        devices = self.lib.ibv_get_device_list(ctypes.byref(n))
        if not devices:
            raise VerbsError(Failure.NO_DEVICE, _no_list(self.get_errno()))
        try:
            names = [self.lib.ibv_get_device_name(devices[i]).decode(errors="replace") for i in range(n.value)]
            if not names:
                raise VerbsError(Failure.NO_DEVICE, "no RDMA device is visible here (ibv_get_device_list found none)")
            index = 0 if device is None else (names.index(device) if device in names else -1)
            if index < 0:
                raise VerbsError(Failure.NO_DEVICE, f"no RDMA device {device!r} here; there are {names}")
            context = self.lib.ibv_open_device(devices[index])
        finally:
            self.lib.ibv_free_device_list(devices)
        if not context:
            raise VerbsError(Failure.DEVICE, f"ibv_open_device({names[index]}) failed: {_errno_text(self.get_errno())}")
        pd = self.lib.ibv_alloc_pd(context)
        if not pd:
            errno = self.get_errno()
            self.lib.ibv_close_device(context)
            raise VerbsError(Failure.DEVICE, f"ibv_alloc_pd on {names[index]} failed: {_errno_text(errno)}", errno)
        return NicDomain(self, names[index], context, pd)


@dataclass(frozen=True)
class MemoryRegion:
    """A registered dma-buf range: the keys a peer's RDMA write (rkey) and a local post (lkey) use."""

    device: str
    iova: int
    length: int
    lkey: int
    rkey: int
    handle: Any  # the ibv_mr pointer, for ``NicDomain.deregister``


class NicDomain:
    """One device context and protection domain; registrations in it. Thread-safe."""

    def __init__(self, verbs: Verbs, name: str, context: int, pd: int) -> None:
        self.verbs, self.name = verbs, name
        self._context: int = context
        self._pd: int | None = pd
        self._lock = threading.Lock()
        self._regions: list[MemoryRegion] = []

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int, access: int = KV_ACCESS) -> MemoryRegion:
        """``ibv_reg_dmabuf_mr``; ``VerbsError`` (NO_DMABUF_SUPPORT for EOPNOTSUPP, else REFUSED)."""
        if offset % mmap.PAGESIZE != iova % mmap.PAGESIZE:
            raise VerbsError(Failure.REFUSED, f"iova {iova:#x} and offset {offset:#x} differ in their page offset")
        with self._lock:
            if self._pd is None:
                raise VerbsError(Failure.DEVICE, f"the protection domain on {self.name} is closed")
            mr = self.verbs.lib.ibv_reg_dmabuf_mr(self._pd, offset, length, iova, fd, access)
            if not mr:
                errno = self.verbs.get_errno()
                failure = Failure.NO_DMABUF_SUPPORT if errno in (95, 38) else Failure.REFUSED  # EOPNOTSUPP, ENOSYS
                raise VerbsError(
                    failure,
                    f"ibv_reg_dmabuf_mr on {self.name} ({length} bytes at offset {offset} of dma-buf fd {fd}) "
                    f"failed: {_errno_text(errno)}",
                    errno,
                )
            region = MemoryRegion(self.name, iova, length, int(mr.contents.lkey), int(mr.contents.rkey), mr)
            self._regions.append(region)
            return region

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            if region in self._regions:
                self._regions.remove(region)
                self.verbs.lib.ibv_dereg_mr(region.handle)

    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def close(self) -> None:
        with self._lock:
            for region in self._regions:
                self.verbs.lib.ibv_dereg_mr(region.handle)
            self._regions.clear()
            if self._pd is not None:
                self.verbs.lib.ibv_dealloc_pd(self._pd)
                self.verbs.lib.ibv_close_device(self._context)
                self._pd = None
