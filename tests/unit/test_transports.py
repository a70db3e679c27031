"""The transport and memory-pool tables, and the one TCP-fallback rule."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.transports import (
    MEM_POOLS,
    TRANSPORTS,
    Locality,
    implied_transport,
    tcp_fallback_allowed,
    transport_traits,
)
from pdfabric_core.policy.types import FallbackPolicy, MemPool, Transport


@pytest.mark.parametrize(
    ("fallback", "transport", "expected"),
    [
        (FallbackPolicy.TCP, Transport.RDMA, True),
        (FallbackPolicy.TCP, Transport.NVLINK_INTRA, True),
        (FallbackPolicy.TCP, Transport.TCP, False),
        (FallbackPolicy.FAIL, Transport.RDMA, False),
        ("TCP", Transport.NVLINK, True),
    ],
    ids=["declared-rdma", "declared-intra", "never-from-tcp", "fail-policy", "string-policy"],
)
def test_tcp_fallback_allowed(fallback: FallbackPolicy | str, transport: Transport, expected: bool) -> None:
    assert tcp_fallback_allowed(fallback, transport) is expected


@pytest.mark.parametrize(
    ("transport", "locality", "device_resource"),
    [
        (Transport.TCP, Locality.ANY, False),
        (Transport.RDMA, Locality.ANY, True),
        (Transport.NVLINK_INTRA, Locality.NODE, False),
        (Transport.NVLINK, Locality.DOMAIN, False),
    ],
    ids=["tcp-anywhere", "rdma-requests-a-device", "intra-node-one-node", "mnnvl-one-domain"],
)
def test_placement_traits(transport: Transport, locality: Locality, device_resource: bool) -> None:
    traits = transport_traits(transport)
    assert (traits.locality, traits.device_resource) == (locality, device_resource)


def test_every_value_has_a_row_keyed_by_itself() -> None:
    assert all(TRANSPORTS[t].transport is t for t in Transport) and set(TRANSPORTS) == set(Transport)
    assert all(MEM_POOLS[p].pool is p for p in MemPool) and set(MEM_POOLS) == set(MemPool)


@pytest.mark.parametrize(
    ("pool", "explicit", "expected"),
    [
        (MemPool.NONE, None, Transport.TCP),
        (MemPool.NONE, Transport.RDMA, Transport.RDMA),
        (MemPool.NVLINK, None, Transport.NVLINK),
        (MemPool.INTRA_NODE_NVLINK, None, Transport.NVLINK_INTRA),
        (MemPool.BAREX, None, Transport.RDMA),
    ],
    ids=["none-tcp", "explicit-wins", "nvlink", "intra-node", "barex-rdma"],
)
def test_implied_transport(pool: MemPool, explicit: Transport | None, expected: Transport) -> None:
    assert implied_transport(pool, explicit) is expected


def test_unknown_transport_is_an_error() -> None:
    with pytest.raises(ValueError):
        transport_traits("infiniband")
