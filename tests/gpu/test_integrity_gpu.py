"""spec.transfer.verify on GPU pools (one GPU is enough): the device sum equals the CPU sum of the
same bytes, follows the bytes through a plan's copy, sees a flipped byte, works when the aux pool
is on the CPU beside GPU KV (the NVLINK pool's metadata device), and its speed is printed."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from pdfabric_agent.memory.pools import Pool, PoolLayout, RankPools
from pdfabric_agent.rooms import integrity
from pdfabric_core.policy.types import Device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

LAYOUT = PoolLayout(layers=4, local_heads=8, head_bytes=4096, kv_pages=512, state_layers=2, state_layer_bytes=4096,
                    state_slots=4, aux_items=(64, 200), aux_slots=8)  # fmt: skip


def rank_pools(tmp: Path, tag: str, aux_device: Device) -> RankPools:
    return RankPools(
        LAYOUT,
        Pool.allocate(f"{tag}-kv", LAYOUT.kv_bytes, Device.CUDA, shm_dir=str(tmp)),
        Pool.allocate(f"{tag}-state", LAYOUT.state_bytes, Device.CUDA, shm_dir=str(tmp)),
        Pool.allocate(f"{tag}-aux", LAYOUT.aux_bytes, aux_device, shm_dir=str(tmp)),
    )


def fill(pools: RankPools, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for pool in pools.all():
        data = torch.randint(0, 256, (pool.size,), dtype=torch.uint8, device="cuda", generator=gen)
        if pool.device is Device.CUDA:
            pool.tensor().copy_(data)
        else:
            pool.write(0, data.cpu().numpy().tobytes())


def regions(pools: RankPools, pages: list[int]) -> list[tuple[int, int]]:
    page = LAYOUT.page_bytes
    kv = [(pools.kv.addr + b * LAYOUT.kv_pages * page + p * page + 100, page - 200) for b in range(8) for p in pages]
    return [*kv, (pools.state.addr + 5, 3000), (pools.aux.addr + 64, 200), (pools.aux.addr + 3, 61)]


@pytest.mark.parametrize("aux_device", [Device.CUDA, Device.CPU], ids=["aux-on-gpu", "aux-on-cpu"])
def test_device_sum_equals_the_cpu_sum_and_follows_the_bytes(tmp_path: Path, aux_device: Device) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    src = rank_pools(tmp_path, "src", aux_device)
    fill(src, seed)
    pages = random.Random(seed).sample(range(LAYOUT.kv_pages), 200)
    theirs = integrity.checksum(src.all(), regions(src, pages))
    # The same bytes in CPU pools: the numpy sum must give the same value.
    cpu = RankPools(LAYOUT, *(Pool.allocate(f"cpu-{k}", p.size, Device.CPU, shm_dir=str(tmp_path))
                              for k, p in zip(("kv", "state", "aux"), src.all(), strict=True)))  # fmt: skip
    for s, c in zip(src.all(), cpu.all(), strict=True):
        c.write(0, s.read(0, s.size))
    assert integrity.checksum(cpu.all(), regions(cpu, pages)) == theirs
    # Copied region by region into other GPU pools: equal; one flipped byte: not.
    dst = rank_pools(tmp_path, "dst", aux_device)
    fill(dst, seed + 1)
    for (sa, n), (da, _) in zip(regions(src, pages), regions(dst, pages), strict=True):
        sp = next(p for p in src.all() if p.addr <= sa < p.addr + p.size)
        dp = next(p for p in dst.all() if p.addr <= da < p.addr + p.size)
        dp.write(da - dp.addr, sp.read(sa - sp.addr, n))
    assert integrity.checksum(dst.all(), regions(dst, pages)) == theirs
    addr, n = regions(dst, pages)[123]
    dst.kv.tensor()[addr - dst.kv.addr + n // 3] ^= 1
    assert integrity.checksum(dst.all(), regions(dst, pages)) != theirs
    for p in (*src.all(), *dst.all(), *cpu.all()):
        p.close()


def test_device_sum_speed(tmp_path: Path) -> None:
    """Prints GB/s of the sum over 64 KiB regions of a 1 GiB GPU pool, beside a device copy."""
    pool = Pool.allocate("speed", 1 << 30, Device.CUDA, shm_dir=str(tmp_path))
    small = Pool.allocate("speed-s", 1, Device.CUDA, shm_dir=str(tmp_path))
    pools = RankPools(LAYOUT, pool, small, small)
    pool.tensor().random_(0, 256)
    pages = list(range((1 << 30) // (64 << 10)))[::-1]  # every 64 KiB page, scattered order
    rows = integrity.Rows(pool.addr, 64 << 10, 64 << 10, pages)  # how a KV buffer's pages are summed
    regions = integrity.flat([rows])
    assert integrity.checksum(pools.all(), [rows]) == integrity.checksum(pools.all(), regions)
    torch.cuda.synchronize()
    start = time.perf_counter()
    integrity.checksum(pools.all(), regions)
    by_region = time.perf_counter() - start
    start = time.perf_counter()
    integrity.checksum(pools.all(), [rows])
    summed = time.perf_counter() - start
    out = torch.empty_like(pool.tensor())
    torch.cuda.synchronize()
    start = time.perf_counter()
    out.copy_(pool.tensor())
    torch.cuda.synchronize()
    copied = time.perf_counter() - start
    print(
        f"integrity sum: {1 / summed:.1f} GiB/s as rows, {1 / by_region:.1f} GiB/s region by region, over 16384 x "
        f"64 KiB pages; device copy {1 / copied:.1f} GiB/s"
    )
    pool.close()
