"""Destination ownership on a decode rank: open rooms never share a KV page, state slot or aux row;
a refusal names the holder (and, for a failed room held for a source that may still write, for how long
at most) and claims nothing; Success frees at once, a failed room when released or its hold ends."""

from __future__ import annotations

import pytest

from pdfabric_agent.claims import DestinationClaims
from pdfabric_agent.errors import ApiError
from pdfabric_agent.pools import PoolLayout

LAYOUT = PoolLayout(
    layers=1, local_heads=1, head_bytes=8, kv_pages=16, state_layers=1, state_layer_bytes=8, state_slots=4,
    aux_items=(8,), aux_slots=4,
)  # fmt: skip
R = "decode-0-tp0"


@pytest.mark.parametrize(
    ("second", "what"),
    [
        (([12, 13, 14], [], None), "KV pages [12] of decode-0-tp0 belong to room 60"),
        (([0], [1], None), "state slots [1] of decode-0-tp0 belong to room 60"),
        (([0], [], 2), "aux row [2] of decode-0-tp0 belong to room 60"),
    ],
    ids=["page", "state-slot", "aux-row"],
)
def test_overlap_with_an_open_room_is_refused_naming_it(
    second: tuple[list[int], list[int], int | None], what: str
) -> None:
    claims = DestinationClaims()
    claims.claim(R, LAYOUT, 60, [10, 11, 12], [1], 2)
    pages, state, aux = second
    with pytest.raises(ApiError) as err:
        claims.claim(R, LAYOUT, 61, pages, state, aux)
    assert (err.value.status, err.value.reason) == (409, "conflict")
    assert what in err.value.message
    # Nothing of the refused room was claimed: its other destinations are still free.
    claims.claim(R, LAYOUT, 62, [0, 15], [3], 3)


def test_other_ranks_and_disjoint_rooms_do_not_conflict() -> None:
    claims = DestinationClaims()
    claims.claim(R, LAYOUT, 1, [0, 1], [0], 0)
    claims.claim(R, LAYOUT, 2, [2, 3], [1], 1)
    claims.claim("decode-0-tp1", LAYOUT, 3, [0, 1], [0], 0)
    assert (claims.holder(R, 1), claims.holder(R, 2), claims.holder("decode-0-tp1", 0)) == (1, 2, 3)


def test_release_frees_exactly_the_rooms_destinations() -> None:
    claims = DestinationClaims()
    a = claims.claim(R, LAYOUT, 1, [0, 1], [0], 0)
    claims.claim(R, LAYOUT, 2, [2], [1], 1)
    claims.release(R, a)
    assert claims.holder(R, 0) is None and claims.holder(R, 2) == 2
    claims.claim(R, LAYOUT, 3, [0, 1], [0], 0)
    claims.release(R, a)  # a second release of an old claim frees nothing of the new room's
    assert claims.holder(R, 0) == 3


def test_held_claims_free_only_when_their_time_comes() -> None:
    claims = DestinationClaims()
    a = claims.claim(R, LAYOUT, 1, [5], [], None)
    claims.hold(R, a, until=110.0)
    claims.sweep(109.9)
    with pytest.raises(ApiError):
        claims.claim(R, LAYOUT, 2, [5], [], None)
    claims.sweep(110.0)
    claims.claim(R, LAYOUT, 2, [5], [], None)


def test_a_held_claim_says_so_and_an_early_release_frees_it() -> None:
    now = [100.0]
    claims = DestinationClaims(clock=lambda: now[0])
    a = claims.claim(R, LAYOUT, 1, [5], [], None)
    claims.hold(R, a, until=130.0)
    now[0] = 110.0
    with pytest.raises(ApiError) as err:
        claims.claim(R, LAYOUT, 2, [5], [], None)
    assert "room 1, which failed while a source may still be writing" in err.value.message
    assert "at most 20.0 s from now" in err.value.message
    claims.release(R, a)  # its sources said they stopped
    b = claims.claim(R, LAYOUT, 2, [5], [], None)
    claims.sweep(130.0)  # the old hold's time frees nothing of the new room's
    assert claims.holder(R, 5) == 2 and b != a
