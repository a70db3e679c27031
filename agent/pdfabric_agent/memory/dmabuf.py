"""dma-buf file descriptors of CUDA allocations: the engine side of GPUDirect RDMA by dma-buf.

An engine exports each GPU allocation that holds its KV or state as a dma-buf fd with the CUDA
driver's ``cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`` (CUDA 11.7+,
the device attribute ``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``: NVIDIA's open kernel modules; the
range must be aligned to the host page size) and hands the fds to its agent over a Unix socket
(``protocol.handover``); the agent registers each with the NIC by ``ibv_reg_dmabuf_mr``
(``memory.verbs``). The whole allocation is exported, as Mooncake's own RDMA transport does for a
device pointer it registers (``cuMemGetAddressRange`` first: torch's caching allocator places
tensors inside larger segments), so a buffer's offset inside it is its registration offset.

What a receiver can check of an fd it was handed, without any GPU: that it is a dma-buf at all (its
``/proc/self/fdinfo`` entry names the exporter, ``exp_name``) and its size (``lseek(fd, 0,
SEEK_END)``, the size discovery the kernel's dma-buf documentation describes). See docs/sglang.md,
"Engine GPU memory on rdma", for the sources.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from pdfabric_agent.memory import cuda

CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class DmabufExport:
    """One allocation's dma-buf: ``fd`` (owned by the caller: close it once handed over), the
    allocation's device address ``base`` and the exported ``nbytes`` (page-aligned)."""

    fd: int
    base: int
    nbytes: int
    device: int


def dmabuf_supported(device: int) -> tuple[bool, str]:
    """(True, "") when the driver exports `device`'s memory as dma-buf, else (False, why)."""
    try:
        cuda.primary_context(device)
        value = cuda.device_attribute(device, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
    except cuda.CudaError as exc:
        return False, f"GPU {device}: {exc} (a driver older than CUDA 11.7 knows no dma-buf export)"
    if not value:
        return False, (
            f"GPU {device} cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: "
            "dma-buf export needs NVIDIA's open kernel modules)"
        )
    return True, ""


def allocation_of(ptr: int, device: int) -> tuple[int, int]:
    """(base, page-aligned size) of the CUDA allocation holding device pointer `ptr`."""
    cuda.primary_context(device)
    base, size = cuda.address_range(ptr)
    return base, -(-size // PAGE) * PAGE


def export_allocation(ptr: int, device: int) -> DmabufExport:
    """The dma-buf of the whole allocation around `ptr`; ``cuda.CudaError`` naming why not
    (no driver support, memory that is not exportable: host memory, another process's mapping)."""
    ok, why = dmabuf_supported(device)
    if not ok:
        raise cuda.CudaError(why)
    base, size = allocation_of(ptr, device)
    if base % PAGE:
        raise cuda.CudaError(f"allocation at {base:#x} is not aligned to the host page size ({PAGE})")
    fd = ctypes.c_int(-1)
    cuda.check(
        cuda.cu().cuMemGetHandleForAddressRange(
            ctypes.byref(fd),
            cuda.CUdeviceptr(base),
            ctypes.c_size_t(size),
            ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD),
            ctypes.c_ulonglong(0),
        ),
        f"cuMemGetHandleForAddressRange(DMA_BUF_FD, {size} bytes at {base:#x})",
    )
    return DmabufExport(fd.value, base, size, device)


def dmabuf_exporter(fd: int) -> str | None:
    """The exporter's name when `fd` is a dma-buf (``exp_name`` in its fdinfo; on kernels whose
    fdinfo lacks it, "unnamed" when the fd's link names a dma-buf), else None."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "exp_name":
                    return value.strip() or "unnamed"
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return "unnamed" if link.startswith(("/dmabuf:", "anon_inode:dmabuf")) else None


def fd_size(fd: int) -> int | None:
    """Bytes behind `fd` by ``lseek(fd, 0, SEEK_END)`` (a dma-buf's size), None when it cannot seek."""
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        return None
    return size
