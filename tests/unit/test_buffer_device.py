"""Metadata/aux buffer device (sglang #26707), the KV/state pool device per transport, and the devices
an engine's own KV may be on per transport."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.buffer_device import (
    engine_gpu_transports,
    engine_kv_devices,
    kv_buffer_device,
    metadata_buffer_device,
)
from pdfabric_core.policy.types import Device, MemPool, Transport


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


@pytest.mark.parametrize(
    ("transport", "expected"),
    [
        (Transport.TCP, Device.CPU),
        (Transport.RDMA, Device.CPU),
        (Transport.NVLINK_INTRA, Device.CUDA),
        (Transport.NVLINK, Device.CUDA),
    ],
    ids=["tcp-host", "rdma-host", "intra-node-nvlink-gpu", "mnnvl-gpu"],
)
def test_kv_buffer_device(transport: Transport, expected: Device) -> None:
    assert kv_buffer_device(transport) is expected


@pytest.mark.parametrize(
    ("transport", "expected"),
    [
        (Transport.TCP, {Device.CPU, Device.CUDA}),
        (Transport.RDMA, {Device.CPU}),
        (Transport.NVLINK_INTRA, {Device.CUDA}),
        (Transport.NVLINK, {Device.CUDA}),
    ],
    ids=["tcp-host-or-gpu-through-host", "rdma-host-until-gpudirect", "intra-node-nvlink-gpu", "mnnvl-gpu"],
)
def test_engine_kv_devices(transport: Transport, expected: set[Device]) -> None:
    assert engine_kv_devices(transport) == expected
    assert kv_buffer_device(transport) in engine_kv_devices(transport)  # the agent's own pools fit too


def test_engine_gpu_kv_moves_on_tcp_and_the_nvlink_transports() -> None:
    assert engine_gpu_transports() == (Transport.TCP, Transport.NVLINK_INTRA, Transport.NVLINK)
