"""The libibverbs binding (memory/verbs.py) at its boundary, without a NIC.

The fake library is made of real ctypes callbacks with infiniband/verbs.h's C signatures, so every
argument crosses the same C marshalling as with libibverbs: a 64-bit offset or iova that a wrong
argtype would truncate arrives truncated here too. The real libibverbs of this machine (no RDMA
device) is loaded too: it must refuse with ``no_device``, never crash."""

from __future__ import annotations

import ctypes
import errno as errno_codes
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from pdfabric_agent.memory import verbs
from pdfabric_agent.memory.verbs import KV_ACCESS, Failure, Verbs, VerbsError

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


@pytest.fixture
def fake() -> Iterator[FakeVerbs]:
    yield FakeVerbs()


def test_registration_marshals_64_bit_offsets_iova_fd_and_access(fake: FakeVerbs) -> None:
    domain = fake.verbs().open()
    offset, length, iova = (5 << 32) + 4096, (3 << 30) + 8192, 0x7F12_3456_7000 + (5 << 32)
    region = domain.register_dmabuf(fd=17, offset=offset, length=length, iova=iova)
    assert fake.calls[-1] == ("reg", 0x2000, offset, length, iova, 17, KV_ACCESS)
    assert KV_ACCESS == 1 | 2 | 4 | (1 << 20)  # local write, remote write, remote read, relaxed ordering
    assert (region.lkey, region.rkey, region.length, region.iova, region.device) == (
        0x1100,
        0xFEEDBEEF,
        length,
        iova,
        "mlx5_0",
    )
    assert domain.regions() == (region,)
    domain.deregister(region)
    assert fake.calls[-1] == ("dereg", ctypes.addressof(fake.mrs[0])) and domain.regions() == ()


def test_a_named_device_is_opened_and_the_list_always_freed(fake: FakeVerbs) -> None:
    assert fake.verbs().device_names() == ["mlx5_0", "mlx5_1"]
    domain = fake.verbs().open("mlx5_1")
    assert ("open", "mlx5_1") in fake.calls and domain.name == "mlx5_1"
    assert sum(c[0] == "free" for c in fake.calls) == 2
    with pytest.raises(VerbsError) as exc:
        fake.verbs().open("mlx5_9")
    assert exc.value.failure is Failure.NO_DEVICE and "['mlx5_0', 'mlx5_1']" in str(exc.value)
    assert sum(c[0] == "free" for c in fake.calls) == 3


def test_no_device_is_refused_with_the_errno() -> None:
    with pytest.raises(VerbsError) as exc:
        FakeVerbs(names=()).verbs().open()
    assert (
        exc.value.failure is Failure.NO_DEVICE and "no RDMA device" in str(exc.value) and "errno 38" in str(exc.value)
    )


def test_a_failed_protection_domain_closes_the_device() -> None:
    fake = FakeVerbs(pd_fails=True)
    with pytest.raises(VerbsError) as exc:
        fake.verbs().open()
    assert exc.value.failure is Failure.DEVICE and exc.value.errno == errno_codes.ENOMEM
    assert not fake.open_contexts


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        (errno_codes.EOPNOTSUPP, Failure.NO_DMABUF_SUPPORT),  # a kernel or NIC driver without dma-buf MRs
        (errno_codes.EBADF, Failure.REFUSED),
        (errno_codes.EINVAL, Failure.REFUSED),
        (errno_codes.EFAULT, Failure.REFUSED),
    ],
)
def test_a_refused_registration_says_why(code: int, failure: Failure) -> None:
    domain = FakeVerbs(reg_errno=code).verbs().open()
    with pytest.raises(VerbsError) as exc:
        domain.register_dmabuf(fd=5, offset=0, length=1 << 21, iova=1 << 40)
    assert exc.value.failure is failure and exc.value.errno == code
    assert f"errno {code}" in str(exc.value) and "mlx5_0" in str(exc.value)
    assert domain.regions() == ()


def test_iova_and_offset_must_share_their_page_offset(fake: FakeVerbs) -> None:
    domain = fake.verbs().open()
    with pytest.raises(VerbsError, match="page offset"):
        domain.register_dmabuf(fd=5, offset=0, length=4096, iova=0x1000 + 8)
    assert not any(c[0] == "reg" for c in fake.calls)


def test_close_deregisters_everything_then_the_domain(fake: FakeVerbs) -> None:
    domain = fake.verbs().open()
    domain.register_dmabuf(fd=5, offset=0, length=4096, iova=0x10000)
    domain.register_dmabuf(fd=6, offset=0, length=4096, iova=0x20000)
    domain.close()
    tail = [c[0] for c in fake.calls[-4:]]
    assert tail == ["dereg", "dereg", "dealloc_pd", "close"]
    domain.close()  # idempotent
    with pytest.raises(VerbsError) as exc:
        domain.register_dmabuf(fd=5, offset=0, length=4096, iova=0x10000)
    assert exc.value.failure is Failure.DEVICE


def test_an_rdma_core_without_dmabuf_verbs_is_named() -> None:
    lib = FakeVerbs().lib
    del lib.ibv_reg_dmabuf_mr
    with pytest.raises(VerbsError) as exc:
        Verbs(lib)
    assert exc.value.failure is Failure.NO_DMABUF_VERBS and "rdma-core" in str(exc.value)


def test_a_missing_library_is_refused() -> None:
    with pytest.raises(VerbsError) as exc:
        Verbs.load("libibverbs-not-here.so.1")
    assert exc.value.failure is Failure.NO_LIBRARY


def test_the_real_libibverbs_without_a_device_refuses() -> None:
    try:
        real = Verbs.load()
    except VerbsError as exc:
        assert exc.failure is Failure.NO_LIBRARY
        pytest.skip(f"no libibverbs here: {exc}")
    try:
        names = real.device_names()
    except VerbsError as exc:
        assert exc.failure is Failure.NO_DEVICE and "no RDMA device" in str(exc)
        names = []
    if names:
        pytest.skip(f"this machine has RDMA devices {names}")
    with pytest.raises(VerbsError) as exc:
        real.open()
    assert exc.value.failure is Failure.NO_DEVICE
