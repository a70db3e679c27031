"""A fake libibverbs for unit tests (test_nic_verbs.py, test_dmabuf_handover.py): real ctypes
callbacks with infiniband/verbs.h's C signatures, so every argument crosses the same C
marshalling as with libibverbs; calls are recorded, failures chosen per instance."""

from __future__ import annotations

import ctypes
import errno as errno_codes
from types import SimpleNamespace
from typing import Any

from pdfabric_agent.memory import verbs
from pdfabric_agent.memory.verbs import Verbs

P = ctypes.c_void_p
DEVICE_LIST = ctypes.CFUNCTYPE(P, ctypes.POINTER(ctypes.c_int))
VOID_OF_PTR = ctypes.CFUNCTYPE(None, P)
NAME_OF = ctypes.CFUNCTYPE(P, P)  # char*: a c_char_p result of a callback would leak
PTR_OF = ctypes.CFUNCTYPE(P, P)
INT_OF = ctypes.CFUNCTYPE(ctypes.c_int, P)
REG_DMABUF = ctypes.CFUNCTYPE(P, P, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_int)


class FakeVerbs:
    """libibverbs with `names` devices; records calls; ``reg_errno`` makes registration fail."""

    def __init__(
        self, names: tuple[str, ...] = ("mlx5_0", "mlx5_1"), *, reg_errno: int = 0, pd_fails: bool = False
    ) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.errno = 0
        self.names = [ctypes.create_string_buffer(n.encode()) for n in names]
        self.list = (P * (len(names) + 1))(*[ctypes.addressof(b) for b in self.names], None)
        self.mrs: list[verbs.IbvMr] = []
        self.reg_errno, self.pd_fails = reg_errno, pd_fails
        self.open_contexts: set[int] = set()

        def get_device_list(num: Any) -> int | None:
            num[0] = len(names)
            self.calls.append(("list",))
            if not names:
                self.errno = errno_codes.ENOSYS
                return None
            return ctypes.addressof(self.list)

        def free_device_list(devices: int) -> None:
            self.calls.append(("free", devices))

        def device_name(device: int) -> int:
            return device  # each device of the list points at its name

        def open_device(device: int) -> int:
            self.calls.append(("open", ctypes.string_at(device).decode()))
            self.open_contexts.add(0x1000)
            return 0x1000

        def close_device(context: int) -> int:
            self.calls.append(("close", context))
            self.open_contexts.discard(context)
            return 0

        def alloc_pd(context: int) -> int | None:
            self.calls.append(("alloc_pd", context))
            if self.pd_fails:
                self.errno = errno_codes.ENOMEM
                return None
            return 0x2000

        def dealloc_pd(pd: int) -> int:
            self.calls.append(("dealloc_pd", pd))
            return 0

        def reg_dmabuf_mr(pd: int, offset: int, length: int, iova: int, fd: int, access: int) -> int | None:
            self.calls.append(("reg", pd, offset, length, iova, fd, access))
            if self.reg_errno:
                self.errno = self.reg_errno
                return None
            mr = verbs.IbvMr(length=length, lkey=0x1100 + len(self.mrs), rkey=0xFEEDBEEF - len(self.mrs))
            self.mrs.append(mr)
            return ctypes.addressof(mr)

        def dereg_mr(mr: int) -> int:
            self.calls.append(("dereg", mr))
            return 0

        self.lib = SimpleNamespace(
            ibv_get_device_list=DEVICE_LIST(get_device_list),
            ibv_free_device_list=VOID_OF_PTR(free_device_list),
            ibv_get_device_name=NAME_OF(device_name),
            ibv_open_device=PTR_OF(open_device),
            ibv_close_device=INT_OF(close_device),
            ibv_alloc_pd=PTR_OF(alloc_pd),
            ibv_dealloc_pd=INT_OF(dealloc_pd),
            ibv_reg_dmabuf_mr=REG_DMABUF(reg_dmabuf_mr),
            ibv_dereg_mr=INT_OF(dereg_mr),
        )

    def verbs(self) -> Verbs:
        return Verbs(self.lib, get_errno=lambda: self.errno)
