"""The MORI backend's calls, checked against a stand-in ``mori.io`` module.

amd-mori cannot be installed here (ROCm only, CPython 3.10), so this checks only what the backend
asks of MORI: descriptor lookup by address range, per-region grouping with local offsets, status
handling and the batch limit. It says nothing about MORI itself.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import TransferBackend, TransferError
from pdfabric_core.policy.types import Device, Transport


class Desc:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def pack(self) -> bytes:
        return self.tag.encode()

    @classmethod
    def unpack(cls, data: bytes) -> Desc:
        return cls(data.decode())


class Status:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def Succeeded(self) -> bool:
        return self.ok

    def Message(self) -> str:
        return "" if self.ok else "remote QP error"


class Engine:
    fail = False

    def __init__(self, key: str, config: Any) -> None:
        self.key = key
        self.calls: list[tuple[Any, ...]] = []
        self.remotes: list[str] = []
        self.n = 0

    def create_backend(self, kind: str) -> None:
        self.backend = kind

    def register_memory(self, ptr: int, size: int, device_id: int, loc: str) -> Desc:
        return Desc(f"{self.key}:{ptr:#x}:{loc}")

    def get_engine_desc(self) -> Desc:
        return Desc(self.key)

    def register_remote_engine(self, desc: Desc) -> None:
        self.remotes.append(desc.tag)

    def allocate_transfer_uid(self) -> int:
        self.n += 1
        return self.n

    def batch_write(self, *args: Any) -> list[Status]:
        self.calls.append(args)
        return [Status(not Engine.fail) for _ in args[0]]

    def wait_all(self, statuses: list[Status], timeout_ms: int) -> None:
        self.waited = timeout_ms

    def deregister_memory(self, desc: Desc) -> None:
        pass


@pytest.fixture
def mori() -> Iterator[None]:
    io = types.SimpleNamespace(
        IOEngine=Engine,
        IOEngineConfig=lambda host, port: (host, port),
        BackendType=types.SimpleNamespace(XGMI="xgmi", RDMA="rdma", TCP="tcp"),
        MemoryLocationType=types.SimpleNamespace(GPU="gpu", CPU="cpu"),
        EngineDesc=Desc,
        MemoryDesc=Desc,
    )
    pkg = types.ModuleType("mori")
    pkg.io = io  # type: ignore[attr-defined]
    sys.modules["mori"], sys.modules["mori.io"] = pkg, io  # type: ignore[assignment]
    Engine.fail = False
    yield
    del sys.modules["mori"], sys.modules["mori.io"]


def pool(addr: int, size: int) -> Pool:
    return Pool(f"p{addr:#x}", size, Device.CPU, addr, "", None)


def pair() -> tuple[Any, Any]:
    from pdfabric_agent.transfer.mori import MoriBackend

    a = MoriBackend(Transport.RDMA, host="10.0.0.1", max_batch_entries=4)
    b = MoriBackend(Transport.RDMA, host="10.0.0.2", max_batch_entries=4)
    a.register(pool(0x1000, 0x1000))
    a.register(pool(0x8000, 0x100))
    b.register(pool(0x20000, 0x1000))
    b.register(pool(0x90000, 0x100))
    return a, b


def test_satisfies_the_backend_protocol(mori: None) -> None:
    a, _ = pair()
    assert isinstance(a, TransferBackend)
    assert (a.name, a.path, a._engine.backend) == ("mori", "mori", "rdma")


def test_blocks_are_grouped_per_region_pair_with_offsets(mori: None) -> None:
    a, b = pair()
    a.write_batch(
        b.endpoint(),
        [Block(0x1010, 0x20020, 16), Block(0x8000, 0x90000, 8), Block(0x1100, 0x20200, 32)],
    )
    (local_descs, local_offs, remote_descs, remote_offs, sizes, uids) = a._engine.calls[0]
    assert [d.tag.split(":")[1] for d in local_descs] == ["0x1000", "0x8000"]
    assert [d.tag.split(":")[1] for d in remote_descs] == ["0x20000", "0x90000"]
    assert (local_offs, remote_offs, sizes, uids) == (
        [[0x10, 0x100], [0]],
        [[0x20, 0x200], [0]],
        [[16, 32], [8]],
        [1, 2],
    )
    assert a._engine.remotes == [b._engine.key]  # the peer engine is registered once


def test_block_outside_registered_memory_is_refused(mori: None) -> None:
    a, b = pair()
    with pytest.raises(TransferError, match="no registered MORI region"):
        a.write_batch(b.endpoint(), [Block(0x1FF0, 0x20000, 0x20)])


def test_failed_status_raises(mori: None) -> None:
    a, b = pair()
    Engine.fail = True
    with pytest.raises(TransferError, match="remote QP error"):
        a.write_batch(b.endpoint(), [Block(0x1000, 0x20000, 8)])


def test_oversized_batch_is_refused_before_the_engine(mori: None) -> None:
    a, b = pair()
    with pytest.raises(ValueError, match="exceed max_batch_entries 4"):
        a.write_batch(b.endpoint(), [Block(0x1000, 0x20000, 1)] * 5)
    assert a._engine.calls == []
