"""A GPU pool is a device allocation of its own, so its CUDA IPC export (which opens the whole
allocation around the exported pointer) reaches this pool and nothing of the agent's beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.pools import Pool
from pdfabric_core.policy.types import Device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
GRANULE = 2 << 20  # the driver rounds allocations up to this


def test_each_pool_export_opens_only_that_pool(tmp_path: Path) -> None:
    other = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")  # torch's allocator, in between
    pools = [
        Pool.allocate(f"p{i}", size, Device.CUDA, shm_dir=str(tmp_path)) for i, size in enumerate((4096, 3 << 20, 1))
    ]
    try:
        spans = []
        for pool in pools:
            base, size = cuda.address_range(pool.addr)
            export = json.loads(pool.handle)
            assert base == pool.addr and pool.size <= size < pool.size + GRANULE, (pool.name, base, size)
            assert export["offset"] == 0 and export["nbytes"] == pool.size
            assert bool((pool.tensor() == 0).all())  # zero-filled
            spans.append((base, base + size))
        # No pool's allocation holds another pool or torch's tensor.
        for i, (lo, hi) in enumerate(spans):
            for j, pool in enumerate(pools):
                assert i == j or not lo <= pool.addr < hi
            assert not lo <= other.data_ptr() < hi
    finally:
        for pool in pools:
            pool.close()
