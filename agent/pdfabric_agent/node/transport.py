"""Choose the transport the rank map asks for and check this node can carry it.

The operator placed the agent for ``rankmap.transport`` (after any fallback the spec declared). The
agent checks the hardware again because labels can lie: intra-node NVLink needs peer access
between every pair of GPUs the agent owns, multi-node NVLink needs fabric memory, RDMA needs a
device, EFA an RDMA device of driver efa. When the check fails the agent reports a readiness reason instead of silently degrading,
unless the spec's placement.fallback is "TCP". What each transport needs is its row in
``pdfabric_core.policy.transports`` (requirements, Mooncake flags); this module only checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pdfabric_agent.node.hardware import Hardware, detect_fabric_memory
from pdfabric_core.policy.transports import FALLBACK_TRANSPORT, Requirement, tcp_fallback_allowed, transport_traits
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import PDClusterSpec

# Measures fabric memory on the given GPUs: (supported, why not). hardware.detect_fabric_memory on a node.
FabricProbe = Callable[[Sequence[int]], tuple[bool, str]]


class TransportError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # CamelCase, for the operator's condition


@dataclass(frozen=True)
class TransportChoice:
    transport: Transport
    fell_back_from: Transport | None = None  # set when the declared fallback was used
    note: str = ""


def _unmet(need: Requirement, transport: Transport, hw: Hardware, gpus: Sequence[int]) -> tuple[str, str] | None:
    """(reason, message) when this node lacks `need`, else None."""
    t = transport.value
    if need is Requirement.RDMA_DEVICE and not hw.rdma_devices:
        return "NoRdmaDevice", f"transport {t} needs an RDMA device; /sys/class/infiniband is empty"
    if need is Requirement.EFA_DEVICE and not hw.efa_devices:
        seen = f" (RDMA devices here: {', '.join(hw.rdma_devices)}, none of driver efa)" if hw.rdma_devices else ""
        return "NoEfaDevice", f"transport {t} needs an EFA device; /sys/class/infiniband has none{seen}"
    if need is Requirement.GPU and hw.gpus == 0:
        return "NoGpu", f"transport {t} needs GPUs; none is visible to the agent"
    if need is Requirement.PEER_ACCESS and (missing := hw.missing_peer_access(gpus)):
        pairs = ", ".join(f"{a}->{b}" for a, b in missing[:8])
        return "NoNvlinkPeerAccess", f"transport {t} needs peer access between the agent's GPUs; missing {pairs}"
    if need is Requirement.FABRIC_MEMORY and not hw.fabric_memory:
        why = f": {hw.fabric_memory_note}" if hw.fabric_memory_note else ""
        return "NoFabricMemory", f"transport {t} (multi-node) needs fabric memory (cuMemCreate FABRIC handles){why}"
    return None


def _problem(transport: Transport, hw: Hardware, gpus: Sequence[int]) -> tuple[str, str] | None:
    for need in transport_traits(transport).requires:
        problem = _unmet(need, transport, hw, gpus)
        if problem is not None:
            return problem
    return None


def measured(hw: Hardware, transport: Transport, gpus: Sequence[int], fabric_probe: FabricProbe) -> Hardware:
    """`hw` with fabric memory measured when `transport` needs it and it is not yet (None)."""
    if Requirement.FABRIC_MEMORY not in transport_traits(transport).requires or hw.fabric_memory is not None:
        return hw
    ok, why = fabric_probe([g for g in gpus if g < hw.gpus])
    return replace(hw, fabric_memory=ok, fabric_memory_note="" if ok else why)


def choose_transport(
    spec: PDClusterSpec,
    rankmap_transport: str,
    hw: Hardware,
    gpus: Sequence[int],
    fabric_probe: FabricProbe = detect_fabric_memory,
) -> TransportChoice:
    try:
        wanted = Transport(rankmap_transport)
    except ValueError:
        raise TransportError("UnknownTransport", f"rank map transport {rankmap_transport!r} is not known") from None
    problem = _problem(wanted, measured(hw, wanted, gpus, fabric_probe), gpus)
    if problem is None:
        return TransportChoice(wanted)
    reason, message = problem
    if tcp_fallback_allowed(spec.placement.fallback, wanted):
        note = f"{reason}: {message}; fell back to {FALLBACK_TRANSPORT.value}"
        return TransportChoice(FALLBACK_TRANSPORT, fell_back_from=wanted, note=note)
    raise TransportError(reason, message + " (set placement.fallback: TCP to allow tcp instead)")


def mooncake_env(transport: Transport, timeout_s: float, bind_host: str = "") -> Mapping[str, str]:
    """Mooncake picks its transport from the environment, not from the protocol string."""
    env = {"MC_TRANSFER_TIMEOUT": str(max(1, round(timeout_s)))}
    if bind_host:
        # Honoured by newer engines; 0.3.13 still listens on every interface (see docs/agent.md).
        env["MC_TCP_BIND_ADDRESS"] = bind_host
    env.update(transport_traits(transport).mooncake_env)
    return env
