"""Thin ctypes bindings to the CUDA driver API and NVRTC, only what the fast path needs.

Why ctypes and not cuda-python: the C ABI of libcuda and libnvrtc is stable across the driver and
toolkit versions we meet (the GPU machines carry older cuda-bindings than the project pins, with
another Python surface), and nothing here needs more than a dozen calls. Loading never happens at
import time: a machine without a driver imports this module fine and `available()` says why not.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
from collections.abc import Sequence
from typing import TypeAlias

CUDA_SUCCESS = 0
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128  # CUDA 12.3+ drivers; older ones refuse the attribute
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2

CUdeviceptr = ctypes.c_uint64


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed; the message names the call and the error."""


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemAllocationFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h), what cuMemCreate allocates."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", MemAllocationFlags),
    ]


_libcuda: ctypes.CDLL | None = None
_libnvrtc: ctypes.CDLL | None = None
_load_error: str | None = None


def _load_cuda() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"the CUDA driver library is not loadable here: {exc}") from exc
        rc = lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise CudaError(f"cuInit failed with CUresult {rc}")
        _libcuda = lib
    return _libcuda


def _nvrtc_candidates() -> list[str]:
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in roots:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnvrtc.so*"), recursive=True), reverse=True)
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"), reverse=True)
    extra = os.environ.get("PDFABRIC_NVRTC")
    return [extra, *names] if extra else names


def _load_nvrtc() -> ctypes.CDLL:
    global _libnvrtc
    if _libnvrtc is None:
        errors = []
        for name in _nvrtc_candidates():
            if "builtins" in name or "alt" in os.path.basename(name):
                continue
            try:
                _libnvrtc = ctypes.CDLL(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        if _libnvrtc is None:
            raise CudaError("NVRTC is not loadable here (set PDFABRIC_NVRTC to libnvrtc.so): " + "; ".join(errors[:3]))
    return _libnvrtc


def available() -> tuple[bool, str]:
    """(True, "") when the driver and NVRTC both load, else (False, why)."""
    try:
        _load_cuda()
        _load_nvrtc()
    except CudaError as exc:
        return False, str(exc)
    return True, ""


def check(rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        name = ctypes.c_char_p()
        lib = _libcuda
        label = str(rc)
        if lib is not None and lib.cuGetErrorName(rc, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            label = f"{name.value.decode()} ({rc})"
        raise CudaError(f"{what} failed: {label}")


def cu() -> ctypes.CDLL:
    return _load_cuda()


def device_count() -> int:
    n = ctypes.c_int()
    check(cu().cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    return n.value


def device_attribute(device: int, attr: int) -> int:
    v = ctypes.c_int()
    check(cu().cuDeviceGetAttribute(ctypes.byref(v), attr, device), "cuDeviceGetAttribute")
    return v.value


def fabric_memory(device: int) -> tuple[bool, str]:
    """(True, "") when `device` can allocate memory with a FABRIC handle (multi-node NVLink), else
    (False, why). The attribute says the GPU and driver can; only an allocation says this process
    may: without an IMEX channel in the container (nvidia-imex on the hosts, the channel device in
    the pod) cuMemCreate refuses FABRIC handles though the attribute is 1 (H100 nodes without an
    NVLink switch fabric report 1 too). So one granule is allocated and released at once."""
    try:
        supported = device_attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
    except CudaError as exc:
        return False, f"GPU {device}: {exc} (a driver older than CUDA 12.3 knows no fabric handles)"
    if not supported:
        return (
            False,
            f"GPU {device} has no fabric handle support (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0)",
        )
    prop = MemAllocationProp(
        type=CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes=CU_MEM_HANDLE_TYPE_FABRIC,
        location=MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device),
    )
    granule, handle = ctypes.c_size_t(), ctypes.c_ulonglong()
    try:
        primary_context(device)
        lib = cu()
        rc = lib.cuMemGetAllocationGranularity(
            ctypes.byref(granule), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        check(rc, "cuMemGetAllocationGranularity(FABRIC)")
        check(
            lib.cuMemCreate(ctypes.byref(handle), granule, ctypes.byref(prop), ctypes.c_ulonglong(0)),
            "cuMemCreate(FABRIC)",
        )
        check(lib.cuMemRelease(handle), "cuMemRelease")
    except CudaError as exc:
        return False, f"GPU {device}: {exc} (no IMEX channel in the container?)"
    return True, ""


_contexts: dict[int, ctypes.c_void_p] = {}


def primary_context(device: int) -> ctypes.c_void_p:
    """Make the device's primary context (the one torch's runtime uses) current; retained once."""
    ctx = _contexts.get(device)
    if ctx is None:
        ctx = ctypes.c_void_p()
        check(cu().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        _contexts[device] = ctx
    check(cu().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def can_access_peer(device: int, peer: int) -> bool:
    v = ctypes.c_int()
    check(cu().cuDeviceCanAccessPeer(ctypes.byref(v), device, peer), "cuDeviceCanAccessPeer")
    return bool(v.value)


def enable_peer_access(device: int, peer: int) -> None:
    """Let kernels on `device` read and write `peer`'s memory (idempotent)."""
    peer_ctx = primary_context(peer)
    primary_context(device)
    rc = cu().cuCtxEnablePeerAccess(peer_ctx, 0)
    if rc not in (CUDA_SUCCESS, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        check(rc, f"cuCtxEnablePeerAccess({device} -> {peer})")


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation that holds `ptr`."""
    base, size = CUdeviceptr(), ctypes.c_size_t()
    check(
        cu().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), CUdeviceptr(ptr)), "cuMemGetAddressRange"
    )
    return base.value, size.value


def ipc_get_handle(base: int) -> bytes:
    h = IpcMemHandle()
    check(cu().cuIpcGetMemHandle(ctypes.byref(h), CUdeviceptr(base)), "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(h), 64)  # .reserved would stop at the first NUL byte


def ipc_open_handle(handle: bytes) -> int:
    """Map a peer process's allocation into the current context (peer access enabled lazily)."""
    h = IpcMemHandle()
    ctypes.memmove(ctypes.addressof(h), handle, 64)
    ptr = CUdeviceptr()
    fn = cu().cuIpcOpenMemHandle_v2
    fn.argtypes = [ctypes.POINTER(CUdeviceptr), IpcMemHandle, ctypes.c_uint]
    check(fn(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    return ptr.value


def ipc_close(ptr: int) -> None:
    check(cu().cuIpcCloseMemHandle(CUdeviceptr(ptr)), "cuIpcCloseMemHandle")


def mem_alloc(nbytes: int) -> int:
    ptr = CUdeviceptr()
    check(cu().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
    return ptr.value


def mem_free(ptr: int) -> None:
    check(cu().cuMemFree_v2(CUdeviceptr(ptr)), "cuMemFree")


def memset_d8(ptr: int, value: int, nbytes: int) -> None:
    check(cu().cuMemsetD8_v2(CUdeviceptr(ptr), ctypes.c_ubyte(value), ctypes.c_size_t(nbytes)), "cuMemsetD8")


def host_register(addr: int, nbytes: int) -> int:
    """Pin host memory (e.g. a shared-memory mapping) and return the pointer kernels write through."""
    check(
        cu().cuMemHostRegister_v2(
            ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        ),
        "cuMemHostRegister",
    )
    dptr = CUdeviceptr()
    check(cu().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), 0), "cuMemHostGetDevicePointer")
    return dptr.value


def host_unregister(addr: int) -> None:
    check(cu().cuMemHostUnregister(ctypes.c_void_p(addr)), "cuMemHostUnregister")


def memcpy_htod_async(dst: int, src_host: int, nbytes: int, stream: int) -> None:
    check(
        cu().cuMemcpyHtoDAsync_v2(
            CUdeviceptr(dst), ctypes.c_void_p(src_host), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)
        ),
        "cuMemcpyHtoDAsync",
    )


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Unified-address copy (the copy engines); used for the bulk ceiling and as a reference."""
    check(
        cu().cuMemcpyAsync(CUdeviceptr(dst), CUdeviceptr(src), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)),
        "cuMemcpyAsync",
    )


def memcpy_dtoh(dst_host: int, src: int, nbytes: int) -> None:
    """Device (or IPC-mapped peer) memory to host memory; returns once the bytes are there."""
    check(cu().cuMemcpyDtoH_v2(ctypes.c_void_p(dst_host), CUdeviceptr(src), ctypes.c_size_t(nbytes)), "cuMemcpyDtoH")


def memcpy_htod(dst: int, src_host: int, nbytes: int) -> None:
    check(cu().cuMemcpyHtoD_v2(CUdeviceptr(dst), ctypes.c_void_p(src_host), ctypes.c_size_t(nbytes)), "cuMemcpyHtoD")


def stream_synchronize(stream: int) -> None:
    check(cu().cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")


# ---- NVRTC -------------------------------------------------------------------------------------


def _nvrtc_check(rc: int, what: str) -> None:
    if rc != 0:
        lib = _load_nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CudaError(f"{what} failed: {lib.nvrtcGetErrorString(rc).decode()}")


def nvrtc_compile(source: str, name: str, options: Sequence[str], *, cubin: bool) -> bytes:
    """Compile CUDA C to a cubin (cubin=True, needs -arch=sm_XY) or PTX; raises with the log."""
    lib = _load_nvrtc()
    prog = ctypes.c_void_p()
    _nvrtc_check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None), "nvrtcCreateProgram"
    )
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CudaError(f"NVRTC could not compile {name}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if cubin:
            _nvrtc_check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            out = ctypes.create_string_buffer(size.value)
            _nvrtc_check(lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        else:
            _nvrtc_check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            out = ctypes.create_string_buffer(size.value)
            _nvrtc_check(lib.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def module_load(image: bytes) -> ctypes.c_void_p:
    mod = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(image, len(image))
    check(cu().cuModuleLoadData(ctypes.byref(mod), buf), "cuModuleLoadData")
    return mod


def module_function(mod: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
    fn = ctypes.c_void_p()
    check(cu().cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction({name})")
    return fn


# Kernel arguments: scalars (c_int, c_uint64, ...) and structures (a table passed by value).
KernelArg: TypeAlias = "ctypes._SimpleCData[int] | ctypes.Structure"  # a string: not subscriptable at run time


def kernel_params(args: Sequence[KernelArg]) -> ctypes.Array[ctypes.c_void_p]:
    """The void*[] cuLaunchKernel reads; build once over argument objects that are refilled in place."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])


def launch_params(
    fn: ctypes.c_void_p, grid: int, block: int, stream: int, params: ctypes.Array[ctypes.c_void_p]
) -> None:
    rc = cu().cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), params, None)
    if rc != CUDA_SUCCESS:
        check(rc, "cuLaunchKernel")


def launch(fn: ctypes.c_void_p, grid: int, block: int, stream: int, args: Sequence[KernelArg]) -> None:
    params = kernel_params(args)
    check(
        cu().cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), params, None),
        "cuLaunchKernel",
    )
