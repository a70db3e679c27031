"""Pool layout offsets and CPU pool memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfabric_agent.memory.pools import Pool, PoolLayout
from pdfabric_core.policy.types import Device
from pdfabric_core.spec import ModelGeometry

GEO = ModelGeometry(
    layers=2,
    kv_heads=4,
    head_dim=8,
    dtype="bfloat16",
    page_size_tokens=2,
    state_bytes_per_request=96,
    state_layers=3,
    aux_row_bytes=(8, 24),
)


@pytest.mark.parametrize(
    ("tp", "heads", "page", "kv_bytes"),
    [(1, 4, 128, 2 * 2 * 10 * 128), (2, 2, 64, 2 * 2 * 10 * 64), (8, 1, 32, 2 * 2 * 10 * 32)],
    ids=["tp1", "tp2", "tp8-replicated"],
)
def test_sizes_follow_geometry(tp: int, heads: int, page: int, kv_bytes: int) -> None:
    lay = PoolLayout.from_geometry(GEO, tp, kv_pages=10, state_slots=5, aux_slots=4)
    assert (lay.local_heads, lay.head_bytes, lay.page_bytes, lay.kv_bytes) == (heads, 32, page, kv_bytes)
    assert (lay.state_layer_bytes, lay.state_bytes, lay.aux_row_bytes, lay.aux_bytes) == (32, 3 * 5 * 32, 32, 128)


@pytest.mark.parametrize(
    ("layer", "kv", "page", "head", "offset"),
    [
        (0, 0, 0, 0, 0),
        (0, 0, 3, 0, 3 * 128),
        (0, 1, 0, 0, 10 * 128),
        (1, 0, 0, 0, 20 * 128),
        (1, 1, 2, 3, 32 * 128 + 96),
    ],
    ids=["origin", "page", "v-half", "next-layer", "everything"],
)
def test_kv_offset(layer: int, kv: int, page: int, head: int, offset: int) -> None:
    lay = PoolLayout.from_geometry(GEO, 1, kv_pages=10, state_slots=5, aux_slots=4)
    assert lay.kv_offset(layer, kv, page, head) == offset


def test_state_and_aux_offsets() -> None:
    lay = PoolLayout.from_geometry(GEO, 1, kv_pages=10, state_slots=5, aux_slots=4)
    assert [lay.state_offset(1, 2), lay.aux_offset(0, 3), lay.aux_offset(1, 0), lay.aux_offset(1, 2)] == [
        (5 + 2) * 32,
        24,
        8 * 4,
        8 * 4 + 48,
    ]


def test_layout_round_trips_through_json_form() -> None:
    lay = PoolLayout.from_geometry(GEO, 2, kv_pages=10, state_slots=5, aux_slots=4)
    assert PoolLayout.from_dict(lay.to_dict()) == lay


def test_cpu_pool_is_a_shared_file_removed_on_close(tmp_path: Path) -> None:
    pool = Pool.allocate("unit-kv", 4096, Device.CPU, shm_dir=str(tmp_path))
    pool.view()[10:14] = b"abcd"
    assert (tmp_path / "unit-kv").read_bytes()[10:14] == b"abcd"
    assert pool.addr != 0
    pool.close()
    assert not (tmp_path / "unit-kv").exists()


def test_empty_pool_is_one_byte(tmp_path: Path) -> None:
    pool = Pool.allocate("unit-empty", 0, Device.CPU, shm_dir=str(tmp_path))
    assert pool.size == 1
    pool.close()


def test_read_and_write_are_bounded(tmp_path: Path) -> None:
    pool = Pool.allocate("unit-rw", 64, Device.CPU, shm_dir=str(tmp_path))
    pool.write(60, b"abcd")
    assert pool.read(58, 6) == b"\0\0abcd"
    with pytest.raises(ValueError, match="outside 64"):
        pool.write(61, b"abcd")
    with pytest.raises(ValueError, match="outside 64"):
        pool.read(-1, 2)
    pool.close()
