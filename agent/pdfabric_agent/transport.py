"""Choose the transport the rank map asks for and check this node can carry it.

The operator placed the agent for ``rankmap.transport`` (after any fallback the spec declared). The
agent checks the hardware again because labels can lie: intra-node NVLink needs peer access
between every pair of GPUs the agent owns, multi-node NVLink needs fabric memory, RDMA needs a
device. When the check fails the agent reports a readiness reason instead of silently degrading,
unless the spec's placement.fallback is "TCP".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdfabric_agent.hardware import Hardware
from pdfabric_core.policy.types import Transport
from pdfabric_core.spec import FallbackPolicy, PDClusterSpec


class TransportError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # CamelCase, for the operator's condition


@dataclass(frozen=True)
class TransportChoice:
    transport: Transport
    fell_back_from: Transport | None = None  # set when the declared fallback was used
    note: str = ""


def _problem(transport: Transport, hw: Hardware, gpus: Sequence[int]) -> tuple[str, str] | None:
    if transport is Transport.TCP:
        return None
    if transport is Transport.RDMA:
        if not hw.rdma_devices:
            return "NoRdmaDevice", "transport rdma needs an RDMA device; /sys/class/infiniband is empty"
        return None
    if hw.gpus == 0:
        return "NoGpu", f"transport {transport.value} needs GPUs; none is visible to the agent"
    if transport is Transport.NVLINK_INTRA:
        missing = hw.missing_peer_access(gpus)
        if missing:
            pairs = ", ".join(f"{a}->{b}" for a, b in missing[:8])
            return (
                "NoNvlinkPeerAccess",
                f"transport nvlink-intra needs peer access between the agent's GPUs; missing {pairs}",
            )
        return None
    if transport is Transport.NVLINK:
        if not hw.fabric_memory:
            return "NoFabricMemory", "transport nvlink (multi-node) needs fabric memory (cuMemCreate FABRIC handles)"
        return None
    return "UnknownTransport", f"unknown transport {transport!r}"


def choose_transport(spec: PDClusterSpec, rankmap_transport: str, hw: Hardware, gpus: Sequence[int]) -> TransportChoice:
    try:
        wanted = Transport(rankmap_transport)
    except ValueError:
        raise TransportError("UnknownTransport", f"rank map transport {rankmap_transport!r} is not known") from None
    problem = _problem(wanted, hw, gpus)
    if problem is None:
        return TransportChoice(wanted)
    reason, message = problem
    if spec.placement.fallback == FallbackPolicy.TCP:
        return TransportChoice(Transport.TCP, fell_back_from=wanted, note=f"{reason}: {message}; fell back to tcp")
    raise TransportError(reason, message + " (set placement.fallback: TCP to allow tcp instead)")


def mooncake_env(transport: Transport, timeout_s: float, bind_host: str = "") -> Mapping[str, str]:
    """Mooncake picks its transport from the environment, not from the protocol string."""
    env = {"MC_TRANSFER_TIMEOUT": str(max(1, round(timeout_s)))}
    if bind_host:
        # Honoured by newer engines; 0.3.13 still listens on every interface (see docs/agent.md).
        env["MC_TCP_BIND_ADDRESS"] = bind_host
    if transport is Transport.TCP:
        env["MC_FORCE_TCP"] = "1"
    elif transport is Transport.NVLINK_INTRA:
        env["MC_INTRANODE_NVLINK"] = "1"
    return env
