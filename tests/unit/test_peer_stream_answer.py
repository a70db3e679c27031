"""A peer-stream frame's answer (http/peer_stream.py ``_answer``) is what the POST would answer:
its body, a refusal's status and reason, and for an error no check anticipated the POST's 500,
counted as an ``internal`` refusal like the POST's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pdfabric_agent.http.peer_stream import _answer
from pdfabric_agent.protocol.errors import ApiError, internal_error, unknown_room
from pdfabric_agent.protocol.labels import Refusal


class Socket:
    """What ``_answer`` writes to: the frames it sent."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_str(self, data: str) -> None:
        self.sent.append(json.loads(data))


def answer(call: Any, frame: Any) -> tuple[list[dict[str, Any]], list[ApiError]]:
    ws, refusals = Socket(), []
    asyncio.run(_answer(ws, frame, "agent-b", call, refusals.append))  # type: ignore[arg-type]
    return ws.sent, refusals


def test_a_frame_is_answered_as_its_post() -> None:
    async def ok(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        return {"path": path, "caller": caller, **body}

    sent, refusals = answer(ok, {"id": 7, "path": "/v1/peer/done", "body": {"room": 3}})
    assert sent == [{"id": 7, "status": 200, "body": {"path": "/v1/peer/done", "caller": "agent-b", "room": 3}}]
    assert refusals == []


def test_refusals_and_unexpected_errors_carry_the_posts_status_and_reason() -> None:
    async def refuse(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        raise unknown_room(3, "decode-0-tp0")

    sent, refusals = answer(refuse, {"id": 1, "path": "/v1/peer/done", "body": {}})
    assert sent == [
        {"id": 1, "status": 404, "body": {"error": "room 3 is unknown on decode-0-tp0", "reason": "unknown_room"}}
    ]
    assert [r.reason for r in refusals] == [Refusal.UNKNOWN_ROOM]

    async def broken(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        raise KeyError("x")

    sent, refusals = answer(broken, {"id": 2, "path": "/v1/peer/done", "body": {}})
    assert sent == [{"id": 2, "status": 500, "body": internal_error(KeyError("x")).body()}]
    assert sent[0]["body"]["reason"] == Refusal.INTERNAL.value and "KeyError" in sent[0]["body"]["error"]
    assert [r.reason for r in refusals] == [Refusal.INTERNAL]  # counted like the POST's 500


def test_a_frame_without_path_or_body_is_malformed_and_one_without_id_is_not_answered() -> None:
    async def never(path: str, body: dict[str, Any], caller: str) -> dict[str, Any]:
        raise AssertionError("not called")

    sent, _ = answer(never, {"id": 4, "path": 5, "body": {}})
    assert sent[0]["status"] == 400 and sent[0]["body"]["reason"] == Refusal.MALFORMED.value
    assert answer(never, {"path": "/v1/peer/done", "body": {}}) == ([], [])
