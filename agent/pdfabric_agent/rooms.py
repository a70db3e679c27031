"""Request state and the checks every API body passes before it may change anything."""

from __future__ import annotations

import array
import asyncio
import base64
import enum
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.metrics import Refusal


class RoomState(enum.IntEnum):
    """SGLang's KVPoll values, so a serving engine can use them unchanged."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def title(self) -> str:
        return {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}[self.value]

    @property
    def finished(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)


class ApiError(Exception):
    """A refused request: HTTP status, refusal reason (metric label) and a message for humans."""

    def __init__(self, status: int, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def malformed(message: str) -> ApiError:
    return ApiError(400, Refusal.MALFORMED, message)


def out_of_range(message: str) -> ApiError:
    return ApiError(400, Refusal.OUT_OF_RANGE, message)


def field_int(body: Mapping[str, Any], name: str, *, minimum: int = 0, optional: bool = False) -> int | None:
    if name not in body or body[name] is None:
        if optional:
            return None
        raise malformed(f"field {name!r} is required")
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(f"field {name!r} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise out_of_range(f"field {name!r} must be at least {minimum}, got {value}")
    return value


def field_str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise malformed(f"field {name!r} must be a non-empty string")
    return value


PACKED_INDICES = "int32le"  # {"int32le": base64 of little-endian int32}: a compact list of indices


def pack_indices(values: Sequence[int]) -> dict[str, str]:
    """The compact form of an index list (a room of thousands of pages: no JSON number per page)."""
    a = array.array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return {PACKED_INDICES: base64.b64encode(a.tobytes()).decode()}


def _unpack_indices(name: str, value: Mapping[str, Any]) -> list[int]:
    raw = value.get(PACKED_INDICES)
    if set(value) != {PACKED_INDICES} or not isinstance(raw, str):
        raise malformed(f"field {name!r} must be a list of integers or {{{PACKED_INDICES!r}: base64}}")
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError:
        raise malformed(f"field {name!r}: {PACKED_INDICES} is not base64") from None
    if len(data) % 4:
        raise malformed(f"field {name!r}: {PACKED_INDICES} holds {len(data)} bytes, not a whole number of int32")
    a = array.array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def field_indices(body: Mapping[str, Any], name: str, limit: int, *, what: str, unique: bool) -> list[int]:
    value = body.get(name, [])
    if isinstance(value, Mapping):
        value = _unpack_indices(name, value)  # ints by construction
    # `type(v) is int` refuses bools too; min/max run in C: a room of thousands of pages is checked
    # in tens of microseconds on the send path.
    elif not isinstance(value, list) or not all(type(v) is int for v in value):
        raise malformed(f"field {name!r} must be a list of integers")
    if value and (min(value) < 0 or max(value) >= limit):
        bad = [v for v in value if not 0 <= v < limit]
        raise out_of_range(f"{name}: {what} {bad[:5]} outside 0..{limit - 1}")
    if unique and len(set(value)) != len(value):
        raise malformed(f"{name}: {what} repeat; every destination must be written once")
    return value


def check_index(value: int | None, limit: int, *, name: str) -> None:
    if value is not None and not 0 <= value < limit:
        raise out_of_range(f"{name} {value} outside 0..{limit - 1}")


@dataclass
class Target:
    """One decode rank a prefill room sends to."""

    decode_rank: str
    decode_tp: int
    agent: str
    dst: dict[str, Any] | None = None  # the decode side's room info, once it arrived
    done: bool = False


@dataclass(kw_only=True)
class Room:
    """What a prefill and a decode room share: identity, deadline, state and the bytes moved."""

    rank: str
    room: int
    submitted: float
    deadline: float  # bootstrap deadline, then the transfer deadline
    state: RoomState = RoomState.BOOTSTRAPPING
    reason: str = ""
    finished_at: float = 0.0
    moved: dict[str, int] = field(default_factory=lambda: {"kv": 0, "state": 0, "aux": 0})
    finished_event: asyncio.Event = field(default_factory=asyncio.Event)  # for long polls
    marks: dict[str, float] = field(default_factory=dict)  # phase -> clock, for the latency breakdown

    def view(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "room": self.room,
            "state": self.state.title,
            "code": int(self.state),
            "reason": self.reason,
            "bytes": dict(self.moved),
            # The agent's monotonic clock (node-wide): phases of rooms on one node line up.
            "submitted_at": round(self.submitted, 6),
            "phases_s": {k: round(v - self.submitted, 6) for k, v in self.marks.items()},
        }


@dataclass(kw_only=True)
class PrefillRoom(Room):
    src_pages: list[int]
    src_state: list[int]
    src_aux: int | None
    targets: dict[str, Target]
    skipped_state: int = 0

    def view(self) -> dict[str, Any]:
        return {**super().view(), "state_bytes_skipped": self.skipped_state}


@dataclass(kw_only=True)
class DecodeRoom(Room):
    dst_pages: list[int]
    dst_state: list[int]
    dst_aux: int | None
    expected: dict[str, str]  # prefill rank id -> agent name
    arrived: set[str] = field(default_factory=set)
    senders: dict[str, dict[str, int]] = field(default_factory=dict)

    def view(self) -> dict[str, Any]:
        return {**super().view(), "senders": {k: dict(v) for k, v in sorted(self.senders.items())}}
