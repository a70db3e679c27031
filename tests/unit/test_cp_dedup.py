"""CP-replicated state dedup (sglang #36025): the upstream parametrised cases and the edges."""

from __future__ import annotations

import pytest

from pdfabric_core.policy.cp_dedup import should_skip_state_transfer


@pytest.mark.parametrize(
    ("cp_size", "cp_rank", "split", "skip"),
    [
        (1, 0, False, False),
        (4, 0, False, False),
        (4, 1, False, True),
        (4, 3, False, True),
        (4, 3, True, False),
        (8, 7, False, True),
        (8, 0, True, False),
    ],
    ids=[
        "single-rank",
        "cp-rank-0-sends",
        "cp-rank-1-skips",
        "cp-rank-3-skips",
        "layer-split-sends",
        "cp8-last-skips",
        "cp8-rank0-split",
    ],
)
def test_should_skip_state_transfer(cp_size: int, cp_rank: int, split: bool, skip: bool) -> None:
    assert should_skip_state_transfer(cp_size, cp_rank, dsa_cache_layer_split=split) is skip


@pytest.mark.parametrize(
    ("cp_size", "cp_rank"), [(4, 4), (4, -1), (0, 0)], ids=["rank-too-big", "negative", "empty-group"]
)
def test_rank_outside_group_is_an_error(cp_size: int, cp_rank: int) -> None:
    with pytest.raises(ValueError, match="outside a CP group"):
        should_skip_state_transfer(cp_size, cp_rank, dsa_cache_layer_split=False)
