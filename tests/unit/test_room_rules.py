"""A room owns its life (issue 42): the rules of a prefill and a decode room's state machine, each
transition and its refusals, without an agent; and the registry's one outcome per room, counted
and retired once, whatever the callers do after."""

from __future__ import annotations

import pytest

from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.labels import Outcome
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.rooms.registry import MetricLabels, RoomRegistry
from pdfabric_agent.rooms.room import AnyRoom, DecodeRoom, PrefillRoom, Target
from pdfabric_agent.runtime import metrics
from pdfabric_core.policy.types import Role
from tests.unit.agents import room_info

P = "prefill-0-tp0-cp0"
D0, D1 = "decode-0-tp0", "decode-0-tp1"


def prefill_room(**changes: object) -> PrefillRoom:
    targets = {D1: Target(D1, 1, "agent-b"), D0: Target(D0, 0, "agent-a")}
    room = PrefillRoom(
        rank=P, room=7, submitted=10.0, deadline=15.0, src_pages=[3], src_state=[], src_aux=None, targets=targets
    )
    for name, value in changes.items():
        setattr(room, name, value)
    return room


def decode_room() -> DecodeRoom:
    expected = {"prefill-0-tp1-cp0": "agent-b", "prefill-0-tp0-cp0": "agent-a"}
    return DecodeRoom(
        rank=D0, room=7, submitted=10.0, deadline=15.0, dst_pages=[0, 1], dst_state=[], dst_aux=None, expected=expected
    )


def refusal(call: object, *args: object) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


# ---------------------------------------------------------------- what every room has
def test_each_room_knows_its_role() -> None:
    assert (prefill_room().role, decode_room().role) == (Role.PREFILL, Role.DECODE)


def test_a_room_expires_at_its_deadline() -> None:
    room = prefill_room()
    assert not room.expired(14.999)
    assert room.expired(15.0) and room.expired(16.0)


def test_a_phase_mark_is_the_latest_and_a_first_mark_the_first() -> None:
    room = prefill_room()
    room.mark("written:x", 11.0)
    room.mark("written:x", 12.0)
    room.mark_first("first-byte", 11.5)
    room.mark_first("first-byte", 13.0)
    assert room.marks == {"written:x": 12.0, "first-byte": 11.5}
    assert room.view().phases_s == {"written:x": 2.0, "first-byte": 1.5}


def test_the_first_outcome_is_the_rooms_one_outcome() -> None:
    room = prefill_room()
    assert room.end(RoomState.FAILED, "first")
    assert not room.end(RoomState.SUCCESS, "second")
    assert not room.end(RoomState.FAILED, "third")
    assert (room.state, room.reason) == (RoomState.FAILED, "first")


def test_a_state_that_is_no_outcome_does_not_end_a_room() -> None:
    room = prefill_room()
    with pytest.raises(ValueError, match="Transferring is not an outcome: a room ends Success or Failed"):
        room.end(RoomState.TRANSFERRING)
    assert room.state is RoomState.BOOTSTRAPPING


def test_a_rooms_end_is_its_last_phase() -> None:
    room = decode_room()
    room.stamp_end(12.5)
    assert room.finished_at == 12.5 and room.view().phases_s == {"ended": 2.5}


# ---------------------------------------------------------------- a prefill room
def test_a_prefill_room_is_ready_once_every_target_has_its_room_info() -> None:
    room = prefill_room()
    assert room.missing_room_info() == [D0, D1] and not room.ready and room.targets_with_room_info() == []
    room.take_room_info(room_info(7, decode_rank=D1))
    assert room.missing_room_info() == [D0] and not room.ready
    assert [t.decode_rank for t in room.targets_with_room_info()] == [D1]
    room.take_room_info(room_info(7, decode_rank=D0))
    assert room.missing_room_info() == [] and room.ready
    assert room.targets[D0].dst is not None and room.targets[D0].dst.decode_rank == D0


def test_room_info_of_a_rank_the_room_does_not_send_to_is_malformed() -> None:
    room = prefill_room()
    err = refusal(room.take_room_info, room_info(7, decode_rank="decode-0-tp5"))
    assert (err.status, err.message) == (400, f"room 7 on {P} does not send to decode-0-tp5")
    assert room.missing_room_info() == [D0, D1]


def test_a_second_copy_of_room_info_is_a_conflict_and_redirects_nothing() -> None:
    room = prefill_room()
    first = room_info(7, decode_rank=D0)
    room.take_room_info(first)
    err = refusal(room.take_room_info, room_info(7, decode_rank=D0, endpoint="elsewhere:1"))
    assert (err.status, err.message) == (409, f"room 7 on {P} already has room info of {D0}")
    assert room.targets[D0].dst is first


def test_room_info_for_a_room_past_bootstrapping_is_a_conflict() -> None:
    room = prefill_room(state=RoomState.FAILED)
    err = refusal(room.take_room_info, room_info(7, decode_rank=D1))
    assert (err.status, err.message) == (409, f"room 7 on {P} already has room info of {D1}")
    assert room.targets[D1].dst is None
    assert not prefill_room(state=RoomState.TRANSFERRING).ready


def test_early_room_info_goes_to_the_targets_only() -> None:
    room = prefill_room()
    room.take_early_room_info({D0: room_info(7, decode_rank=D0), "decode-0-tp5": room_info(7)})
    assert room.missing_room_info() == [D1]


def test_starting_the_transfer_sets_the_state_its_mark_and_the_transfer_deadline() -> None:
    room = prefill_room()
    room.start_transfer(12.0, 30.0)
    assert (room.state, room.deadline, room.marks) == (RoomState.TRANSFERRING, 42.0, {"transferring": 12.0})


def test_a_chunk_adds_its_pages_in_order_and_the_final_one_seals_the_room() -> None:
    room = prefill_room(sealed=False)
    room.take_chunk([4, 5], 1, 11.0)
    assert (room.src_pages, room.sealed, room.marks) == ([3, 4, 5], False, {"chunk:1": 11.0})
    room.seal((2,), 9)
    assert (room.src_state, room.src_aux, room.sealed) == ([2], 9, True)
    room.renew_deadline(20.0, 30.0)
    assert room.deadline == 50.0


def test_the_targets_not_done_and_their_agents() -> None:
    room = prefill_room()
    room.targets[D0].agent = room.targets[D1].agent = "agent-b"
    assert room.agents_not_done() == ["agent-b"]
    room.acknowledged(room.targets[D1], 13.0)
    assert [t.decode_rank for t in room.targets_not_done()] == [D0]
    assert room.marks == {f"acknowledged:{D1}": 13.0} and room.targets[D1].done
    room.acknowledged(room.targets[D0], 14.0)
    assert room.targets_not_done() == [] and room.agents_not_done() == []


def test_writes_to_a_decode_rank_are_fenced_unless_one_is_in_flight() -> None:
    room = prefill_room()
    room.targets[D1].writing = True
    assert room.fenced(D0) and not room.fenced(D1)
    err = refusal(room.fenced, "decode-0-tp5")
    assert (err.status, err.message) == (400, f"room 7 on {P} does not send to decode-0-tp5")


def test_bytes_moved_and_state_skipped_are_in_the_view() -> None:
    room = prefill_room()
    room.count_moved("aux", 8)
    room.count_moved("aux", 8)
    room.count_skipped_state(100)
    view = room.view()
    assert (view.moved["aux"], view.state_bytes_skipped) == (16, 100)


# ---------------------------------------------------------------- a decode room
def test_a_source_turning_quiet_says_when_the_room_just_became_wholly_quiet() -> None:
    room = decode_room()
    assert not room.source_quiet("prefill-0-tp0-cp0")
    assert not room.sources_quiet
    assert room.source_quiet("prefill-0-tp1-cp0")
    assert room.sources_quiet
    assert not room.source_quiet("prefill-0-tp1-cp0")  # quiet already: nothing became


def test_a_sources_arrival_counts_its_bytes_once_for_the_room_and_the_source() -> None:
    room = decode_room()
    by_path = {"tcp": {"kv": 100, "aux": 0}, "tcp-side-channel": {"aux": 8}}
    sent = room.source_arrived("prefill-0-tp0-cp0", by_path)
    assert sent == {"kv": 100, "state": 0, "aux": 8}
    assert room.senders == {"prefill-0-tp0-cp0": sent} and room.moved == sent
    assert room.arrived == {"prefill-0-tp0-cp0"} and room.quiet == {"prefill-0-tp0-cp0"}
    assert room.state is RoomState.TRANSFERRING
    assert room.missing_sources() == ["prefill-0-tp1-cp0"] and not room.all_arrived
    assert room.sources_not_arrived() == {"prefill-0-tp1-cp0": "agent-b"}
    assert room.done_with("prefill-0-tp0-cp0") and not room.done_with("prefill-0-tp1-cp0")
    room.source_arrived("prefill-0-tp1-cp0", {})
    assert room.all_arrived and room.sources_not_arrived() == {} and room.missing_sources() == []


def test_a_failed_room_stays_failed_when_a_source_arrives_or_launches() -> None:
    room = decode_room()
    room.end(RoomState.FAILED, "gave up")
    room.source_launched("prefill-0-tp0-cp0", 11.0)
    room.source_arrived("prefill-0-tp0-cp0", {})
    assert room.state is RoomState.FAILED and room.marks == {"notified:prefill-0-tp0-cp0": 11.0}
    assert room.done_with("prefill-0-tp1-cp0")  # an ended room takes nothing more from any source


def test_a_launch_makes_a_waiting_room_transferring() -> None:
    room = decode_room()
    room.source_launched("prefill-0-tp1-cp0", 12.0)
    assert room.state is RoomState.TRANSFERRING and room.marks == {"notified:prefill-0-tp1-cp0": 12.0}


def test_room_info_pushed_moves_only_a_bootstrapping_room_to_waiting() -> None:
    room = decode_room()
    room.room_info_pushed()
    assert room.state is RoomState.WAITING_FOR_INPUT
    room.state = RoomState.TRANSFERRING  # a launch notice was quicker than the push's answers
    room.room_info_pushed()
    assert room.state is RoomState.TRANSFERRING


def test_a_sharded_rooms_positions_and_the_engines_aux_rows_are_kept() -> None:
    room = decode_room()
    room.take_positions("prefill-0-tp0-cp0", (0,))
    room.keep_aux_rows((b"row",))
    assert room.positions == {"prefill-0-tp0-cp0": (0,)} and room.view().aux_rows == (b"row",)


# ---------------------------------------------------------------- the registry
def requests(cluster: str, role: Role, outcome: Outcome) -> float:
    labels = {"pdcluster": cluster, "role": role.value, "outcome": outcome.value}
    return metrics.REGISTRY.get_sample_value("pdfabric_requests_total", labels) or 0.0


def test_finish_is_the_one_outcome_counted_and_retired_once() -> None:
    cluster = "room-rules-finish"
    clock = iter([20.0, 21.0, 22.0])
    rooms = RoomRegistry(MetricLabels(cluster, "tcp", "tcp"), lambda: next(clock))
    retired: list[AnyRoom] = []
    rooms.on_retire.append(retired.append)
    room = prefill_room()
    rooms.add(room)
    assert rooms.open_count == 1 and rooms.get(Role.PREFILL, P, 7) is room and rooms.get(Role.DECODE, P, 7) is None
    rooms.finish(room, RoomState.FAILED, "no room info", outcome=Outcome.TIMEOUT)
    rooms.finish(room, RoomState.SUCCESS)
    rooms.finish(room, RoomState.FAILED, "again")
    assert (room.state, room.reason, room.finished_at) == (RoomState.FAILED, "no room info", 20.0)
    assert retired == [room] and rooms.open_count == 0
    assert requests(cluster, Role.PREFILL, Outcome.TIMEOUT) == 1.0
    assert requests(cluster, Role.PREFILL, Outcome.SUCCESS) == requests(cluster, Role.PREFILL, Outcome.FAILED) == 0.0


def test_a_room_is_kept_by_its_own_role_and_forgotten_after_its_ttl() -> None:
    cluster = "room-rules-roles"
    rooms = RoomRegistry(MetricLabels(cluster, "tcp", "tcp"), lambda: 30.0)
    prefill, decode = prefill_room(), decode_room()
    rooms.add(prefill)
    rooms.add(decode)
    assert [role for role, _ in rooms.open_rooms()] == [Role.PREFILL, Role.DECODE]
    assert rooms.rooms_of(Role.DECODE, D0) == [decode] and rooms.prefill_room(P, 7) is prefill
    rooms.finish(decode, RoomState.SUCCESS)
    assert [room for _, room in rooms.open_rooms()] == [prefill]
    assert requests(cluster, Role.DECODE, Outcome.SUCCESS) == 1.0  # no loop runs: counted at once
    rooms.forget(40.0, 10.0, 5.0)
    assert rooms.get(Role.DECODE, D0, 7) is decode  # not past its TTL yet
    rooms.forget(40.5, 10.0, 5.0)
    assert rooms.get(Role.DECODE, D0, 7) is None and rooms.prefill_room(P, 7) is prefill  # open rooms stay
