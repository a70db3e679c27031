"""The fabric memory check against the real driver: it answers without raising, agrees with the
driver attribute (and with cuda-python's, where installed), leaks no device memory when probed
again and again, leaves torch working on the same GPU, and decides the nvlink transport check.

A single GPU without an IMEX channel (most test machines, H100/H200 ones too) answers False with
the driver's reason; a GB200-class node with nvidia-imex and a channel answers True."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdfabric_agent.memory import cuda
from pdfabric_agent.node.hardware import detect_hardware
from pdfabric_agent.node.transport import TransportError, choose_transport
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import PDClusterSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def free_bytes() -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.check(cuda.cu().cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value


def test_the_check_agrees_with_the_driver_attribute() -> None:
    ok, why = cuda.fabric_memory(0)
    attribute = cuda.device_attribute(0, cuda.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
    assert ok == (why == "")
    if not attribute:
        assert not ok and "is 0" in why
    elif not ok:
        assert "cuMemCreate(FABRIC)" in why, why  # supported GPU, refused allocation: the driver's reason
    try:
        from cuda.bindings import driver
    except ImportError:
        return
    err, value = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0
    )
    assert err == driver.CUresult.CUDA_SUCCESS and value == attribute


def test_probing_again_and_again_leaks_nothing_and_torch_still_runs() -> None:
    cuda.fabric_memory(0)
    before = free_bytes()
    answers = {cuda.fabric_memory(0) for _ in range(64)}
    assert len(answers) == 1  # the same answer every time
    assert before - free_bytes() < 64 << 20  # 64 probes of a 2 MiB granule (or more) each: released
    x = torch.arange(1024, device="cuda:0", dtype=torch.float32)
    assert float(x.sum()) == 1024 * 1023 / 2


def test_the_nvlink_check_follows_the_measurement() -> None:
    hw = detect_hardware([0])
    assert hw.gpus >= 1 and hw.fabric_memory is None  # left for the transport check
    ok, why = cuda.fabric_memory(0)
    if ok:
        assert choose_transport(PDClusterSpec(), "nvlink", hw, [0]).transport is Transport.NVLINK
    else:
        with pytest.raises(TransportError) as info:
            choose_transport(PDClusterSpec(), "nvlink", hw, [0])
        assert info.value.reason == "NoFabricMemory" and why in str(info.value)
