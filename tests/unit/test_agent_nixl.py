"""The NIXL backend on the real library in one process (UCX over tcp on loopback): the calls the
agent relies on, with no agent around them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import BackendOptions, TransferBackend, TransferError
from pdfabric_agent.transfer.nixl import NixlBackend, create, metadata_digest, path_of, split_endpoint
from pdfabric_agent.transfer.nixl_setup import library_env, plugin_of, ucx_env
from pdfabric_core.policy.types import Device, Transport

SIZE = 1 << 20

Pair = tuple[NixlBackend, NixlBackend, Pool, Pool]


def backend() -> NixlBackend:
    made = create(Transport.TCP, BackendOptions(host="127.0.0.1", gpu=0, max_batch_entries=8))
    assert isinstance(made, NixlBackend)
    return made


def load(writer: NixlBackend, peer: NixlBackend) -> None:
    """What the agent does with a peer rank's metadata from its peer door."""
    writer.load_metadata(*peer.local_metadata())


@contextlib.contextmanager
def backend_pair(shm: str, name: str) -> Iterator[Pair]:
    """Two backends, each with a CPU pool registered, each holding the other's metadata."""
    a, b = backend(), backend()
    pa = Pool.allocate(f"{name}-a", SIZE, Device.CPU, shm_dir=shm)
    pb = Pool.allocate(f"{name}-b", SIZE, Device.CPU, shm_dir=shm)
    try:
        a.register(pa)
        b.register(pb)
        load(a, b)
        load(b, a)
        yield a, b, pa, pb
    finally:
        for each in (a, b):
            each.close()
        pa.close()
        pb.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with backend_pair(str(tmp_path_factory.mktemp("pools")), "nixl-unit") as made:
        yield made


def test_is_a_transfer_backend_with_an_endpoint_naming_agent_and_metadata(pair: Pair) -> None:
    a = pair[0]
    assert isinstance(a, TransferBackend)
    name, digest = split_endpoint(a.endpoint())
    assert (a.name, a.path, name.startswith("127.0.0.1/"), len(digest)) == ("nixl", "nixl-ucx-tcp", True, 16)
    assert os.environ["UCX_TLS"] == ucx_env(Transport.TCP)["UCX_TLS"]


def test_engine_gpu_buffers_are_refused_with_the_reason_measured_on_a_gpu(pair: Pair) -> None:
    """UCX's CUDA IPC cannot pass on memory the agent opened by CUDA IPC (an engine's buffer): on an
    H100 it emulated such writes over tcp. The backend says so to an engine that registers GPU KV."""
    a = pair[0]
    assert a.device_memory is False
    assert "only in the agent's own pools" in a.host_memory_only_because


def test_efa_goes_to_nixls_libfabric_backend_which_this_node_cannot_make() -> None:
    """Transport efa is NIXL's LIBFABRIC plugin with libfabric's efa provider, its bytes on their own
    path label; on a node without libfabric (this one) NIXL cannot make the backend, and the
    refusal says what the plugin needs."""
    assert (plugin_of(Transport.EFA), plugin_of(Transport.TCP)) == ("LIBFABRIC", "UCX")
    assert library_env(Transport.EFA) == {"FI_PROVIDER": "efa"}
    assert path_of(Transport.EFA) == "nixl-libfabric-efa" and path_of(Transport.RDMA) == "nixl-ucx-rdma"
    with pytest.raises(
        TransferError, match=r"could not make its LIBFABRIC backend for transport efa.*libfabric\.so\.1"
    ):
        NixlBackend(Transport.EFA, host="127.0.0.1")


def test_batch_lands_byte_exact_and_nothing_else_changes(pair: Pair) -> None:
    a, b, pa, pb = pair
    src = pa.view()
    src[0:4096] = bytes(range(256)) * 16
    src[8192:8200] = b"pdfabric"
    a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr + 65536, 4096), Block(pa.addr + 8192, pb.addr + 12, 8)])
    dst = pb.view()
    assert bytes(dst[65536 : 65536 + 4096]) == bytes(range(256)) * 16
    assert bytes(dst[12:20]) == b"pdfabric"
    assert bytes(dst[0:12]) == bytes(12) and bytes(dst[20:64]) == bytes(44)


def test_a_started_batch_lands_once_waited_for(pair: Pair) -> None:
    a, b, pa, pb = pair
    pa.view()[4096:8192] = b"\x5a" * 4096
    wait = a.start_batch(b.endpoint(), [Block(pa.addr + 4096, pb.addr + 131072, 4096)])
    assert wait is not None
    assert wait() is None
    assert bytes(pb.view()[131072 : 131072 + 4096]) == b"\x5a" * 4096


def test_blocks_outside_registered_memory_are_refused_before_nixl(pair: Pair) -> None:
    a, b, pa, pb = pair
    with pytest.raises(TransferError, match=r"in no region .* registered"):
        a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr + SIZE - 4, 8)])
    with pytest.raises(TransferError, match="in no region registered here"):
        a.write_batch(b.endpoint(), [Block(pa.addr - 8, pb.addr, 8)])
    with pytest.raises(ValueError, match="exceed max_batch_entries 8"):
        a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr, 1)] * 9)


def test_a_peer_without_loaded_metadata_is_refused_and_not_started(pair: Pair) -> None:
    a, _, pa, pb = pair
    stranger = "127.0.0.1/1/0/deadbeef#0123456789abcdef"
    assert a.needs_metadata(stranger) and a.start_batch(stranger, [Block(pa.addr, pb.addr, 8)]) is None
    with pytest.raises(TransferError, match=r"no NIXL metadata of .* loaded"):
        a.write_batch(stranger, [Block(pa.addr, pb.addr, 8)])
    assert a.probe(stranger) is False


def test_metadata_that_does_not_match_its_endpoint_is_refused(pair: Pair) -> None:
    a, b = pair[0], pair[1]
    with pytest.raises(TransferError, match="does not match its digest"):
        a.load_metadata(b.endpoint(), b.local_metadata()[1] + b" ")
    with pytest.raises(ValueError, match="not a nixl endpoint"):
        a.load_metadata("127.0.0.1:1234", b.local_metadata()[1])
    c = backend()  # another rank's metadata, named as b's endpoint with c's digest
    try:
        with pytest.raises(TransferError, match="is NIXL agent"):
            a.load_metadata(
                f"{split_endpoint(b.endpoint())[0]}#{split_endpoint(c.endpoint())[1]}", c.local_metadata()[1]
            )
    finally:
        c.close()
    with pytest.raises(TransferError, match="NIXL refused the metadata"):
        a.load_metadata(*a.local_metadata())  # its own
    assert not a.needs_metadata(b.endpoint())  # b's own still loaded


def test_malformed_metadata_with_a_matching_digest_is_refused(pair: Pair) -> None:
    a = pair[0]
    blob = b'{"nixl": "not base64!", "regions": []}'
    with pytest.raises(TransferError, match="malformed NIXL rank metadata"):
        a.load_metadata(f"x/1/0/y#{metadata_digest(blob)}", blob)


def test_a_new_registration_makes_a_new_endpoint_that_writers_load_again(tmp_path: Path) -> None:
    with backend_pair(str(tmp_path), "nixl-rereg") as (a, b, pa, _):
        old = b.endpoint()
        extra = Pool.allocate("nixl-rereg-extra", SIZE, Device.CPU, shm_dir=str(tmp_path))
        try:
            b.register(extra)
            new = b.endpoint()
            assert new != old and split_endpoint(new)[0] == split_endpoint(old)[0]
            assert a.needs_metadata(new)
            load(a, b)
            assert a.needs_metadata(old)  # the older endpoint's keys are gone with it
            pa.view()[0:16] = b"into-the-new-one"
            a.write_batch(new, [Block(pa.addr, extra.addr + 100, 16)])
            assert bytes(extra.view()[100:116]) == b"into-the-new-one"
        finally:
            b.unregister(extra)
            extra.close()


def test_a_peer_that_is_gone_fails_the_write_instead_of_hanging(tmp_path: Path) -> None:
    with backend_pair(str(tmp_path), "nixl-gone") as (a, b, pa, pb):
        a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr, 64)])  # connected
        endpoint = b.endpoint()
        b.close()
        del b._agent
        started = time.monotonic()
        # On the event loop's thread: it never raises; what it started fails when waited for.
        wait = a.start_batch(endpoint, [Block(pa.addr, pb.addr, 64)])
        if wait is not None:
            with pytest.raises(TransferError, match="NIXL write"):
                wait()
        with pytest.raises(TransferError, match="NIXL write"):
            a.write_batch(endpoint, [Block(pa.addr, pb.addr, 64)])
        assert time.monotonic() - started < 10, "the failure took as long as a timeout"


def test_a_restarted_peers_old_agent_is_removed_once_its_transfers_are_released(tmp_path: Path) -> None:
    """The peer's agent restarts (a new NIXL agent on the same memory): the writer loads the new
    endpoint, and forgetting the old one removes the old NIXL agent, after a transfer still in
    flight to it was released; forgetting an older endpoint of an agent still loaded removes nothing."""
    with backend_pair(str(tmp_path), "nixl-restart") as (a, b, pa, pb):
        old, old_name = b.endpoint(), split_endpoint(b.endpoint())[0]
        pa.view()[0:8] = b"old-peer"
        wait = a.start_batch(old, [Block(pa.addr, pb.addr, 8)])
        assert wait is not None
        restarted = backend()
        try:
            restarted.register(pb)
            load(a, restarted)
            a.forget_peer(old)  # a transfer to it is in flight: kept until it is released
            assert a._agent.check_remote_metadata(old_name)
            assert wait() is None and bytes(pb.view()[0:8]) == b"old-peer"
            assert not a._agent.check_remote_metadata(old_name), "the old peer's NIXL agent is still loaded"
            assert a.needs_metadata(old)
            new = restarted.endpoint()
            a.forget_peer(f"{split_endpoint(new)[0]}#{'0' * 16}")  # an older endpoint of the loaded agent
            pa.view()[0:8] = b"new-peer"
            a.write_batch(new, [Block(pa.addr, pb.addr + 64, 8)])
            assert bytes(pb.view()[64:72]) == b"new-peer"
        finally:
            restarted.close()


def listening_sockets() -> dict[str, str]:
    """This process's listening IPv4 sockets (in /proc/net/tcp, state LISTEN): inode -> address."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            packed = bytes.fromhex(fields[1].split(":")[0])
            found[fields[9]] = ".".join(str(b) for b in reversed(packed))
    return found


def test_ucx_listens_only_on_the_interface_of_the_advertised_host(tmp_path: Path) -> None:
    """Nothing listens without a reason: UCX's tcp transport would listen on every interface. Only
    the sockets a new pair opens count (an earlier test in this worker may have left its own)."""
    assert os.environ.get("UCX_NET_DEVICES") == "lo"
    before = listening_sockets()
    with backend_pair(str(tmp_path), "nixl-listen"):
        opened = {inode: address for inode, address in listening_sockets().items() if inode not in before}
    assert opened, "the pair opened no listening socket: this test no longer sees UCX's"
    assert set(opened.values()) == {"127.0.0.1"}


def test_idle_ranks_take_no_core(pair: Pair) -> None:
    """NIXL's progress thread waits for events: an idle pair takes a small share of one core (it
    polled without waiting under NIXL's Python API's own delay of 0: about half a core each)."""
    before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - before < 0.2


def test_ucx_env_of_nvlink_intra_is_cuda_ipc_with_tcp_beside_it() -> None:
    """nvlink-intra: UCX's CUDA IPC for GPU memory, cuda_copy to know GPU memory, tcp for UCX's
    wire-up and host memory, listening only on the advertised host's interface; no InfiniBand
    modules (tests/gpu/test_nixl_gpu.py runs it on a GPU)."""
    env = ucx_env(Transport.NVLINK_INTRA, "127.0.0.1")
    assert env == {"UCX_TLS": "cuda_ipc,cuda_copy,tcp", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
    assert "UCX_NET_DEVICES" not in ucx_env(Transport.NVLINK_INTRA)


def test_ucx_env_refuses_a_transport_the_nixl_backend_does_not_carry() -> None:
    with pytest.raises(ValueError, match="use tcp, rdma or nvlink-intra"):
        ucx_env(Transport.NVLINK)
