"""What the agent answers an engine, typed for every caller (the agent, its client, the SGLang
plugin, the reference engine): a room's state as SGLang's ``KVPoll`` numbers it, the room view
(``RoomView``: poll, send, receive and abort all answer one) and the memory answer
(``MemoryAnswer``: POST /v1/memory). ``to_json`` is what the agent writes; ``parse`` is what a
caller reads, and raises ``ValueError`` naming the field when the answer is not one."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import ApiError
from pdfabric_agent.protocol.fields import aux_rows_json, parse_aux_rows
from pdfabric_agent.protocol.wire import KindBytes, zero_bytes


class RoomState(enum.IntEnum):
    """SGLang's KVPoll values, so a serving engine can use them unchanged."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def title(self) -> str:
        return _TITLES[self]

    @property
    def finished(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)

    @classmethod
    def of_title(cls, title: str) -> RoomState:
        """The state a room view's ``state`` names; ValueError for another word."""
        for state, name in _TITLES.items():
            if name == title:
                return state
        raise ValueError(f"not a room state: {title!r}")


_TITLES = {
    RoomState.FAILED: "Failed",
    RoomState.BOOTSTRAPPING: "Bootstrapping",
    RoomState.WAITING_FOR_INPUT: "WaitingForInput",
    RoomState.TRANSFERRING: "Transferring",
    RoomState.SUCCESS: "Success",
}


def answer_object(doc: Any, what: str) -> Mapping[str, Any]:
    """An answer's JSON object, or ValueError naming what it should have been."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{what} is not a JSON object")
    return doc


def typed_field(doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Field ``name`` of an answer, of type ``kind``, or ValueError naming it and ``what`` it is of."""
    value = doc.get(name)
    # bool is an int in Python, never on this wire
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{what}: {name!r} is {value!r}")
    return value


def _optional(doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    return None if doc.get(name) is None else typed_field(doc, name, kind, what)


def _kind_bytes(value: Any, what: str) -> KindBytes:
    counts = answer_object(value, what)
    if not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items()):
        raise ValueError(f"{what} must map kinds to byte counts: {dict(counts)!r}")
    return dict(counts)


def answer_state(value: Any, what: str) -> RoomState:
    """The room state an answer's ``state`` names, or ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{what}: 'state' is {value!r}")
    try:
        return RoomState.of_title(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class RoomView:
    """One room on one local rank, as the agent sees it now. The sections after ``phases_s`` are
    present where they apply (None elsewhere): a prefill room not sent yet (``decode_ranks_ready``,
    ``decode_prefix_tokens``, ``sends``), a prefill room (``state_bytes_skipped``), a decode room
    (``senders``, ``sources_quiet``, and once Success the aux row of an engine whose aux buffers are
    private: ``aux_rows``), an abort of a decode room not submitted yet (``told``)."""

    rank: str
    room: int
    state: RoomState
    reason: str = ""
    moved: KindBytes = field(default_factory=zero_bytes)  # "bytes" on the wire: bytes per kind this rank moved
    submitted_at: float | None = None  # the agent's monotonic clock (node-wide)
    phases_s: Mapping[str, float] = field(default_factory=dict)  # phase -> seconds since submitted
    decode_ranks_ready: tuple[str, ...] | None = None
    decode_prefix_tokens: int | None = None  # what decode holds already (its radix prefix)
    sends: bool | None = None  # False: this prefill rank sends nothing for this spec
    state_bytes_skipped: int | None = None
    senders: Mapping[str, KindBytes] | None = None  # prefill rank -> bytes it delivered
    sources_quiet: bool | None = None  # every source's writes are over: a failed room's pages may be reused
    told: int | None = None  # prefill ranks told of an abort before the room was submitted
    aux_rows: tuple[bytes, ...] | None = None  # the room's aux row per item, for the engine to write

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def succeeded(self) -> bool:
        return self.state is RoomState.SUCCESS

    @property
    def first_byte_at(self) -> float | None:
        """When the agent began moving a prefill room's bytes (its first write, ``first-byte``; else
        its ``transferring`` phase) on the node's monotonic clock, which the node's engines share;
        None for a room without it. Not the first chunk handed over: a chunk that waits for decode's
        destinations, or for the forward that writes it, has moved nothing yet."""
        began = self.phases_s.get("first-byte", self.phases_s.get("transferring"))
        return None if began is None or self.submitted_at is None else self.submitted_at + began

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rank": self.rank,
            "room": self.room,
            "state": self.state.title,
            "code": int(self.state),
            "reason": self.reason,
            "bytes": dict(self.moved),
        }
        if self.submitted_at is not None:
            body["submitted_at"] = self.submitted_at
            body["phases_s"] = dict(self.phases_s)
        for name in ("decode_prefix_tokens", "sends", "state_bytes_skipped", "sources_quiet", "told"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.decode_ranks_ready is not None:
            body["decode_ranks_ready"] = list(self.decode_ranks_ready)
        if self.senders is not None:
            body["senders"] = {k: dict(v) for k, v in sorted(self.senders.items())}
        if self.aux_rows is not None:
            body["aux_rows"] = aux_rows_json(self.aux_rows)
        return body

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "the agent's room view"
        d = answer_object(doc, what)
        phases = answer_object(d.get("phases_s", {}), f"{what}'s phases_s")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in phases.values()):
            raise ValueError(f"{what}: phases_s must map phases to seconds")
        ready = d.get("decode_ranks_ready")
        if ready is not None and not (isinstance(ready, list) and all(isinstance(r, str) for r in ready)):
            raise ValueError(f"{what}: decode_ranks_ready must be a list of rank ids")
        senders = d.get("senders")
        try:
            aux_rows = None if d.get("aux_rows") is None else parse_aux_rows(d["aux_rows"], "aux_rows")
        except ApiError as exc:
            raise ValueError(f"{what}: {exc.message}") from None
        submitted = _optional(d, "submitted_at", (int, float), what)
        return cls(
            rank=typed_field(d, "rank", str, what),
            room=typed_field(d, "room", int, what),
            state=answer_state(d.get("state"), what),
            reason=typed_field(d, "reason", str, what) if "reason" in d else "",
            moved=_kind_bytes(d["bytes"], f"{what}'s bytes") if "bytes" in d else zero_bytes(),
            submitted_at=None if submitted is None else float(submitted),
            phases_s={str(k): float(v) for k, v in phases.items()},
            decode_ranks_ready=None if ready is None else tuple(ready),
            decode_prefix_tokens=_optional(d, "decode_prefix_tokens", int, what),
            sends=_optional(d, "sends", bool, what),
            state_bytes_skipped=_optional(d, "state_bytes_skipped", int, what),
            senders=None
            if senders is None
            else {str(k): _kind_bytes(v, f"{what}'s senders") for k, v in answer_object(senders, what).items()},
            sources_quiet=_optional(d, "sources_quiet", bool, what),
            told=_optional(d, "told", int, what),
            aux_rows=aux_rows,
        )


@dataclass(frozen=True)
class FeedHello:
    """The first line of a rank's room feed (GET /v1/events/{rank}): what holds for every room of
    the rank. ``sends`` false: this prefill rank moves nothing for the spec (replicated KV heads,
    a CP rank that does not send), so each of its rooms is WaitingForInput at once, for ``reason``."""

    rank: str
    sends: bool = True
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"hello": self.rank, "sends": self.sends, "reason": self.reason}

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "the room feed's first line"
        d = answer_object(doc, what)
        return cls(
            typed_field(d, "hello", str, what), typed_field(d, "sends", bool, what), typed_field(d, "reason", str, what)
        )

    def view_of(self, room: int) -> RoomView | None:
        """The view every room of a rank that sends nothing has (the agent's early view)."""
        if self.sends:
            return None
        state = RoomState.WAITING_FOR_INPUT
        return RoomView(rank=self.rank, room=room, state=state, reason=self.reason, decode_ranks_ready=(), sends=False)


@dataclass(frozen=True)
class MemoryAnswer:
    """POST /v1/memory's answer: the rank whose engine buffers the agent now moves rooms in, the
    layout they give it, how many buffers were mapped and on which devices."""

    rank: str
    layout: PoolLayout
    buffers: int
    devices: tuple[str, ...]
    board: bool = False  # the engine's room board is mapped: successful ends are written there
    board_refused: str = ""  # why a board the engine offered is not (its reads fall back to the feed)

    def memory_json(self) -> dict[str, Any]:
        """The memory part alone (/v1/info shows it per rank as ``engine_memory``)."""
        doc: dict[str, Any] = {"layout": self.layout.to_dict(), "buffers": self.buffers, "devices": list(self.devices)}
        if self.board or self.board_refused:
            doc["board"] = self.board
            doc["board_refused"] = self.board_refused
        return doc

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "memory": self.memory_json()}

    @classmethod
    def parse(cls, doc: Any) -> Self:
        what = "the agent's memory answer"
        d = answer_object(doc, what)
        memory = answer_object(d.get("memory"), f"{what}'s memory")
        devices = memory.get("devices")
        if not (isinstance(devices, list) and all(isinstance(x, str) for x in devices)):
            raise ValueError(f"{what}: devices must be a list of device names")
        try:
            layout = PoolLayout.from_dict(dict(answer_object(memory.get("layout"), f"{what}'s layout")))
        except (TypeError, KeyError) as exc:
            raise ValueError(f"{what}: bad layout ({exc})") from None
        board, refused = memory.get("board", False), memory.get("board_refused", "")
        if not isinstance(board, bool) or not isinstance(refused, str):
            raise ValueError(f"{what}: board must be true or false and board_refused a string")
        buffers = typed_field(memory, "buffers", int, what)
        return cls(typed_field(d, "rank", str, what), layout, buffers, tuple(devices), board, refused)
