"""The NIXL backend's prepared descriptor lists: the unit a batch is cut into, the piece indices of
its blocks, and real NIXL agents (loopback tcp) writing through them byte-exact, reusing one list
per region and unit across batches, and falling back to descriptors of their own where a batch
is not served."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from pdfabric_agent.memory.block_arrays import BlockArrays
from pdfabric_agent.memory.plan import Block
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer import nixl_grids
from pdfabric_agent.transfer.base import BackendOptions, TransferError
from pdfabric_agent.transfer.nixl import NixlBackend, create
from pdfabric_agent.transfer.nixl_grids import piece_indices, unit_of
from pdfabric_agent.transfer.nixl_metadata import Region
from pdfabric_core.policy.types import Device, Transport

SIZE = 1 << 20
PAGE = 4096


def test_the_unit_divides_every_length_and_offset_on_both_sides() -> None:
    src, dst = Region(1 << 20, SIZE, "DRAM"), Region(1 << 30, SIZE, "DRAM")
    pages = [Block(src.addr + 2 * PAGE, dst.addr + 5 * PAGE, PAGE), Block(src.addr + 8 * PAGE, dst.addr, 3 * PAGE)]
    assert unit_of(BlockArrays.of(pages), src, dst) == PAGE
    slices = [Block(src.addr + 256, dst.addr + 512, 256)]  # a head slice of a page
    assert unit_of(BlockArrays.of(slices), src, dst) == 256
    assert unit_of(BlockArrays.of([Block(src.addr + 3, dst.addr, 8)]), src, dst) == 1  # odd offset: bytes
    assert unit_of(BlockArrays.of([]), src, dst) == 0


def ints(values: list[int]) -> np.ndarray:  # type: ignore[type-arg]
    return np.asarray(values, dtype=np.int64)


def test_piece_indices_cover_each_block_in_order() -> None:
    idx = piece_indices(ints([2 * PAGE, 8 * PAGE, 0]), ints([PAGE, 3 * PAGE, 2 * PAGE]), PAGE)
    assert idx.dtype == np.int32 and idx.tolist() == [2, 8, 9, 10, 0, 1]
    one = piece_indices(ints([5 * PAGE, 0, 2 * PAGE]), ints([PAGE] * 3), PAGE)  # a piece a block
    assert one.dtype == np.int32 and one.tolist() == [5, 0, 2]
    assert piece_indices(ints([]), ints([]), PAGE).tolist() == []


def backend() -> NixlBackend:
    made = create(Transport.TCP, BackendOptions(host="127.0.0.1", gpu=0, max_batch_entries=4096))
    assert isinstance(made, NixlBackend)
    return made


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[NixlBackend, NixlBackend, Pool, Pool]:
    shm = str(tmp_path_factory.mktemp("grids"))
    a, b = backend(), backend()
    pa = Pool.allocate("grids-a", SIZE, Device.CPU, shm_dir=shm)
    pb = Pool.allocate("grids-b", SIZE, Device.CPU, shm_dir=shm)
    a.register(pa)
    b.register(pb)
    a.load_metadata(*b.local_metadata())
    yield a, b, pa, pb  # type: ignore[misc]
    for each in (a, b):
        each.close()
    pa.close()
    pb.close()


def grids_made(backend: NixlBackend) -> set[tuple[str, int, int, int]]:
    return set(backend._grids._handles)


def test_scattered_pages_and_runs_land_byte_exact_through_one_prepared_list(
    pair: tuple[NixlBackend, NixlBackend, Pool, Pool],
) -> None:
    a, b, pa, pb = pair
    rng = random.Random(7)
    pa.view()[:] = os.urandom(SIZE)
    for room in range(3):
        pb.view()[:] = bytes(SIZE)
        src_pages = rng.sample(range(SIZE // PAGE - 4), 40)
        dst_pages = rng.sample(range(0, SIZE // PAGE - 4, 4), 40)  # runs of up to three never overlap
        runs = [rng.choice((1, 1, 3)) for _ in src_pages]  # single pages and coalesced runs of three
        blocks = [
            Block(pa.addr + s * PAGE, pb.addr + d * PAGE, n * PAGE)
            for s, d, n in zip(src_pages, dst_pages, runs, strict=True)
        ]
        written = {}
        for blk in blocks:
            for k in range(blk.length // PAGE):
                written[(blk.dst - pb.addr) // PAGE + k] = (blk.src - pa.addr) // PAGE + k
        a.write_batch(b.endpoint(), blocks)
        if room == 0:
            made = grids_made(a)
            assert {(k[0], k[3]) for k in made} == {("", PAGE), (b._name, PAGE)}, made
        src, dst = pa.view(), pb.view()
        for d, s in written.items():
            assert bytes(dst[d * PAGE : (d + 1) * PAGE]) == bytes(src[s * PAGE : (s + 1) * PAGE]), (room, d)
        untouched = [p for p in range(SIZE // PAGE) if p not in written]
        assert all(bytes(dst[p * PAGE : (p + 1) * PAGE]) == bytes(PAGE) for p in untouched)
    assert len(grids_made(a)) == 2, "the lists were made once and reused"


def test_a_batch_the_lists_do_not_serve_takes_descriptors_of_its_own(
    pair: tuple[NixlBackend, NixlBackend, Pool, Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, pa, pb = pair
    monkeypatch.setattr(nixl_grids, "MAX_INDICES", 2)
    before = grids_made(a)
    pa.view()[0 : 3 * PAGE] = os.urandom(3 * PAGE)
    a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr + 4 * PAGE, 3 * PAGE)])  # 3 pieces of a page
    assert bytes(pb.view()[4 * PAGE : 7 * PAGE]) == bytes(pa.view()[0 : 3 * PAGE])
    assert grids_made(a) == before


def test_a_batch_over_two_regions_a_side_lands_byte_exact_and_a_block_outside_them_fails(
    pair: tuple[NixlBackend, NixlBackend, Pool, Pool], tmp_path: Path
) -> None:
    """An engine registers a region per tensor: one batch then writes to several, a transfer per
    (source region, destination region)."""
    a, b, pa, pb = pair
    extra = Pool.allocate("grids-two", SIZE, Device.CPU, shm_dir=str(tmp_path))
    try:
        b.register(extra)
        a.load_metadata(*b.local_metadata())
        pa.view()[0 : 2 * PAGE] = os.urandom(2 * PAGE)
        blocks = [Block(pa.addr, pb.addr + 9 * PAGE, PAGE), Block(pa.addr + PAGE, extra.addr + 3 * PAGE, PAGE)]
        a.write_batch(b.endpoint(), blocks)
        assert bytes(pb.view()[9 * PAGE : 10 * PAGE]) == bytes(pa.view()[0:PAGE])
        assert bytes(extra.view()[3 * PAGE : 4 * PAGE]) == bytes(pa.view()[PAGE : 2 * PAGE])
        outside = [*blocks, Block(pa.addr, extra.addr + SIZE - 8, 16)]  # past the end of the region
        with pytest.raises(TransferError, match=f"destination {extra.addr + SIZE - 8:#x}\\+16 is in no region"):
            a.write_batch(b.endpoint(), outside)
    finally:
        b.unregister(extra)
        extra.close()
        a.load_metadata(*b.local_metadata())


def test_a_peers_lists_go_when_its_metadata_is_loaded_again(
    pair: tuple[NixlBackend, NixlBackend, Pool, Pool], tmp_path: Path
) -> None:
    a, b, pa, pb = pair
    a.write_batch(b.endpoint(), [Block(pa.addr, pb.addr, PAGE)])
    assert any(k[0] == b._name for k in grids_made(a))
    extra = Pool.allocate("grids-extra", SIZE, Device.CPU, shm_dir=str(tmp_path))
    try:
        b.register(extra)  # a new endpoint of the same agent: its regions may have changed
        a.load_metadata(*b.local_metadata())
        assert not any(k[0] == b._name for k in grids_made(a))
        pa.view()[0:8] = b"reloaded"
        a.write_batch(b.endpoint(), [Block(pa.addr, extra.addr + 8, 8)])
        assert bytes(extra.view()[8:16]) == b"reloaded"
    finally:
        b.unregister(extra)
        extra.close()
        a.load_metadata(*b.local_metadata())
