"""Multi-node NVLink's fabric memory: the agent measures it on its own GPUs (the driver attribute,
then one FABRIC allocation) when its transport needs it; nothing sets it from outside.

The driver is a fake here (tests/gpu/test_fabric_memory_gpu.py runs the real one): each call
writes through the ctypes references as libcuda would and the fake records what was asked."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pdfabric_agent.memory import cuda
from pdfabric_agent.node import hardware
from pdfabric_agent.node.hardware import Hardware, detect_fabric_memory, detect_hardware
from pdfabric_agent.node.transport import TransportError, choose_transport
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import PDClusterSpec, PlacementSpec
from pdfabric_operator.builders.agent_pod import build_agent_pods
from pdfabric_operator.builders.names import ClusterRef
from pdfabric_operator.placement import Placement
from pdfabric_operator.planner import plan_placement
from tests.builders import gpu_node, pdcluster

ROOT = Path(__file__).resolve().parents[2]
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_INVALID_VALUE = 1
ERROR_NAMES = {
    CUDA_ERROR_NOT_PERMITTED: b"CUDA_ERROR_NOT_PERMITTED",
    CUDA_ERROR_INVALID_VALUE: b"CUDA_ERROR_INVALID_VALUE",
}


def _target(ref: Any) -> Any:
    return ref._obj  # the object ctypes.byref() points at


class FakeDriver:
    """The libcuda calls cuda.fabric_memory makes, answering as a driver with `fabric` set would."""

    def __init__(self, fabric_attribute: int | None = 1, create_rc: int = 0) -> None:
        self.fabric_attribute = fabric_attribute  # None: a driver that knows no such attribute
        self.create_rc = create_rc
        self.props: list[cuda.MemAllocationProp] = []
        self.released: list[int] = []
        self.contexts: list[int] = []

    def cuDeviceGetAttribute(self, value: Any, attr: int, device: int) -> int:
        assert attr == cuda.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED == 128
        if self.fabric_attribute is None:
            return CUDA_ERROR_INVALID_VALUE
        _target(value).value = self.fabric_attribute
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx: Any, device: int) -> int:
        _target(ctx).value = 0x1000 + device
        self.contexts.append(device)
        return 0

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        return 0

    def cuMemGetAllocationGranularity(self, granule: Any, prop: Any, option: int) -> int:
        _target(granule).value = 2 << 20
        return 0

    def cuMemCreate(self, handle: Any, size: ctypes.c_size_t, prop: Any, flags: ctypes.c_ulonglong) -> int:
        got = _target(prop)
        self.props.append(cuda.MemAllocationProp.from_buffer_copy(got))
        assert size.value == 2 << 20 and flags.value == 0
        if self.create_rc:
            return self.create_rc
        _target(handle).value = 0xF00D + got.location.id
        return 0

    def cuMemRelease(self, handle: ctypes.c_ulonglong) -> int:
        self.released.append(handle.value)
        return 0

    def cuGetErrorName(self, rc: int, name: Any) -> int:
        _target(name).value = ERROR_NAMES.get(rc, b"CUDA_ERROR_UNKNOWN")
        return 0


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda, "_libcuda", fake)
    monkeypatch.setattr(cuda, "_contexts", {})
    return fake


def test_the_allocation_property_has_cudas_layout() -> None:
    # CUmemAllocationProp: type, requestedHandleTypes, location {type, id}, a pointer, 8 bytes of flags.
    assert ctypes.sizeof(cuda.MemAllocationProp) == 32
    assert cuda.MemAllocationProp.location.offset == 8
    assert cuda.MemAllocationProp.win32HandleMetaData.offset == 16
    assert cuda.MemAllocationProp.allocFlags.offset == 24


def test_a_fabric_allocation_that_works_is_released_at_once(driver: FakeDriver) -> None:
    assert cuda.fabric_memory(3) == (True, "")
    (prop,) = driver.props
    assert prop.type == cuda.CU_MEM_ALLOCATION_TYPE_PINNED
    assert prop.requestedHandleTypes == cuda.CU_MEM_HANDLE_TYPE_FABRIC == 8
    assert (prop.location.type, prop.location.id) == (cuda.CU_MEM_LOCATION_TYPE_DEVICE, 3)
    assert driver.released == [0xF00D + 3]
    assert driver.contexts == [3]


def test_the_attribute_alone_is_not_enough(driver: FakeDriver) -> None:
    # Fabric-capable GPU and driver, but no IMEX channel in the container: cuMemCreate refuses.
    driver.create_rc = CUDA_ERROR_NOT_PERMITTED
    ok, why = cuda.fabric_memory(0)
    assert not ok
    assert "cuMemCreate(FABRIC) failed: CUDA_ERROR_NOT_PERMITTED (800)" in why
    assert "IMEX channel" in why
    assert driver.released == []


def test_a_gpu_without_fabric_support_allocates_nothing(driver: FakeDriver) -> None:
    driver.fabric_attribute = 0
    ok, why = cuda.fabric_memory(1)
    assert not ok and "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0" in why
    assert driver.props == [] and driver.contexts == []


def test_a_driver_older_than_fabric_handles_says_so(driver: FakeDriver) -> None:
    driver.fabric_attribute = None
    ok, why = cuda.fabric_memory(0)
    assert not ok and "CUDA_ERROR_INVALID_VALUE" in why and "CUDA 12.3" in why


def test_every_owned_gpu_must_allocate(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def fabric_memory(device: int) -> tuple[bool, str]:
        asked.append(device)
        return (device != 5, f"GPU {device}: refused")

    monkeypatch.setattr(cuda, "fabric_memory", fabric_memory)
    assert detect_fabric_memory([2, 3]) == (True, "")
    assert detect_fabric_memory([4, 5, 6]) == (False, "GPU 5: refused")
    assert asked == [2, 3, 4, 5]  # stops at the first GPU that cannot
    assert detect_fabric_memory([]) == (False, "the agent owns no GPU")


def test_a_broken_probe_is_data_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: int) -> tuple[bool, str]:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cuda, "fabric_memory", broken)
    ok, why = detect_fabric_memory([0])
    assert not ok and "libcuda.so.1" in why


def test_without_gpus_fabric_memory_is_known_absent() -> None:
    hw = detect_hardware([0])  # this machine: no CUDA device (torch says so, or has no CUDA)
    if hw.gpus:
        pytest.skip("a GPU is visible here: tests/gpu covers it")
    assert (hw.fabric_memory, hw.fabric_memory_note) == (False, "no GPU is visible")


# --- the transport check measures only when its transport needs fabric memory ------------------

FAIL = PDClusterSpec()
FALLBACK = PDClusterSpec(placement=PlacementSpec(fallback="TCP"))
UNMEASURED = Hardware(gpus=4, fabric_memory=None, peer_access=frozenset({(0, 1), (1, 0)}))


class Probe:
    def __init__(self, answer: tuple[bool, str]) -> None:
        self.answer = answer
        self.asked: list[list[int]] = []

    def __call__(self, gpus: Sequence[int]) -> tuple[bool, str]:
        self.asked.append(list(gpus))
        return self.answer


def test_nvlink_measures_fabric_memory_on_the_agents_gpus() -> None:
    probe = Probe((True, ""))
    choice = choose_transport(FAIL, "nvlink", UNMEASURED, [0, 2, 7], fabric_probe=probe)
    assert (choice.transport, choice.fell_back_from) == (Transport.NVLINK, None)
    assert probe.asked == [[0, 2]]  # GPU 7 is past the 4 visible ones


def test_nvlink_without_fabric_memory_says_why() -> None:
    probe = Probe((False, "GPU 0: cuMemCreate(FABRIC) failed: CUDA_ERROR_NOT_PERMITTED (800)"))
    with pytest.raises(TransportError, match=r"needs fabric memory.*CUDA_ERROR_NOT_PERMITTED") as info:
        choose_transport(FAIL, "nvlink", UNMEASURED, [0], fabric_probe=probe)
    assert info.value.reason == "NoFabricMemory"
    choice = choose_transport(FALLBACK, "nvlink", UNMEASURED, [0], fabric_probe=probe)
    assert (choice.transport, choice.fell_back_from) == (Transport.TCP, Transport.NVLINK)
    assert "CUDA_ERROR_NOT_PERMITTED" in choice.note


@pytest.mark.parametrize("transport", ["tcp", "nvlink-intra"])
def test_other_transports_never_touch_fabric_memory(transport: str) -> None:
    # The trial allocation makes a CUDA context on each GPU: an agent that does not need it must not pay it.
    probe = Probe((True, ""))
    choose_transport(FAIL, transport, UNMEASURED, [0, 1], fabric_probe=probe)
    assert probe.asked == []


def test_a_measured_answer_is_not_measured_again() -> None:
    probe = Probe((False, "never asked"))
    choice = choose_transport(FAIL, "nvlink", Hardware(gpus=4, fabric_memory=True), [0], fabric_probe=probe)
    assert choice.transport is Transport.NVLINK and probe.asked == []


# --- nothing outside the agent claims it ----------------------------------------------------------


def _nvlink_pods() -> list[dict[str, Any]]:
    builder = pdcluster().transport("nvlink").prefill(tp=4).decode(tp=4)
    nodes = [gpu_node("x1", 4, clique="x"), gpu_node("x2", 4, clique="x")]
    placement = plan_placement(builder.spec(), nodes, [], cluster_uid="uid-1")
    assert isinstance(placement, Placement)
    return build_agent_pods(ClusterRef("ns", "pd", "uid-1"), builder.spec(), placement)


def test_nvlink_pods_get_their_gpus_and_no_fabric_claim() -> None:
    # The agent measures fabric memory on the GPUs the pod is granted; the operator only places the
    # pods in one NVLink domain and claims nothing about the container (docs/agent.md).
    pods = _nvlink_pods()
    assert len(pods) == 2
    for pod in pods:
        (agent,) = [c for c in pod["spec"]["containers"] if c["name"] == "agent"]
        assert agent["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert not [e for e in agent.get("env", []) if "FABRIC_MEMORY" in e["name"] or "IMEX" in e["name"]]


def test_no_code_reads_a_fabric_memory_variable() -> None:
    # PDFABRIC_FABRIC_MEMORY was read once and set nowhere (the CRD refuses PDFABRIC_* in env), so
    # multi-node NVLink never became Ready. It must not come back as a second source of truth.
    sources = [*ROOT.joinpath("agent").rglob("*.py"), *ROOT.joinpath("operator").rglob("*.py")]
    assert sources
    assert not [p for p in sources if "PDFABRIC_FABRIC_MEMORY" in p.read_text()]
    assert hardware.__doc__ and "labels can lie" in hardware.__doc__
