"""Transport choice and validation against the node's hardware."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfabric_agent.node.hardware import Hardware, detect_efa
from pdfabric_agent.node.transport import TransportError, choose_transport, mooncake_env
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import PDClusterSpec, PlacementSpec

FAIL = PDClusterSpec()
FALLBACK = PDClusterSpec(placement=PlacementSpec(fallback="TCP"))
PEERS_01 = frozenset({(0, 1), (1, 0)})


@pytest.mark.parametrize(
    ("transport", "hw", "gpus", "expected"),
    [
        ("tcp", Hardware(), [0], Transport.TCP),
        ("rdma", Hardware(rdma_devices=("mlx5_0",)), [0], Transport.RDMA),
        ("nvlink-intra", Hardware(gpus=2, peer_access=PEERS_01), [0, 1], Transport.NVLINK_INTRA),
        ("nvlink-intra", Hardware(gpus=1), [0], Transport.NVLINK_INTRA),
        ("nvlink", Hardware(gpus=4, fabric_memory=True), [0], Transport.NVLINK),
        ("efa", Hardware(rdma_devices=("rdmap0s6",), efa_devices=("rdmap0s6",)), [0], Transport.EFA),
    ],
    ids=["tcp", "rdma-with-hca", "intra-node-with-peer-access", "intra-node-single-gpu", "mnnvl-with-fabric", "efa"],
)
def test_carryable_transport_is_chosen(transport: str, hw: Hardware, gpus: list[int], expected: Transport) -> None:
    choice = choose_transport(FAIL, transport, hw, gpus)
    assert (choice.transport, choice.fell_back_from) == (expected, None)


@pytest.mark.parametrize(
    ("transport", "hw", "gpus", "reason", "text"),
    [
        ("rdma", Hardware(), [0], "NoRdmaDevice", "RDMA device"),
        ("nvlink-intra", Hardware(), [0], "NoGpu", "needs GPUs"),
        (
            "nvlink-intra",
            Hardware(gpus=2, peer_access=frozenset({(0, 1)})),
            [0, 1],
            "NoNvlinkPeerAccess",
            "missing 1->0",
        ),
        ("nvlink", Hardware(gpus=4), [0], "NoFabricMemory", "fabric memory"),
        ("carrier-pigeon", Hardware(), [0], "UnknownTransport", "not known"),
        (
            "efa",
            Hardware(rdma_devices=("mlx5_0",)),
            [0],
            "NoEfaDevice",
            r"RDMA devices here: mlx5_0, none of driver efa",
        ),
    ],
    ids=[
        "rdma-without-hca",
        "intra-node-without-gpu",
        "intra-node-one-way-peer",
        "mnnvl-without-fabric",
        "unknown",
        "efa-on-an-infiniband-node",
    ],
)
def test_uncarryable_transport_is_a_clear_error(
    transport: str, hw: Hardware, gpus: list[int], reason: str, text: str
) -> None:
    with pytest.raises(TransportError, match=text) as info:
        choose_transport(FAIL, transport, hw, gpus)
    assert info.value.reason == reason


def test_efa_devices_are_the_rdma_devices_of_driver_efa(tmp_path: Path) -> None:
    """/sys/class/infiniband/<dev>/device/driver names the driver: an EFA device's is efa."""
    root, drivers = tmp_path / "infiniband", tmp_path / "drivers"
    for dev, driver in (("rdmap0s6", "efa"), ("mlx5_0", "mlx5_core"), ("no-driver-link", "")):
        (root / dev / "device").mkdir(parents=True)
        if driver:
            (drivers / driver).mkdir(parents=True)
            (root / dev / "device" / "driver").symlink_to(drivers / driver)
    assert detect_efa(str(root)) == ("rdmap0s6",)
    assert detect_efa(str(tmp_path / "absent")) == ()


def test_declared_fallback_goes_to_tcp_and_says_why() -> None:
    choice = choose_transport(FALLBACK, "nvlink-intra", Hardware(gpus=2), [0, 1])
    assert (choice.transport, choice.fell_back_from) == (Transport.TCP, Transport.NVLINK_INTRA)
    assert choice.note.startswith("NoNvlinkPeerAccess")


@pytest.mark.parametrize(
    ("transport", "env"),
    [
        (Transport.TCP, {"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "30"}),
        (Transport.NVLINK_INTRA, {"MC_INTRANODE_NVLINK": "1", "MC_TRANSFER_TIMEOUT": "30"}),
        (Transport.RDMA, {"MC_TRANSFER_TIMEOUT": "30"}),
    ],
    ids=["tcp-forced", "intra-node-nvlink", "rdma-autodetect"],
)
def test_mooncake_env(transport: Transport, env: dict[str, str]) -> None:
    assert mooncake_env(transport, 30.0) == env


def test_mooncake_env_names_the_bind_address() -> None:
    assert mooncake_env(Transport.TCP, 2.4, "10.0.0.7") == {
        "MC_FORCE_TCP": "1",
        "MC_TRANSFER_TIMEOUT": "2",
        "MC_TCP_BIND_ADDRESS": "10.0.0.7",
    }
