"""Destination ownership on a decode rank: open rooms never share a KV page, state slot or aux row;
a refusal names the holder (and, for a failed room held for a source that may still write, for how long
at most) and claims nothing; Success frees at once, a failed room when released or its hold ends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.rooms.claims import DestinationClaims

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
    claims.claim(R, 60, [10, 11, 12], [1], 2)
    pages, state, aux = second
    with pytest.raises(ApiError) as err:
        claims.claim(R, 61, pages, state, aux)
    assert (err.value.status, err.value.reason) == (409, "conflict")
    assert what in err.value.message
    # Nothing of the refused room was claimed: its other destinations are still free.
    claims.claim(R, 62, [0, 15], [3], 3)


def test_other_ranks_and_disjoint_rooms_do_not_conflict() -> None:
    claims = DestinationClaims()
    claims.claim(R, 1, [0, 1], [0], 0)
    claims.claim(R, 2, [2, 3], [1], 1)
    claims.claim("decode-0-tp1", 3, [0, 1], [0], 0)
    assert (claims.holder(R, 1), claims.holder(R, 2), claims.holder("decode-0-tp1", 0)) == (1, 2, 3)


def test_release_frees_exactly_the_rooms_destinations() -> None:
    claims = DestinationClaims()
    a = claims.claim(R, 1, [0, 1], [0], 0)
    claims.claim(R, 2, [2], [1], 1)
    claims.release(R, a)
    assert claims.holder(R, 0) is None and claims.holder(R, 2) == 2
    claims.claim(R, 3, [0, 1], [0], 0)
    claims.release(R, a)  # a second release of an old claim frees nothing of the new room's
    assert claims.holder(R, 0) == 3


def test_held_claims_free_only_when_their_time_comes() -> None:
    claims = DestinationClaims()
    a = claims.claim(R, 1, [5], [], None)
    claims.hold(R, a, until=110.0)
    claims.sweep(109.9)
    with pytest.raises(ApiError):
        claims.claim(R, 2, [5], [], None)
    claims.sweep(110.0)
    claims.claim(R, 2, [5], [], None)


def test_a_held_claim_says_so_and_an_early_release_frees_it() -> None:
    now = [100.0]
    claims = DestinationClaims(clock=lambda: now[0])
    a = claims.claim(R, 1, [5], [], None)
    claims.hold(R, a, until=130.0)
    now[0] = 110.0
    with pytest.raises(ApiError) as err:
        claims.claim(R, 2, [5], [], None)
    assert "room 1, which failed while a source may still be writing" in err.value.message
    assert "at most 20.0 s from now" in err.value.message
    claims.release(R, a)  # its sources said they stopped
    b = claims.claim(R, 2, [5], [], None)
    claims.sweep(130.0)  # the old hold's time frees nothing of the new room's
    assert claims.holder(R, 5) == 2 and b != a


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["claim", "release", "hold", "sweep"]),
            st.lists(st.integers(0, 3 * 4096 + 7), max_size=12),  # pages over several owner chunks
            st.integers(0, 5),
        ),
        max_size=40,
    )
)
def test_claims_match_a_plain_model_and_free_their_memory(ops: list[tuple[str, list[int], int]]) -> None:
    """Random claims, releases, holds and sweeps against a dict of page -> room: the same
    refusals, the same holders, and no owner table left once nothing is claimed."""
    now = [0.0]
    claims = DestinationClaims(clock=lambda: now[0])
    model: dict[int, int] = {}  # page -> room
    slots: dict[int, tuple[int, list[int]]] = {}  # slot -> (room, pages)
    held: dict[int, float] = {}
    for room, (op, pages, pick) in enumerate(ops):
        if op == "claim":
            overlap = any(p in model for p in pages)
            try:
                slot = claims.claim(R, room, pages, [], None)
            except ApiError as err:
                assert overlap and err.status == 409
                continue
            assert not overlap
            slots[slot] = (room, pages)
            model.update(dict.fromkeys(pages, room))
            continue
        elif op in ("release", "hold") and slots:
            slot = sorted(slots)[pick % len(slots)]
            if op == "hold":
                claims.hold(R, slot, now[0] + 1.0)
                held[slot] = now[0] + 1.0
                continue
            claims.release(R, slot)
        elif op == "sweep":
            now[0] += 0.6
            claims.sweep(now[0])
            for slot in [s for s, due in held.items() if due <= now[0]]:
                held.pop(slot)
                if slot in slots:
                    claims.release(R, slot)  # what the sweep did: releasing again is a no-op
                    _, slot_pages = slots.pop(slot)
                    for p in slot_pages:
                        model.pop(p, None)
            continue
        else:
            continue
        _, pages_ = slots.pop(slot)
        held.pop(slot, None)
        for p in pages_:
            model.pop(p, None)
    for page in range(3 * 4096 + 8):
        assert claims.holder(R, page) == model.get(page)
    for slot in list(slots):
        claims.release(R, slot)
    assert claims.nbytes() == 0


def test_a_claim_anywhere_in_a_huge_pool_costs_one_chunk() -> None:
    """Memory follows the claims in flight, not the registered size: a page at 2^40 (a sparse
    multi-TiB registration) is claimable and costs 32 KiB, freed with the claim."""
    claims = DestinationClaims()
    slot = claims.claim(R, 1, [1 << 40, (1 << 40) + 1], [7], None)
    assert claims.holder(R, 1 << 40) == 1 and claims.holder(R, 0) is None
    assert claims.nbytes() == 2 * 4096 * 8  # one chunk of pages, one of state slots
    claims.release(R, slot)
    assert claims.nbytes() == 0
