"""What an agent answers a peer agent on the peer door, one type per message of ``peer_wire``:
``RoomInfoTaken`` (room info, kept for a later send or given to the room), ``SourceAnswer`` (a done
report or a launch notice: the decode room's state then) and ``CancelAnswer`` (whether the source's
writes into the cancelled room are over). ``to_json`` is what the answering agent writes, ``parse``
what the asking agent reads; ``parse`` raises ``ValueError`` naming the field. ``TransferMetadata``
answers the peer door's GET of a rank's transfer metadata (``peer_wire.METADATA_PATH``)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.protocol.views import RoomState, answer_object, answer_state


@dataclass(frozen=True)
class RoomInfoTaken:
    """/v1/peer/dst's answer: ``early`` when the prefill room was not sent yet (the info waits for
    its send), else the room took it as one of its targets."""

    early: bool

    def to_json(self) -> dict[str, Any]:
        return {"accepted": "early" if self.early else "room"}

    @classmethod
    def parse(cls, doc: Any) -> Self:
        accepted = answer_object(doc, "a room info answer").get("accepted")
        if accepted not in ("early", "room"):
            raise ValueError(f"a room info answer: 'accepted' is {accepted!r}, not 'early' or 'room'")
        return cls(early=accepted == "early")


@dataclass(frozen=True)
class SourceAnswer:
    """/v1/peer/done's and /v1/peer/launched's answer: the decode room's state once the report was
    taken, why it failed if it did, and for a launch notice the completion marks now watched."""

    state: RoomState
    reason: str = ""
    watching: int | None = None

    @property
    def room_failed(self) -> bool:
        return self.state is RoomState.FAILED

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state.title}
        if self.reason:
            body["reason"] = self.reason
        if self.watching is not None:
            body["watching"] = self.watching
        return body

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "a source report's answer"
        d = answer_object(doc, what)
        reason, watching = d.get("reason", ""), d.get("watching")
        if not isinstance(reason, str) or not (watching is None or type(watching) is int):
            raise ValueError(f"{what}: 'reason' must be a string and 'watching' a count")
        return cls(answer_state(d.get("state"), what), reason, watching)


@dataclass(frozen=True)
class CancelAnswer:
    """/v1/peer/cancel's answer: ``fenced`` when no write of the source into that decode room is in
    flight any more; ``state`` is the source's own room's, when it has one."""

    fenced: bool
    state: RoomState | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"fenced": self.fenced}
        if self.state is not None:
            body["state"] = self.state.title
        return body

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "a cancel answer"
        d = answer_object(doc, what)
        fenced = d.get("fenced")
        if not isinstance(fenced, bool):
            raise ValueError(f"{what}: 'fenced' is {fenced!r}")
        return cls(fenced, None if d.get("state") is None else answer_state(d["state"], what))


MAX_METADATA_BYTES = 1 << 20  # NIXL's agent metadata is about 300 bytes plus 40 per registered region


@dataclass(frozen=True)
class TransferMetadata:
    """GET /v1/peer/metadata's answer: what a writer's backend loads before its first write to a
    rank's endpoint (NIXL's agent metadata and regions), opaque to all but the backends; the
    endpoint it belongs to, so that a writer holding an older endpoint sees that it changed."""

    rank: str
    endpoint: str
    metadata: bytes

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "endpoint": self.endpoint, "metadata": base64.b64encode(self.metadata).decode()}

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "a transfer metadata answer"
        d = answer_object(doc, what)
        rank, endpoint, encoded = d.get("rank"), d.get("endpoint"), d.get("metadata")
        if not isinstance(rank, str) or not isinstance(endpoint, str) or not isinstance(encoded, str):
            raise ValueError(f"{what}: 'rank', 'endpoint' and 'metadata' must be strings")
        if len(encoded) > MAX_METADATA_BYTES * 4 // 3 + 4:
            raise ValueError(f"{what}: 'metadata' is over {MAX_METADATA_BYTES} bytes")
        try:
            metadata = base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"{what}: 'metadata' is not base64 ({exc})") from None
        return cls(rank, endpoint, metadata)
