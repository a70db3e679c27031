"""The libibverbs binding (memory/verbs.py) at its boundary, without a NIC.

The fake library is made of real ctypes callbacks with infiniband/verbs.h's C signatures, so every
argument crosses the same C marshalling as with libibverbs: a 64-bit offset or iova that a wrong
argtype would truncate arrives truncated here too. The real libibverbs of this machine (no RDMA
device) is loaded too: it must refuse with ``no_device``, never crash."""

from __future__ import annotations

import ctypes
import errno as errno_codes
from collections.abc import Iterator

import pytest

from pdfabric_agent.memory.verbs import KV_ACCESS, Failure, Verbs, VerbsError
from tests.unit.fake_verbs import FakeVerbs


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
