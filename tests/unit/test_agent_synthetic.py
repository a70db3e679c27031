"""The synthetic engine's own byte count and its contents' sensitivity."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_core.spec import parse_spec
from pdfabric_devcluster.synthetic import ExpectedBytes, expected_bytes, kv_chunk, pattern

MODEL = {
    "layers": 2,
    "kvHeads": 4,
    "headDim": 32,
    "pageSizeTokens": 4,
    "stateBytesPerRequest": 1024,
    "stateLayers": 4,
    "auxRowBytes": [16, 8],
}


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        ({"tp": 2}, {"tp": 2}, ExpectedBytes(kv=7 * 2 * 2 * 2 * 512, state=2 * 2 * 1024, aux=2 * 24, state_skipped=0)),
        ({"tp": 2}, {"tp": 4}, ExpectedBytes(kv=7 * 2 * 2 * 4 * 256, state=4 * 2 * 1024, aux=4 * 24, state_skipped=0)),
        (
            {"cp": 4, "allCpRanksTransfer": True},
            {},
            ExpectedBytes(kv=7 * 2 * 2 * 1024, state=2048, aux=24, state_skipped=3 * 2048),
        ),
        (
            {"cp": 4, "dsaCacheLayerSplit": True},
            {},
            ExpectedBytes(kv=7 * 2 * 2 * 1024, state=2048, aux=24, state_skipped=0),
        ),
        ({"cp": 4}, {}, ExpectedBytes(kv=7 * 2 * 2 * 1024, state=2048, aux=24, state_skipped=0)),
    ],
    ids=["equal-tp2", "tp2-to-tp4", "cp4-all-ranks-dedup", "cp4-layer-split", "cp4-rank0-only"],
)
def test_expected_bytes(prefill: dict[str, Any], decode: dict[str, Any], expected: ExpectedBytes) -> None:
    spec = parse_spec({"prefill": prefill, "decode": decode, "model": MODEL})
    assert expected_bytes(spec, pages=7, state_slots=2, aux=True) == expected


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 1), (1, 2), (4, 4)])
def test_expected_bytes_of_an_mla_model_are_one_whole_latent_per_layer_per_decode_rank(ptp: int, dtp: int) -> None:
    # 32 bf16 elements per token, 4 tokens per page: 256 bytes a page on every rank, one buffer a layer.
    mla = {**MODEL, "kvKind": "MLA", "kvLoraRank": 24, "qkRopeHeadDim": 8}
    spec = parse_spec({"prefill": {"tp": ptp}, "decode": {"tp": dtp}, "model": mla})
    assert expected_bytes(spec, pages=7, state_slots=2, aux=True) == ExpectedBytes(
        kv=7 * 2 * dtp * 256, state=dtp * 2 * 1024, aux=dtp * 24, state_skipped=0
    )


def test_contents_differ_by_every_coordinate() -> None:
    base = kv_chunk(1, 0, 0, 0, 0, 64)
    others = [kv_chunk(2, 0, 0, 0, 0, 64), kv_chunk(1, 1, 0, 0, 0, 64), kv_chunk(1, 0, 1, 0, 0, 64)]
    others += [kv_chunk(1, 0, 0, 1, 0, 64), kv_chunk(1, 0, 0, 0, 1, 64)]
    assert all(o != base for o in others)
    assert kv_chunk(1, 0, 0, 0, 0, 64) == base


def test_shifted_copy_inside_a_chunk_is_detected() -> None:
    chunk = pattern(64, "x")
    assert chunk[8:] + chunk[:8] != chunk
    assert len(pattern(13, "odd")) == 13
