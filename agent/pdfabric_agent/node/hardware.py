"""What this node can carry: GPUs, NVLink peer access between the GPUs the agent owns, fabric
memory (multi-node NVLink), RDMA devices.

Detection never initialises CUDA unless torch reports a driver, and never raises: a missing
capability is data for the transport check, which decides whether it is fatal.

Fabric memory is measured by the agent on the GPUs it owns (``detect_fabric_memory``: the driver
attribute, then one FABRIC allocation), not told by the operator or an environment variable: the
operator places nvlink ranks by the nodes' NVLink domain label, which says the GPUs share a fabric
but not that this container may use it (nvidia-imex running on the hosts, an IMEX channel granted
to the pod). Only the allocation proves that, and labels can lie.
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
    # cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC (MNNVL) works on every owned GPU. None: not measured
    # yet; the transport check measures it only for a transport that needs it, since the trial
    # allocation makes a CUDA context (GPU memory) on each GPU that a tcp agent never needs.
    fabric_memory: bool | None = False
    fabric_memory_note: str = ""  # why not, when not: for the transport check's message
    rdma_devices: tuple[str, ...] = ()
    efa_devices: tuple[str, ...] = ()  # the RDMA devices whose driver is efa
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


def detect_efa(sys_root: str = "/sys/class/infiniband") -> tuple[str, ...]:
    """The RDMA devices driven by the efa driver (AWS Elastic Fabric Adapter): their
    ``device/driver`` link names it."""
    found = []
    for name in detect_rdma(sys_root):
        try:
            driver = os.path.basename(os.readlink(os.path.join(sys_root, name, "device", "driver")))
        except OSError:
            continue
        if driver == "efa":
            found.append(name)
    return tuple(found)


def detect_fabric_memory(gpus: Sequence[int]) -> tuple[bool, str]:
    """(True, "") when every GPU of `gpus` allocates FABRIC memory, else (False, why)."""
    if not gpus:
        return False, "the agent owns no GPU"
    try:
        from pdfabric_agent.memory import cuda  # loads libcuda only here: CPU nodes never get this far

        for gpu in gpus:
            ok, why = cuda.fabric_memory(gpu)
            if not ok:
                return False, why
    except Exception as exc:  # never raises, like the rest of detection
        return False, f"fabric memory check failed: {exc}"
    return True, ""


def detect_hardware(owned_gpus: Sequence[int]) -> Hardware:
    """GPUs, peer access and RDMA devices now; fabric memory left unmeasured (None) where GPUs are
    visible, for the transport check to measure when its transport needs it."""
    gpus = 0
    peer: set[tuple[int, int]] = set()
    try:
        import torch  # heavy; only when the node may have GPUs

        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            valid = [g for g in owned_gpus if g < gpus]
            for a in valid:
                for b in valid:
                    if a != b and torch.cuda.can_device_access_peer(a, b):
                        peer.add((a, b))
    except Exception:  # a broken CUDA install must show up as "no GPUs", not crash detection
        gpus = 0
    return Hardware(
        gpus=gpus,
        peer_access=frozenset(peer),
        fabric_memory=None if gpus else False,
        fabric_memory_note="" if gpus else "no GPU is visible",
        rdma_devices=detect_rdma(),
        efa_devices=detect_efa(),
    )
