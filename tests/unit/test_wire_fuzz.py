"""Property tests of the wire messages (issue 10, items 5-6): whatever JSON shape a client or a peer
sends, ``parse`` answers a message or an ``ApiError`` (4xx), never another exception; caps hold
before the work (packed lists by their length before decoding, long lists before min/max)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Bases
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol import fields
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.fields import MAX_INDICES, check_indices, field_index_list, pack_indices
from pdfabric_agent.protocol.peer_wire import DoneReport, LaunchNotice, RoomCancel, RoomInfo
from pdfabric_agent.protocol.wire import ReceiveRequest, SendRequest

LAYOUT = PoolLayout(2, 2, 64, 64, 1, 64, 8, (8, 8), 8)
VALID: dict[type[Any], dict[str, Any]] = {
    SendRequest: SendRequest("prefill-0-tp0-cp0", 7, list(range(70)), [0], 1, 0).to_json(),
    ReceiveRequest: ReceiveRequest("decode-0-tp0", 7, [3, 4, 5], [1], 2, 0).to_json(),
    RoomInfo: RoomInfo(
        7, "decode-0-tp0", "prefill-0-tp0-cp0", "127.0.0.1:1", LAYOUT, Bases(4096, 8192, 12288), [1, 2], [0], 1
    ).to_json(),
    DoneReport: DoneReport(
        7,
        "decode-0-tp0",
        "prefill-0-tp0-cp0",
        {"mooncake": {"kv": 10, "state": 0, "aux": 0}},
        ok=True,
        aux_rows=((0, b"12345678"),),
    ).to_json(),
    LaunchNotice: LaunchNotice(
        7,
        "decode-0-tp0",
        "prefill-0-tp0-cp0",
        {"nvlink": {"kv": 1, "state": 0, "aux": 0}},
        (CompletionMark("pdfabric-board-0123456789ab", 3, 1),),
    ).to_json(),
    RoomCancel: RoomCancel(7, "decode-0-tp0", "prefill-0-tp0-cp0", "aborted by SGLang").to_json(),
}
MESSAGES = list(VALID)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63, max_value=2**200)
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["", "\x00", "\udcff", "é", "x" * 300, "false", "0"])
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=40,
)


def parse_or_refuse(cls: type[Any], body: Any) -> None:
    try:
        cls.parse(body)
    except ApiError as exc:
        assert 400 <= exc.status < 500
        assert exc.message


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_the_valid_examples_parse(cls: type[Any]) -> None:
    msg = cls.parse(json.loads(json.dumps(VALID[cls])))
    assert msg.to_json() == VALID[cls]


@settings(max_examples=150, deadline=1000)
@given(cls=st.sampled_from(MESSAGES), data=st.data())
def test_one_field_replaced_by_any_json_is_parsed_or_refused(cls: type[Any], data: st.DataObject) -> None:
    body = dict(VALID[cls])
    name = data.draw(st.sampled_from(sorted(body)))
    body[name] = data.draw(JSON)
    parse_or_refuse(cls, body)


@settings(max_examples=150, deadline=1000)
@given(cls=st.sampled_from(MESSAGES), body=st.dictionaries(st.text(max_size=15), JSON, max_size=10))
def test_any_json_object_is_parsed_or_refused(cls: type[Any], body: dict[str, Any]) -> None:
    parse_or_refuse(cls, body)


@settings(max_examples=100, deadline=1000)
@given(cls=st.sampled_from(MESSAGES), data=st.data())
def test_nested_fields_with_wrong_types_are_refused(cls: type[Any], data: st.DataObject) -> None:
    """Inside the objects: a layout, bases, aux rows, bytes_by_path, marks, a packed list."""
    body = json.loads(json.dumps(VALID[cls]))
    for name, value in body.items():
        if isinstance(value, dict) and value:
            key = data.draw(st.sampled_from(sorted(value)))
            value[key] = data.draw(JSON)
        elif isinstance(value, list) and value:
            i = data.draw(st.integers(0, len(value) - 1))
            value[i] = data.draw(JSON)
        body[name] = value
    parse_or_refuse(cls, body)


@settings(max_examples=60, deadline=1000)
@given(raw=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode() + "="))
def test_packed_lists_of_any_text_are_parsed_or_refused(raw: str) -> None:
    for cls in (SendRequest, RoomInfo):
        body = dict(VALID[cls])
        body["kv_pages"] = {"int32le": raw}
        parse_or_refuse(cls, body)


def test_a_packed_list_is_refused_by_its_length_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    huge = "A" * (16 << 20)
    decoded: list[int] = []
    real = fields.base64.b64decode

    def counting(data: Any, *args: Any, **kw: Any) -> bytes:
        decoded.append(len(data))
        return real(data, *args, **kw)

    monkeypatch.setattr(fields.base64, "b64decode", counting)
    with pytest.raises(ApiError) as info:
        field_index_list({"kv_pages": {"int32le": huge}}, "kv_pages", 1024)
    assert info.value.status == 413
    assert decoded == []  # no 16 MB base64 decode: refused by the text's length
    field_index_list({"kv_pages": {"int32le": base64.b64encode(b"\0" * 8).decode()}}, "kv_pages", 1024)
    assert decoded == [12]  # (a list within the limit is decoded, through the same function)
    with pytest.raises(ApiError) as info:  # the absolute cap, whatever the caller's limit
        field_index_list({"kv_pages": {"int32le": "A" * (4 * -(-4 * MAX_INDICES // 3) + 4)}}, "kv_pages", 2**40)
    assert info.value.status == 413
    body = dict(VALID[RoomInfo])
    body["kv_pages"] = pack_indices(list(range(65)))  # one more than the peer's layout has pages
    with pytest.raises(ApiError) as info:
        RoomInfo.parse(body)
    assert info.value.status == 413


def test_a_list_longer_than_the_pool_is_refused_before_its_values() -> None:
    with pytest.raises(ApiError) as info:
        check_indices([0] * 65, 64, name="kv_pages", what="KV pages", unique=False)
    assert (info.value.status, info.value.reason.value) == (413, "too_large")
    with pytest.raises(ApiError):
        SendRequest.parse({**VALID[SendRequest], "kv_pages": [0] * (MAX_INDICES + 1)})


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (DoneReport, "aux_rows", [[0, "AAAA"]] * 65),
        (DoneReport, "aux_rows", [["0", "AAAA"]]),
        (DoneReport, "aux_rows", ["ab"]),
        (DoneReport, "aux_rows", [[0, "AAAA", 1]]),
        (DoneReport, "aux_rows", [[0, "é"]]),
        (DoneReport, "aux_rows", [[-1, "AAAA"]]),
        (DoneReport, "reason", "x" * 5000),
        (DoneReport, "bytes_by_path", {f"p{i}": {"kv": 1} for i in range(17)}),
        (DoneReport, "bytes_by_path", {"p": {"kv": 2**70}}),
        (RoomInfo, "layout", {**LAYOUT.to_dict(), "aux_items": list(range(100))}),
        (RoomInfo, "layout", {**LAYOUT.to_dict(), "aux_items": "ab"}),
        (RoomInfo, "layout", {**LAYOUT.to_dict(), "kv_pages": "64"}),
        (RoomInfo, "layout", {**LAYOUT.to_dict(), "kv_pages": 2**70}),
        (RoomInfo, "bases", {"kv": [1] * 4, "state": [1], "aux": [1, 2**70]}),
        (RoomInfo, "bases", {"kv": [1] * 3, "state": [1], "aux": [1, 1]}),  # one K/V buffer short
        (RoomInfo, "bases", {"kv": 1, "state": 1, "aux": 1}),
        (RoomInfo, "endpoint", "host\n:1"),
        (LaunchNotice, "marks", [{"board": "pdfabric-board-0123456789ab", "slot": 1, "seq": 2**70}]),
        (LaunchNotice, "marks", [{"board": "pdfabric-board-0123456789ab", "slot": 1, "seq": 1}] * 1025),
        (SendRequest, "room", 2**64),
        (SendRequest, "rank", "r" * 257),
    ],
)
def test_examples_of_the_issue_are_4xx(cls: type[Any], field: str, value: Any) -> None:
    with pytest.raises(ApiError) as info:
        cls.parse({**VALID[cls], field: value})
    assert 400 <= info.value.status < 500
