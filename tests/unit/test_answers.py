"""The agent's typed answers: what it writes (``to_json``) is what every caller reads back
(``parse``), field for field, and an answer that is not one is refused with the field named
instead of reaching an engine as a dictionary it would have to second-guess."""

from __future__ import annotations

from typing import Any

import pytest

from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.info import AgentInfo, PoolInfo, RankInfo
from pdfabric_agent.protocol.peer_answers import CancelAnswer, RoomInfoTaken, SourceAnswer
from pdfabric_agent.protocol.views import MemoryAnswer, RoomState, RoomView
from pdfabric_core.spec import parse_spec
from tests.unit.agents import TCP_RAW

VIEWS = [
    RoomView(rank="decode-0-tp0", room=7, state=RoomState.BOOTSTRAPPING, submitted_at=12.5, phases_s={}),
    RoomView(
        rank="decode-0-tp0",
        room=8,
        state=RoomState.SUCCESS,
        moved={"kv": 4096, "state": 64, "aux": 16},
        submitted_at=3.25,
        phases_s={"arrived:prefill-0-tp0-cp0": 0.002},
        senders={"prefill-0-tp0-cp0": {"kv": 4096, "state": 64, "aux": 16}},
        sources_quiet=True,
    ),
    RoomView(
        rank="prefill-0-tp0-cp0",
        room=9,
        state=RoomState.FAILED,
        reason="decode-0-tp0 gave the room up",
        submitted_at=1.0,
        phases_s={"planned:decode-0-tp0": 0.001},
        state_bytes_skipped=192,
    ),
    RoomView(
        rank="prefill-0-tp1-cp0",
        room=10,
        state=RoomState.WAITING_FOR_INPUT,
        reason="TP rank 1's KV heads are replicated",
        decode_ranks_ready=(),
        sends=False,
    ),
    RoomView(
        rank="prefill-0-tp0-cp0",
        room=11,
        state=RoomState.WAITING_FOR_INPUT,
        decode_ranks_ready=("decode-1-tp0",),
        decode_prefix_tokens=32,
    ),
    RoomView(rank="decode-0-tp0", room=12, state=RoomState.FAILED, reason="aborted", told=2),
]


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: f"room-{v.room}")
def test_a_room_view_reads_back_as_written(view: RoomView) -> None:
    doc = view.to_json()
    assert (doc["state"], doc["code"]) == (view.state.title, int(view.state))  # SGLang's KVPoll number too
    assert RoomView.parse(doc) == view


def test_room_states_are_sglangs_kvpoll_numbers_and_names() -> None:
    assert [(int(s), s.title) for s in RoomState] == [
        (0, "Failed"),
        (1, "Bootstrapping"),
        (2, "WaitingForInput"),
        (3, "Transferring"),
        (4, "Success"),
    ]
    assert [s for s in RoomState if s.finished] == [RoomState.FAILED, RoomState.SUCCESS]
    assert RoomState.of_title("Transferring") is RoomState.TRANSFERRING


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ([], "is not a JSON object"),
        ({"rank": "d", "room": 1, "state": "Done"}, "not a room state: 'Done'"),
        ({"rank": "d", "room": 1, "state": 4}, "'state' is 4"),
        ({"rank": "d", "room": True, "state": "Success"}, "'room' is True"),
        ({"room": 1, "state": "Success"}, "'rank' is None"),
        ({"rank": "d", "room": 1, "state": "Success", "bytes": {"kv": -1}}, "must map kinds to byte counts"),
        ({"rank": "d", "room": 1, "state": "Success", "phases_s": {"x": "soon"}}, "phases_s must map phases"),
        ({"rank": "d", "room": 1, "state": "Success", "decode_ranks_ready": "d"}, "list of rank ids"),
        ({"rank": "d", "room": 1, "state": "Success", "sources_quiet": "yes"}, "'sources_quiet' is 'yes'"),
    ],
)
def test_an_answer_that_is_no_room_view_names_its_field(doc: Any, says: str) -> None:
    with pytest.raises(ValueError) as err:
        RoomView.parse(doc)
    assert says in str(err.value)


def test_the_memory_answer_reads_back_as_written() -> None:
    layout = PoolLayout.from_geometry(parse_spec(TCP_RAW).model, 1, kv_pages=16, state_slots=2, aux_slots=4)
    answer = MemoryAnswer("decode-0-tp0", layout, 7, ("cpu",))
    assert MemoryAnswer.parse(answer.to_json()) == answer
    assert answer.to_json()["memory"] == answer.memory_json()  # what /v1/info shows per rank
    with pytest.raises(ValueError, match="devices must be a list"):
        MemoryAnswer.parse({"rank": "d", "memory": {"layout": layout.to_dict(), "buffers": 1, "devices": "cpu"}})


def test_the_agent_info_reads_back_as_written_and_names_a_rank_it_does_not_serve() -> None:
    layout = PoolLayout.from_geometry(parse_spec(TCP_RAW).model, 1, kv_pages=16, state_slots=2, aux_slots=4)
    pools = {k: PoolInfo(4096 * i, 1 << 20, "cpu", f"/dev/shm/pool-{k}") for i, k in enumerate(("kv", "state", "aux"))}
    memory = MemoryAnswer("decode-0-tp0", layout, 7, ("cpu",), board=True)
    info = AgentInfo(
        "ns",
        "pd",
        "uid-1",
        "pd-decode-0",
        "tcp",
        "mooncake",
        {
            "decode-0-tp0": RankInfo("decode", "127.0.0.1:1234", "mooncake", layout, pools, memory),
            "decode-0-tp1": RankInfo("decode", "127.0.0.1:1235", "mooncake", layout, pools),
        },
    )
    doc = info.to_json()
    assert doc["cluster"] == {"namespace": "ns", "name": "pd", "uid": "uid-1"}
    assert doc["ranks"]["decode-0-tp0"]["kv"]["handle"] == "/dev/shm/pool-kv"  # the wire as engines read it
    assert doc["ranks"]["decode-0-tp0"]["engine_memory"] == memory.memory_json()
    assert AgentInfo.parse(doc) == info
    assert info.rank("decode-0-tp1").engine_memory is None
    with pytest.raises(
        RuntimeError, match=r"does not serve rank decode-0-tp2 \(it serves \['decode-0-tp0', 'decode-0-tp1'\]\); set X"
    ):
        info.rank("decode-0-tp2", "set X")
    bad = {**doc, "ranks": {"decode-0-tp0": {**doc["ranks"]["decode-0-tp0"], "kv": {"size": "big"}}}}
    with pytest.raises(ValueError, match="rank decode-0-tp0 kv pool: 'addr' is None"):
        AgentInfo.parse(bad)


@pytest.mark.parametrize(
    "answer",
    [
        RoomInfoTaken(early=True),
        RoomInfoTaken(early=False),
        SourceAnswer(RoomState.SUCCESS),
        SourceAnswer(RoomState.FAILED, "deadline passed"),
        SourceAnswer(RoomState.TRANSFERRING, watching=3),
        CancelAnswer(fenced=True),
        CancelAnswer(fenced=False, state=RoomState.FAILED),
    ],
    ids=repr,
)
def test_a_peer_answer_reads_back_as_written(answer: RoomInfoTaken | SourceAnswer | CancelAnswer) -> None:
    assert type(answer).parse(answer.to_json()) == answer


@pytest.mark.parametrize(
    ("kind", "doc", "says"),
    [
        (RoomInfoTaken, {"accepted": "maybe"}, "not 'early' or 'room'"),
        (SourceAnswer, {"state": "Gone"}, "not a room state"),
        (SourceAnswer, {"state": "Success", "watching": "2"}, "'watching' a count"),
        (CancelAnswer, {}, "'fenced' is None"),
        (CancelAnswer, {"fenced": True, "state": "Over"}, "not a room state"),
    ],
)
def test_a_peer_answer_that_is_not_one_names_its_field(kind: Any, doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as err:
        kind.parse(doc)
    assert says in str(err.value)
