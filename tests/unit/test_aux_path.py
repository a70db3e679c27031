"""Aux path (sglang #26707): TCP only for the pool exactly NVLINK or aux-over-TCP; never a
substring match: ``pool in ("NVLINK")`` tests for a substring of "NVLINK" (upstream review)."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.aux_path import AuxPath, choose_aux_path
from pdfabric_core.policy.types import MemPool


@pytest.mark.parametrize(
    ("pool", "over_tcp", "expected"),
    [
        (MemPool.NONE, False, AuxPath.ENGINE),
        (MemPool.NONE, True, AuxPath.TCP),
        (MemPool.NVLINK, False, AuxPath.TCP),
        (MemPool.INTRA_NODE_NVLINK, False, AuxPath.ENGINE),
        (MemPool.INTRA_NODE_NVLINK, True, AuxPath.TCP),
        (MemPool.BAREX, False, AuxPath.ENGINE),
        ("INTRA_NODE_NVLINK", False, AuxPath.ENGINE),
        ("NVLINK", False, AuxPath.TCP),
    ],
    ids=[
        "none",
        "none-aux-over-tcp",
        "nvlink-exact",
        "intra-node-nvlink-not-substring",
        "intra-node-flag",
        "barex",
        "string-intra",
        "string-nvlink",
    ],
)
def test_choose_aux_path(pool: MemPool | str, over_tcp: bool, expected: AuxPath) -> None:
    assert choose_aux_path(pool, aux_over_tcp=over_tcp) is expected


@pytest.mark.parametrize("value", ["", "NV", "LINK", "VLIN"], ids=["empty", "nv", "link", "vlin"])
def test_the_substring_trap_is_real_and_avoided(value: str) -> None:
    # The upstream bug: a parenthesised string is not a tuple, so `in` tests for a substring and
    # an empty or partial pool name would have sent aux over TCP.
    upstream_says_tcp = value in ("NVLINK")  # noqa: RUF100 - the trap itself, on purpose
    assert upstream_says_tcp
    with pytest.raises(ValueError):
        choose_aux_path(value, aux_over_tcp=False)


@pytest.mark.parametrize(
    "pool", ["nvlink", "NVLINK ", "MNNVL", ""], ids=["lowercase", "trailing-space", "unknown", "empty"]
)
def test_unknown_pool_names_are_errors_not_guesses(pool: str) -> None:
    with pytest.raises(ValueError):
        choose_aux_path(pool, aux_over_tcp=False)
