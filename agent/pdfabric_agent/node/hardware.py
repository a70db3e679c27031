"""What this node can carry: GPUs, NVLink peer access between the GPUs the agent owns, fabric
memory (multi-node NVLink), RDMA devices.

Detection never initialises CUDA unless torch reports a driver, and never raises: a missing
capability is data for the transport check, which decides whether it is fatal.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hardware:
    gpus: int = 0
    # (a, b) pairs of owned GPU indices where a can access b's memory directly
    peer_access: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    fabric_memory: bool = False  # cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC (MNNVL)
    rdma_devices: tuple[str, ...] = ()
    npu: bool = False

    def all_peer_access(self, gpus: Sequence[int]) -> bool:
        return all((a, b) in self.peer_access for a in gpus for b in gpus if a != b)

    def missing_peer_access(self, gpus: Sequence[int]) -> list[tuple[int, int]]:
        return [(a, b) for a in gpus for b in gpus if a != b and (a, b) not in self.peer_access]


def detect_rdma(sys_root: str = "/sys/class/infiniband") -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(sys_root)))
    except OSError:
        return ()


def detect_hardware(owned_gpus: Sequence[int]) -> Hardware:
    gpus = 0
    peer: set[tuple[int, int]] = set()
    fabric = False
    try:
        import torch  # heavy; only when the node may have GPUs

        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            valid = [g for g in owned_gpus if g < gpus]
            for a in valid:
                for b in valid:
                    if a != b and torch.cuda.can_device_access_peer(a, b):
                        peer.add((a, b))
            # Fabric handles need a driver-level query; expose it through an env the device
            # plugin/GFD sets on MNNVL nodes rather than guessing from the GPU name.
            fabric = os.environ.get("PDFABRIC_FABRIC_MEMORY", "") == "1"
    except Exception:  # a broken CUDA install must show up as "no GPUs", not crash detection
        gpus = 0
    return Hardware(gpus=gpus, peer_access=frozenset(peer), fabric_memory=fabric, rdma_devices=detect_rdma())
