"""Destination ownership through real agents: two open rooms on one decode rank never share a KV
page, state slot or aux row; the second is refused with 409 naming the first, and nothing of it
exists; once the first room ends Success its destinations are free again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdfabric_agent.client.api import AgentRefused
from pdfabric_agent.protocol.views import RoomState
from pdfabric_devcluster.fabric import LocalFabric

pytestmark = pytest.mark.e2e

SPEC = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 5},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "stateBytesPerRequest": 64,
              "stateLayers": 2, "auxRowBytes": [8, 8]},
}  # fmt: skip
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


@pytest.fixture(scope="module")
def fabric() -> Iterator[LocalFabric]:
    with LocalFabric(SPEC) as lc:
        yield lc


@pytest.mark.parametrize(
    ("room", "pages", "state", "aux", "what"),
    [
        (60, [12, 13, 14], [5], 7, "KV pages [12]"),
        (61, [20], [3], 7, "state slots [3]"),
        (62, [21], [6], 4, "aux row [4]"),
    ],
    ids=["page", "state-slot", "aux-row"],
)
def test_overlapping_room_is_refused_naming_the_holder(
    fabric: LocalFabric, room: int, pages: list[int], state: list[int], aux: int, what: str
) -> None:
    dec = fabric.client(D)
    dec.receive(D, room, [10, 11, 12], state_indices=[3], aux_index=4)
    with pytest.raises(AgentRefused) as err:
        dec.receive(D, room + 100, pages, state_indices=state, aux_index=aux)
    assert (err.value.status, err.value.reason) == (409, "conflict")
    assert what in err.value.message and f"room {room}" in err.value.message
    with pytest.raises(AgentRefused) as gone:
        dec.poll(D, room + 100)
    assert gone.value.status == 404  # the refused room was never created
    # The holder completes; then the same destinations are free for the next room.
    fabric.client(P).send(P, room, [0, 1, 2], state_indices=[0], aux_index=0)
    assert dec.wait(D, room, 10).state is RoomState.SUCCESS
    assert fabric.client(P).wait(P, room, 10).state.title == "Success"
    dec.receive(D, room + 100, pages, state_indices=state, aux_index=aux)
    fabric.client(P).send(P, room + 100, list(range(len(pages))), state_indices=[1], aux_index=1)
    assert dec.wait(D, room + 100, 10).state is RoomState.SUCCESS


def test_an_aborted_rooms_destinations_are_free_when_the_abort_answers(fabric: LocalFabric) -> None:
    """SGLang frees a failed request's pages and hands them to its next request at once: the abort
    cancels the room at the prefill agent (which still held its room info), so the next receive of
    the same pages is taken, and the late send of the given-up room fails without writing."""
    dec, pre = fabric.client(D), fabric.client(P)
    dec.receive(D, 80, [30, 31], state_indices=[7], aux_index=6)
    deadline = time.monotonic() + 10
    while True:  # until the room info is at the prefill agent (an early room: not sent yet)
        try:
            assert pre.poll(P, 80).state is RoomState.WAITING_FOR_INPUT
            break
        except AgentRefused:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    before = fabric.metric_sum("pdfabric_transfer_bytes_total", role="prefill")
    dec.abort(D, 80, "aborted by SGLang")
    dec.receive(D, 81, [30, 31], state_indices=[7], aux_index=6)  # not 409
    late = pre.send(P, 80, [0, 1], state_indices=[0], aux_index=0)
    assert (late.state.title, late.reason) == ("Failed", "decode-0-tp0 gave the room up: aborted by SGLang")
    pre.send(P, 81, [2, 3], state_indices=[1], aux_index=1)
    assert dec.wait(D, 81, 10).state is RoomState.SUCCESS
    assert pre.wait(P, 81, 10).state is RoomState.SUCCESS
    moved = fabric.metric_sum("pdfabric_transfer_bytes_total", role="prefill") - before
    assert moved == sum(dec.poll(D, 81).moved.values())  # room 81's bytes only: nothing of room 80
