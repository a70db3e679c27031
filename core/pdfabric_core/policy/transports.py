"""What each transport and each memory pool needs and implies: one row per value, read by all.

The planner (locality, device resource), the pod builders (device resource), the spec checks
(allowed pairs, backends), the agent's hardware check (requirements), its pools (KV device,
metadata device) and its engine set-up (Mooncake protocol and environment) read these rows
instead of comparing enum members, so a new transport is a new Transport member plus one row
here (and the CRD's enum and transport/memPool CEL rule, which a unit test keeps in step).

Sources: the Mooncake protocol strings and MC_* flags are Mooncake's TransferEngine.initialize and
its environment (MC_FORCE_TCP, MC_INTRANODE_NVLINK); the pool rules are SGLang's
SGLANG_MOONCAKE_CUSTOM_MEM_POOL handling (disaggregation/mooncake, sglang #26707).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdfabric_core.policy.types import Backend, Device, FallbackPolicy, MemPool, Transport


class Locality(enum.StrEnum):
    """What the planner must keep together for a transport."""

    ANY = "any"  # a unit is one replica; one larger than any node is spread rank by rank
    NODE = "node"  # a prefill replica and the decode replicas it feeds share one node; feeds confined
    DOMAIN = "domain"  # every rank inside one NVLink domain (placement.nvlinkDomainKey)


class Requirement(enum.StrEnum):
    """What the agent checks on its own node before it runs a transport (labels can lie)."""

    RDMA_DEVICE = "rdma-device"  # an RDMA device under /sys/class/infiniband
    GPU = "gpu"  # at least one visible GPU
    PEER_ACCESS = "peer-access"  # peer access between every pair of the agent's GPUs
    FABRIC_MEMORY = "fabric-memory"  # cuMemCreate FABRIC handles (multi-node NVLink)
    EFA_DEVICE = "efa-device"  # an EFA device (an RDMA device of driver efa under /sys/class/infiniband)


@dataclass(frozen=True)
class TransportTraits:
    transport: Transport
    locality: Locality
    # Nodes must offer, and each agent pod requests one of, placement.rdmaResource.
    device_resource: bool
    kv_device: Device  # where the agent's own KV and state pools live
    # Where a serving engine's own KV and state buffers may live (registered with the agent):
    # CUDA ones are mapped by CUDA IPC. On tcp the sender gathers GPU sources into pinned host memory
    # of its own (agent transfer/staging.py: Mooncake's own copy of a GPU source, a cudaMemcpy per
    # 64 KiB on its one I/O thread, halves its rate) and Mooncake writes GPU destinations itself at
    # its host rate (benchmarks/results/gpu-2026-12-02-tcp-gpu.md). rdma: host memory only. The engine
    # can hand its GPU allocations to the agent as dma-bufs and the agent registers them with the NIC
    # (agent ranks/nic_memory.py), but no data path moves bytes from those registrations yet:
    # Mooncake registers memory itself, in its own protection domain (docs/sglang.md, "Engine GPU
    # memory on rdma").
    engine_kv_devices: frozenset[Device]
    requires: tuple[Requirement, ...]  # checked by the agent, in this order
    mooncake_protocol: str  # TransferEngine.initialize's protocol argument
    # MC_* flags that make Mooncake run it: the protocol string alone does not pick tcp or nvlink_intra.
    mooncake_env: tuple[tuple[str, str], ...]
    backends: frozenset[Backend]
    # The agent's GPU gather/scatter kernels (fastpath/) can carry it: peers on this node only.
    kernel_path: bool = False
    # The host CPU moves every byte (the engine's transport threads copy through sockets): a wait
    # that spins takes CPU from the transfer itself, so the Mooncake backend waits for a batch by
    # sleeping between checks of one transfer per block. Where a NIC or the GPUs move the bytes,
    # one batch submit costs a third of a submit per block and the wait spins, as Mooncake's own.
    cpu_moves_bytes: bool = False


TRANSPORTS: dict[Transport, TransportTraits] = {
    t.transport: t
    for t in (
        TransportTraits(
            Transport.TCP,
            Locality.ANY,
            device_resource=False,
            kv_device=Device.CPU,
            engine_kv_devices=frozenset({Device.CPU, Device.CUDA}),
            requires=(),
            mooncake_protocol="tcp",
            mooncake_env=(("MC_FORCE_TCP", "1"),),
            backends=frozenset(Backend),
            cpu_moves_bytes=True,
        ),
        TransportTraits(
            Transport.RDMA,
            Locality.ANY,
            device_resource=True,
            kv_device=Device.CPU,
            engine_kv_devices=frozenset({Device.CPU}),
            requires=(Requirement.RDMA_DEVICE,),
            mooncake_protocol="rdma",
            mooncake_env=(),
            backends=frozenset(Backend),
        ),
        TransportTraits(
            Transport.NVLINK_INTRA,
            Locality.NODE,
            device_resource=False,
            # Mooncake's intra-node NVLink transport refuses host memory.
            kv_device=Device.CUDA,
            engine_kv_devices=frozenset({Device.CUDA}),
            requires=(Requirement.GPU, Requirement.PEER_ACCESS),
            mooncake_protocol="nvlink_intra",
            mooncake_env=(("MC_INTRANODE_NVLINK", "1"),),
            # NIXL: UCX's CUDA IPC (cuda_ipc) on the default pool (MEM_POOLS' backend_transports).
            backends=frozenset({Backend.MOONCAKE, Backend.NIXL}),
            kernel_path=True,
        ),
        TransportTraits(
            Transport.NVLINK,
            Locality.DOMAIN,
            device_resource=False,
            kv_device=Device.CUDA,
            engine_kv_devices=frozenset({Device.CUDA}),
            requires=(Requirement.GPU, Requirement.FABRIC_MEMORY),
            mooncake_protocol="nvlink",
            mooncake_env=(),
            backends=frozenset({Backend.MOONCAKE}),
        ),
        TransportTraits(
            Transport.EFA,
            Locality.ANY,
            # The EFA devices are the nodes' extended resource (vpc.amazonaws.com/efa on EKS): set
            # placement.rdmaResource to it.
            device_resource=True,
            kv_device=Device.CPU,
            engine_kv_devices=frozenset({Device.CPU}),
            requires=(Requirement.EFA_DEVICE,),
            mooncake_protocol="",  # Mooncake does not carry it
            mooncake_env=(),
            # NIXL's LIBFABRIC backend over libfabric's efa provider: written against NIXL's API
            # and refused at the agent's start where the device is absent (never run: no EFA here).
            backends=frozenset({Backend.NIXL}),
        ),
    )
}


@dataclass(frozen=True)
class MemPoolTraits:
    pool: MemPool
    implied_transport: Transport  # what transport auto means on this pool
    # Transports the pool can actually run on. NVLINK (MNNVL) needs fabric memory that only its
    # own pool allocates; Mooncake's intra-node NVLink needs whole cudaMalloc segments, which only
    # the INTRA_NODE_NVLINK pool provides; BAREX is an RDMA pool; the default pool runs tcp or rdma.
    transports: frozenset[Transport]
    # Metadata/aux buffers' device (sglang MetadataBuffers; NPU overrides it, see buffer_device).
    metadata_device: Device
    # Aux rows go over the TCP side channel (sglang #26707, send_aux), see aux_path.
    aux_side_channel: bool
    backends: frozenset[Backend]  # MORI-IO has none of Mooncake's custom pools
    # Transports the pool runs with one backend only, beyond ``transports`` (``pool_transports``).
    backend_transports: tuple[tuple[Backend, frozenset[Transport]], ...] = ()


MEM_POOLS: dict[MemPool, MemPoolTraits] = {
    m.pool: m
    for m in (
        MemPoolTraits(
            MemPool.NONE,
            Transport.TCP,
            frozenset({Transport.TCP, Transport.RDMA}),
            metadata_device=Device.CPU,
            aux_side_channel=False,
            backends=frozenset(Backend),
            # NIXL runs nvlink-intra here: UCX's CUDA IPC (cuda_ipc) between processes of one node
            # on the agents' own GPU pools (cuMemAlloc'd by the process that registers them: UCX
            # cannot export memory it opened by CUDA IPC, and emulates such writes over tcp), where
            # Mooncake's intra-node NVLink needs the whole segments only the INTRA_NODE_NVLINK pool
            # allocates (tests/gpu/test_nixl_gpu.py, benchmarks/results/gpu-2026-12-07-nixl.md).
            backend_transports=((Backend.NIXL, frozenset({Transport.NVLINK_INTRA, Transport.EFA})),),
        ),
        MemPoolTraits(
            MemPool.NVLINK,
            Transport.NVLINK,
            frozenset({Transport.NVLINK}),
            # Upstream TODO: cuda once the MNNVL transport is bug-free.
            metadata_device=Device.CPU,
            aux_side_channel=True,
            backends=frozenset({Backend.MOONCAKE}),
        ),
        MemPoolTraits(
            MemPool.INTRA_NODE_NVLINK,
            Transport.NVLINK_INTRA,
            frozenset({Transport.NVLINK_INTRA}),
            # Required: Mooncake's intra-node NVLink transport refuses host memory.
            metadata_device=Device.CUDA,
            aux_side_channel=False,
            backends=frozenset({Backend.MOONCAKE}),
        ),
        MemPoolTraits(
            MemPool.BAREX,
            Transport.RDMA,
            frozenset({Transport.RDMA}),
            metadata_device=Device.CPU,
            aux_side_channel=False,
            backends=frozenset({Backend.MOONCAKE}),
        ),
    )
}

# What the declared fallback runs (placement.fallback TCP).
FALLBACK_TRANSPORT = Transport.TCP


def transport_traits(transport: Transport | str) -> TransportTraits:
    """The row of `transport`; raises ValueError on an unknown name instead of guessing."""
    return TRANSPORTS[Transport(transport)]


def mem_pool_traits(pool: MemPool | str) -> MemPoolTraits:
    return MEM_POOLS[MemPool(pool)]


def pool_transports(pool: MemPool | str, backend: Backend | str) -> frozenset[Transport]:
    """The transports ``pool`` runs with ``backend``: the pool's own, and those only that backend
    carries there (``backend_transports``)."""
    row = MEM_POOLS[MemPool(pool)]
    extra = [ts for b, ts in row.backend_transports if b is Backend(backend)]
    return row.transports.union(*extra)


def implied_transport(pool: MemPool, explicit: Transport | None) -> Transport:
    """The transport a deployment runs: the explicit choice, else the one the pool implies."""
    return explicit if explicit is not None else MEM_POOLS[pool].implied_transport


def tcp_fallback_allowed(fallback: FallbackPolicy | str, transport: Transport) -> bool:
    """Whether `transport`, failing (no placement, or a node that cannot carry it), may run tcp
    instead: only when the spec declares placement.fallback TCP, and never from tcp itself."""
    return FallbackPolicy(fallback) is FallbackPolicy.TCP and transport is not FALLBACK_TRANSPORT
