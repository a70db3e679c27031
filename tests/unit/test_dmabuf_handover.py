"""The dma-buf hand-over without a GPU or a NIC: real fds (memfds) over a real Unix socket with
SCM_RIGHTS, the message's checks, and the agent's door answering every refusal with a status and
a reason, never leaking an fd, never hanging.

A memfd is no dma-buf, so the real check refuses it (that is one of the tests); the tests that go
past that check give the registry an exporter lookup that accepts memfds, and a NIC domain over the
fake libibverbs of tests/unit/fake_verbs.py. tests/gpu/test_dmabuf_gpu.py hands over real CUDA dma-bufs."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.client.handover import HandoverRefused, hand_over, hand_over_gpu_buffers
from pdfabric_agent.http.handover import HandoverDoor
from pdfabric_agent.memory import dmabuf
from pdfabric_agent.memory.verbs import Failure, NicDomain, VerbsError
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.handover import (
    SCM_MAX_FD,
    Allocation,
    DmabufHandover,
    recv_frame,
    send_frame,
    socket_path,
)
from pdfabric_agent.ranks.nic_memory import NicMemory
from tests.unit.fake_verbs import FakeVerbs

TOKEN, CLUSTER, RANK = "engine-token", "0123456789abcdef", "prefill-0-tp0-cp0"


def memfd(size: int, fill: bytes = b"") -> int:
    fd = os.memfd_create("pdfabric-test")
    os.ftruncate(fd, size)
    if fill:
        os.pwrite(fd, fill, 0)
    return fd


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def msg(
    n: int = 1, *, token: str = TOKEN, cluster: str = CLUSTER, rank: str = RANK, nbytes: int = 1 << 16
) -> DmabufHandover:
    return DmabufHandover(cluster, token, rank, tuple(Allocation(nbytes, (i + 1) << 30, 0) for i in range(n)))


# ---------------------------------------------------------------- SCM_RIGHTS framing
def test_fds_cross_a_unix_socket_and_name_the_same_memory() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [memfd(4096, b"first"), memfd(8192, b"second")]
    with a, b:
        send_frame(a, {"hello": 1}, fds)
        doc, got = recv_frame(b)
    try:
        assert doc == {"hello": 1} and len(got) == 2 and set(got).isdisjoint(fds)
        assert os.pread(got[0], 5, 0) == b"first" and os.pread(got[1], 6, 0) == b"second"
        os.pwrite(got[1], b"SECOND", 0)  # the same file: written through one, read through the other
        assert os.pread(fds[1], 6, 0) == b"SECOND"
        assert dmabuf.fd_size(got[1]) == 8192 and dmabuf.dmabuf_exporter(got[1]) is None  # a memfd is no dma-buf
        assert all(os.get_inheritable(fd) is False for fd in got)  # MSG_CMSG_CLOEXEC
    finally:
        for fd in [*fds, *got]:
            os.close(fd)


def test_more_fds_than_allowed_are_refused_and_all_closed() -> None:
    fds = [memfd(4096) for _ in range(3)]
    before = open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        send_frame(a, {"x": 1}, fds)
        with pytest.raises(ApiError) as exc:
            recv_frame(b, max_fds=2)
    assert exc.value.status == 413 and open_fds() == before
    for fd in fds:
        os.close(fd)


@pytest.mark.parametrize(
    "raw", [b"\x00\x00\x00\x03abc", b"\x00\x00\x00\x02[]", b"\xff\xff\xff\xff", b'\x00\x00\x00\x09{"a":']
)
def test_a_frame_that_is_not_a_json_object_is_malformed(raw: bytes) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(1)
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ApiError) as exc:
            recv_frame(b)
    assert exc.value.status in (400, 413)


def test_the_message_round_trips_and_checks_its_fields() -> None:
    m = msg(3)
    assert DmabufHandover.parse(m.to_json()) == m
    bad: list[tuple[dict[str, Any], str]] = [
        ({**m.to_json(), "kind": "other"}, "kind"),
        ({**m.to_json(), "allocations": []}, "non-empty"),
        ({**m.to_json(), "allocations": [{"nbytes": 4096, "base": 4097, "device": 0}]}, "page-aligned"),
        ({**m.to_json(), "allocations": [{"nbytes": 0, "base": 0, "device": 0}]}, "nbytes"),
        ({**m.to_json(), "allocations": [{"nbytes": 1, "base": 0, "device": 0, "ipc_handle": "XYZ"}]}, "ipc_handle"),
        ({**m.to_json(), "allocations": [{"nbytes": 1, "base": 0, "device": 0}] * (SCM_MAX_FD + 1)}, "at most 253"),
    ]
    for body, what in bad:
        with pytest.raises(ApiError, match=what):
            DmabufHandover.parse(body)


# ---------------------------------------------------------------- the agent's door
class Door:
    def __init__(self, tmp: Path, *, accept_memfd: bool = True, fake: FakeVerbs | None = None, **kw: Any) -> None:
        self.fake = fake or FakeVerbs()
        opened: list[NicDomain] = []

        def open_domain() -> NicDomain:
            opened.append(self.fake.verbs().open())
            return opened[-1]

        exporter = (lambda fd: "memfd-as-dmabuf") if accept_memfd else dmabuf.dmabuf_exporter
        self.nic = NicMemory([RANK, "decode-0-tp0"], open_domain, exporter_of=exporter)
        self.path = socket_path(str(tmp), CLUSTER)
        self.door = HandoverDoor(self.path, token=TOKEN, cluster_uid=CLUSTER, nic=self.nic, **kw)
        self.door.start()

    def send(self, m: DmabufHandover, fds: list[int]) -> Any:
        return hand_over(self.path, m, fds, timeout_s=5)


@pytest.fixture
def door(tmp_path: Path) -> Iterator[Door]:
    d = Door(tmp_path)
    yield d
    d.door.close()


def test_a_hand_over_registers_every_fd_at_the_engines_addresses(door: Door) -> None:
    fds = [memfd(1 << 16), memfd(1 << 16)]
    before = open_fds()
    answer = door.send(msg(2), fds)
    assert answer.rank == RANK and [r.iova for r in answer.registered] == [1 << 30, 2 << 30]
    assert [(r.nic, r.exporter, r.nbytes) for r in answer.registered] == [("mlx5_0", "memfd-as-dmabuf", 1 << 16)] * 2
    regs = [c for c in door.fake.calls if c[0] == "reg"]
    assert [(c[2], c[3], c[4]) for c in regs] == [
        (0, 1 << 16, 1 << 30),
        (0, 1 << 16, 2 << 30),
    ]  # offset 0, length, iova
    assert len(door.nic.regions(RANK)) == 2
    time.sleep(0.05)
    assert open_fds() == before  # the door closed what it received; the engine still owns its own
    assert oct(os.stat(door.path).st_mode & 0o777) == "0o600"
    # A second hand-over of the rank replaces the first (deregistered once the new ones hold).
    door.send(msg(1), fds[:1])
    assert len(door.nic.regions(RANK)) == 1 and sum(c[0] == "dereg" for c in door.fake.calls) == 2
    for fd in fds:
        os.close(fd)


@pytest.mark.parametrize(
    ("m", "nfds", "status", "reason"),
    [
        (msg(1, token="wrong"), 1, 401, "unauthorized"),
        (msg(1, cluster="another-cluster"), 1, 403, "wrong_cluster"),
        (msg(1, rank="decode-9-tp0"), 1, 404, "unknown_rank"),
        (msg(2), 1, 400, "malformed"),  # two allocations, one fd
        (msg(1, nbytes=1 << 20), 1, 422, "layout_mismatch"),  # the memfd holds 64 KiB, 1 MiB named
    ],
)
def test_refusals_name_the_reason_and_leak_no_fd(
    door: Door, m: DmabufHandover, nfds: int, status: int, reason: str
) -> None:
    fds = [memfd(1 << 16) for _ in range(nfds)]
    before = open_fds()
    with pytest.raises(HandoverRefused) as exc:
        door.send(m, fds)
    assert (exc.value.status, exc.value.reason) == (status, reason), exc.value
    time.sleep(0.05)
    assert open_fds() == before and door.nic.regions(RANK) == ()
    for fd in fds:
        os.close(fd)


def test_an_fd_that_is_no_dmabuf_is_refused(tmp_path: Path) -> None:
    d = Door(tmp_path, accept_memfd=False)  # the real check: fdinfo names no exporter
    fd = memfd(1 << 16)
    try:
        with pytest.raises(HandoverRefused) as exc:
            d.send(msg(1), [fd])
        assert (exc.value.status, exc.value.reason) == (422, "layout_mismatch") and "not a dma-buf" in exc.value.message
    finally:
        os.close(fd)
        d.door.close()


@pytest.mark.parametrize(
    ("fake", "words"),
    [
        (FakeVerbs(names=()), "no RDMA device"),
        (FakeVerbs(reg_errno=95), "no_dmabuf_support"),  # EOPNOTSUPP: no dma-buf MRs in the kernel or NIC driver
        (FakeVerbs(reg_errno=14), "errno 14"),
    ],
)
def test_what_the_nic_cannot_honour_is_a_422(tmp_path: Path, fake: FakeVerbs, words: str) -> None:
    d = Door(tmp_path, fake=fake)
    fds = [memfd(1 << 16), memfd(1 << 16)]
    try:
        with pytest.raises(HandoverRefused) as exc:
            d.send(msg(2), fds)
        assert (exc.value.status, exc.value.reason) == (422, "nic_refused") and words in exc.value.message
        assert d.nic.regions(RANK) == () and not [c for c in fake.calls if c[0] == "reg"][1:]  # stopped at the first
    finally:
        for fd in fds:
            os.close(fd)
        d.door.close()


def test_the_real_libibverbs_here_refuses_with_a_reason(tmp_path: Path) -> None:
    from pdfabric_agent.ranks.nic_memory import open_first_device

    nic = NicMemory([RANK], open_first_device, exporter_of=lambda fd: "memfd-as-dmabuf")
    door = HandoverDoor(socket_path(str(tmp_path), CLUSTER), token=TOKEN, cluster_uid=CLUSTER, nic=nic)
    door.start()
    fd = memfd(1 << 16)
    try:
        try:
            open_first_device().close()
            pytest.skip("this machine has an RDMA device")
        except VerbsError as exc:
            assert exc.failure in (Failure.NO_DEVICE, Failure.NO_LIBRARY)
        with pytest.raises(HandoverRefused) as refused:
            hand_over(door.path, msg(1), [fd])
        assert (refused.value.status, refused.value.reason) == (422, "nic_refused")
    finally:
        os.close(fd)
        door.close()


def test_a_stalled_client_times_out_and_the_door_keeps_serving(tmp_path: Path) -> None:
    d = Door(tmp_path, timeout_s=0.3)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(d.path)
    stalled.sendall(b"\x00\x00\x01\x00{")  # a frame head, then nothing
    fd = memfd(1 << 16)
    try:
        assert d.send(msg(1), [fd]).rank == RANK  # served beside the stalled one
        stalled.settimeout(2)
        doc, _ = recv_frame(stalled)
        assert (doc["status"], doc["reason"]) == (408, "timeout")
    finally:
        stalled.close()
        os.close(fd)
        d.door.close()


def test_connections_past_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    d = Door(tmp_path, timeout_s=2, max_connections=1)
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.connect(d.path)  # holds the one slot until its deadline
    time.sleep(0.3)
    fd = memfd(1 << 16)
    try:
        with pytest.raises(HandoverRefused) as exc:
            d.send(msg(1), [fd])
        assert (exc.value.status, exc.value.reason) == (429, "too_many_connections")
    finally:
        holder.close()
        os.close(fd)
        d.door.close()


def test_close_stops_the_door_and_removes_its_socket(tmp_path: Path) -> None:
    d = Door(tmp_path)
    d.door.close()
    assert not os.path.exists(d.path)
    fd = memfd(4096)
    try:
        with pytest.raises(HandoverRefused) as exc:
            d.send(msg(1), [fd])
        assert exc.value.status == 0 and "no hand-over with the agent" in exc.value.message
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the engine side without a GPU
def test_exporting_without_a_cuda_driver_is_refused_before_any_socket(tmp_path: Path) -> None:
    from pdfabric_agent.memory import cuda

    if cuda.available()[0]:
        pytest.skip("a CUDA driver is loadable here (tests/gpu covers the real export)")
    with pytest.raises(HandoverRefused) as exc:
        hand_over_gpu_buffers(
            str(tmp_path / "absent.sock"), token=TOKEN, cluster=CLUSTER, rank=RANK, ptrs=[1 << 30], device=0
        )
    assert exc.value.reason == "not_exportable" and "CUDA driver" in exc.value.message


def test_one_client_thread_per_hand_over(door: Door) -> None:
    fds = [memfd(1 << 16) for _ in range(4)]
    errors: list[BaseException] = []

    def one(fd: int, rank: str) -> None:
        try:
            door.send(msg(1, rank=rank), [fd])
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(fd, (RANK, "decode-0-tp0")[i % 2])) for i, fd in enumerate(fds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not errors and len(door.nic.regions(RANK)) == 1 and len(door.nic.regions("decode-0-tp0")) == 1
    for fd in fds:
        os.close(fd)


def test_the_sglang_plugin_hands_over_its_kv_and_state_allocations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from pdfabric_sglang import kvargs

    from pdfabric_agent.client import handover as client_handover

    seen: dict[str, Any] = {}

    def record(path: str, **kw: Any) -> str:
        seen.update(kw, path=path)
        return "answer"

    monkeypatch.setattr(client_handover, "hand_over_gpu_buffers", record)
    monkeypatch.setattr(kvargs, "gpu_of", lambda args: 3)
    cfg = SimpleNamespace(token=TOKEN)
    args = SimpleNamespace(kv_data_ptrs=[0x1000, 0x2000], state_types=["mamba"], state_data_ptrs=[[0x3000, 0x4000]])
    answer = kvargs.hand_over_gpu_kv(args, cfg, RANK, CLUSTER, env={"PDFABRIC_SHM_DIR": str(tmp_path)})  # type: ignore[arg-type]
    assert answer == "answer" and seen["path"] == socket_path(str(tmp_path), CLUSTER)
    assert (seen["ptrs"], seen["device"], seen["token"], seen["rank"]) == (
        [0x1000, 0x2000, 0x3000, 0x4000],
        3,
        TOKEN,
        RANK,
    )
    monkeypatch.setattr(kvargs, "gpu_of", lambda args: None)
    with pytest.raises(RuntimeError, match="no CUDA"):
        kvargs.hand_over_gpu_kv(args, cfg, RANK, CLUSTER)  # type: ignore[arg-type]
