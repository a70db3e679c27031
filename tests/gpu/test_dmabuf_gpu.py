"""GPUDirect RDMA by dma-buf, the steps one GPU without a NIC allows (docs/sglang.md, "Engine GPU
memory on rdma"): a real CUDA allocation exported as a dma-buf fd (cuMemGetHandleForAddressRange),
handed over with SCM_RIGHTS to another process that sees a dma-buf of the allocation's size, and
handed to the agent's real door in another process, whose checks of the fd pass and which then
answers what its NIC does: registered (a node with an RDMA NIC and dma-buf MRs) or 422 nic_refused
naming why not (no RDMA device, no libibverbs). The NIC registration itself is not run without a NIC.

Skips without CUDA, and with the driver's reason where the GPU cannot export dma-buf (the attribute
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 with NVIDIA's proprietary kernel modules)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdfabric_agent.client.handover import HandoverRefused, export_buffers, hand_over_gpu_buffers
from pdfabric_agent.memory import cuda, dmabuf
from pdfabric_agent.protocol.handover import close_fds, recv_frame, send_frame, socket_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ROOT = Path(__file__).resolve().parents[2]
PATHS = [str(ROOT / "agent"), str(ROOT / "core")]
TOKEN, CLUSTER, RANK = "gpu-test-token", "feedc0de12345678", "prefill-0-tp0-cp0"
NBYTES = 8 << 20


@pytest.fixture(scope="module", autouse=True)
def dmabuf_export_supported() -> None:
    torch.zeros(1, device="cuda:0")  # the primary context, as an engine has it
    ok, why = dmabuf.dmabuf_supported(0)
    print(f"dma-buf export on GPU 0 ({torch.cuda.get_device_name(0)}): {ok} {why}")
    if not ok:
        pytest.skip(f"this GPU's driver does not export dma-buf: {why}")


def _child(code: str) -> subprocess.Popen[str]:
    prelude = f"import sys\nsys.path[:0] = {PATHS!r}\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _wait_for(path: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None, f"the receiving process exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the receiving process never listened"
        time.sleep(0.05)


def test_an_allocation_exports_as_a_dmabuf_of_its_size() -> None:
    t = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
    exports = export_buffers([t.data_ptr(), t.data_ptr() + 4096, t[NBYTES // 2 :].data_ptr()], 0)
    try:
        assert len(exports) == 1  # three pointers into one allocation: one dma-buf
        e = exports[0]
        base, size = cuda.address_range(t.data_ptr())  # torch's segment around the tensor
        assert e.base == base and e.nbytes >= NBYTES and e.nbytes % dmabuf.PAGE == 0, (e, base, size)
        exporter, seen = dmabuf.dmabuf_exporter(e.fd), dmabuf.fd_size(e.fd)
        print(f"exported {e.nbytes} bytes at {e.base:#x}: exporter {exporter!r}, lseek size {seen}")
        assert exporter is not None and seen is not None and seen >= e.nbytes
    finally:
        close_fds([e.fd for e in exports])


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (their paths must stay under 108 bytes, whatever TMPDIR is)."""
    d = tempfile.mkdtemp(prefix="pdfabric-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_the_fds_reach_another_process_as_the_same_dmabufs(sock_dir: Path) -> None:
    path = str(sock_dir / "receiver.sock")
    proc = _child(
        "import socket\n"
        "from pdfabric_agent.memory.dmabuf import dmabuf_exporter, fd_size\n"
        "from pdfabric_agent.protocol.handover import recv_frame, send_frame, close_fds\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind({path + '.new'!r}); s.listen(1)\n"
        f"__import__('os').rename({path + '.new'!r}, {path!r})\n"  # appears listening
        "c, _ = s.accept(); c.settimeout(30)\n"
        "doc, fds = recv_frame(c)\n"
        "send_frame(c, {'pid': __import__('os').getpid(), 'seen': [[dmabuf_exporter(f), fd_size(f)] for f in fds]})\n"
        "close_fds(fds)\n"
    )
    torch.cuda.empty_cache()  # fresh segments: each tensor its own allocation, as a KV pool's layers
    keep = [
        torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0"),
        torch.empty(2 * NBYTES, dtype=torch.uint8, device="cuda:0"),
    ]
    exports = export_buffers([t.data_ptr() for t in keep], 0)
    try:
        _wait_for(path, proc)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(path)
            send_frame(sock, {"what": "dma-bufs"}, [e.fd for e in exports])
            doc, _ = recv_frame(sock)
        print("the receiving process saw:", doc)
        assert doc["pid"] != os.getpid()
        assert len(doc["seen"]) == len(exports) >= 1  # two tensors: two segments, or one cached segment
        assert all(size >= e.nbytes for (_, size), e in zip(doc["seen"], exports, strict=True))
        assert all(exporter is not None for exporter, _ in doc["seen"])
        assert proc.wait(30) == 0
    finally:
        close_fds([e.fd for e in exports])
        if proc.poll() is None:
            proc.kill()


@pytest.fixture
def agent_door(sock_dir: Path) -> Iterator[str]:
    """The agent's real door (its checks, the real libibverbs) in a process of its own."""
    path = socket_path(str(sock_dir), CLUSTER)
    proc = _child(
        "from pdfabric_agent.http.handover import HandoverDoor\n"
        "from pdfabric_agent.ranks.nic_memory import NicMemory\n"
        f"door = HandoverDoor({path!r}, token={TOKEN!r}, cluster_uid={CLUSTER!r}, nic=NicMemory([{RANK!r}]))\n"
        "door.start()\n"
        "sys.stdin.read()\n"
        "door.close()\n"
    )
    try:
        _wait_for(path, proc)
        yield path
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_the_agents_door_takes_the_dmabufs_and_answers_what_its_nic_does(agent_door: str) -> None:
    t = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
    ptrs = [t.data_ptr()]
    with pytest.raises(HandoverRefused) as wrong:
        hand_over_gpu_buffers(agent_door, token="not-the-token", cluster=CLUSTER, rank=RANK, ptrs=ptrs, device=0)
    assert (wrong.value.status, wrong.value.reason) == (401, "unauthorized")
    try:
        answer = hand_over_gpu_buffers(agent_door, token=TOKEN, cluster=CLUSTER, rank=RANK, ptrs=ptrs, device=0)
    except HandoverRefused as exc:
        # The door's fd checks (a dma-buf, at least the size named) come before the NIC: a refusal
        # by the NIC means the other process saw the dma-buf whole.
        print("the agent's door refused, as a node without an RDMA NIC must:", exc)
        assert (exc.status, exc.reason) == (422, "nic_refused"), exc
        # Opening the NIC failed (no libibverbs, no device, no access), or the registration itself did.
        assert exc.message.startswith(("GPU memory cannot be registered with a NIC here", "allocations[0]")), exc
        return
    print("registered with the NIC:", answer)
    assert answer.rank == RANK and [r.iova for r in answer.registered] == [cuda.address_range(t.data_ptr())[0]]
    assert answer.registered[0].nbytes >= NBYTES and answer.registered[0].rkey >= 0
