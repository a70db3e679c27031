"""Metadata/aux buffer device (sglang #26707)."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.buffer_device import metadata_buffer_device, room_dtype
from pdfabric_core.policy.types import Device, MemPool


@pytest.mark.parametrize(
    ("pool", "npu", "expected"),
    [
        (MemPool.NONE, False, Device.CPU),
        (MemPool.NVLINK, False, Device.CPU),
        (MemPool.BAREX, False, Device.CPU),
        (MemPool.INTRA_NODE_NVLINK, False, Device.CUDA),
        (MemPool.INTRA_NODE_NVLINK, True, Device.NPU),
        (MemPool.NONE, True, Device.NPU),
    ],
    ids=[
        "default-cpu",
        "mnnvl-pool-cpu-upstream-todo",
        "barex-cpu",
        "intra-node-nvlink-gpu",
        "npu-first",
        "npu-default",
    ],
)
def test_metadata_buffer_device(pool: MemPool, npu: bool, expected: Device) -> None:
    assert metadata_buffer_device(pool, is_npu=npu) is expected


@pytest.mark.parametrize(("npu", "dtype"), [(True, "int64"), (False, "uint64")], ids=["npu", "other"])
def test_room_dtype(npu: bool, dtype: str) -> None:
    assert room_dtype(is_npu=npu) == dtype
