"""The wire format: one typed message per request the agent takes, parsed and checked here.

Client messages (the serving engine -> its node's agent): ``SendRequest``, ``ReceiveRequest``.
Peer messages (agent -> agent): ``RoomInfo`` (/v1/peer/dst: where a decode room's data lands),
``DoneReport`` (/v1/peer/done: a source's data landed, or failed), ``LaunchNotice``
(/v1/peer/launched: a source's kernels run; watch their completion marks).

``parse`` checks what the message alone can say (types, closed sets, self-consistent bounds) and
raises ``ApiError`` (400) with the field to fix; what needs the agent's state (the rank's layout,
the rank map, the room) is checked by the handler right after. ``to_json`` is the inverse, used by
the client and by peers, so both sides of a message are written in one place.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pdfabric_agent.completion import CompletionMark
from pdfabric_agent.errors import malformed, out_of_range
from pdfabric_agent.labels import Kind
from pdfabric_agent.plan import Bases
from pdfabric_agent.pools import PoolLayout

PACKED_INDICES = "int32le"  # {"int32le": base64 of little-endian int32}: a compact list of indices
PACK_ABOVE = 64  # index lists longer than this are sent packed

# Bytes per kind ("kv", "state", "aux") and, per `path` label, the bytes that path moved.
KindBytes = dict[str, int]
BytesByPath = dict[str, KindBytes]


def zero_bytes() -> KindBytes:
    return {kind.value: 0 for kind in Kind}


# ---------------------------------------------------------------- fields
def field_int(body: Mapping[str, Any], name: str, *, minimum: int = 0) -> int:
    if name not in body or body[name] is None:
        raise malformed(f"field {name!r} is required")
    return _int(body[name], name, minimum)


def field_opt_int(body: Mapping[str, Any], name: str, *, minimum: int = 0) -> int | None:
    value = body.get(name)
    return None if value is None else _int(value, name, minimum)


def _int(value: Any, name: str, minimum: int) -> int:
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


def pack_indices(values: Sequence[int]) -> dict[str, str]:
    """The compact form of an index list (a room of thousands of pages: no JSON number per page)."""
    a = array.array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return {PACKED_INDICES: base64.b64encode(a.tobytes()).decode()}


def indices_json(values: Sequence[int]) -> list[int] | dict[str, str]:
    return pack_indices(values) if len(values) > PACK_ABOVE else list(values)


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


def field_index_list(body: Mapping[str, Any], name: str) -> list[int]:
    """A list of integers, plain or packed (its bounds are the caller's: ``check_indices``)."""
    value = body.get(name, [])
    if isinstance(value, Mapping):
        return _unpack_indices(name, value)  # ints by construction
    # `type(v) is int` refuses bools too; it runs at C speed for a room of thousands of pages.
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise malformed(f"field {name!r} must be a list of integers")
    return value


def check_indices(values: list[int], limit: int, *, name: str, what: str, unique: bool) -> None:
    # min/max run in C: a room of thousands of pages is checked in tens of microseconds.
    if values and (min(values) < 0 or max(values) >= limit):
        bad = [v for v in values if not 0 <= v < limit]
        raise out_of_range(f"{name}: {what} {bad[:5]} outside 0..{limit - 1}")
    if unique and len(set(values)) != len(values):
        raise malformed(f"{name}: {what} repeat; every destination must be written once")


def field_indices(body: Mapping[str, Any], name: str, limit: int, *, what: str, unique: bool) -> list[int]:
    values = field_index_list(body, name)
    check_indices(values, limit, name=name, what=what, unique=unique)
    return values


def check_index(value: int | None, limit: int, *, name: str) -> None:
    if value is not None and not 0 <= value < limit:
        raise out_of_range(f"{name} {value} outside 0..{limit - 1}")


def _body_dict(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(f"{name} must be an object")
    return value


# ---------------------------------------------------------------- client messages
@dataclass(frozen=True)
class RoomSubmit:
    """What `send` and `receive` share: a room on one local rank, its pages, state slots and aux row,
    and the replica of the other role it pairs with."""

    PATH: ClassVar[str]
    PEER_ROLE: ClassVar[str]  # the role of `peer_replica`
    UNIQUE: ClassVar[bool]  # destinations must be distinct (two sources writing one page corrupt it)

    rank: str
    room: int
    kv_pages: list[int]
    state_indices: list[int]
    aux_index: int | None
    peer_replica: int

    @classmethod
    def peer_field(cls) -> str:
        return f"{cls.PEER_ROLE}_replica"

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        return cls(
            rank=field_str(body, "rank"),
            room=field_int(body, "room"),
            kv_pages=field_index_list(body, "kv_pages"),
            state_indices=field_index_list(body, "state_indices"),
            aux_index=field_opt_int(body, "aux_index"),
            peer_replica=field_int(body, cls.peer_field()),
        )

    def check_bounds(self, layout: PoolLayout, peer_replicas: int) -> None:
        """Against the local rank's pools and the spec's replica count."""
        check_indices(self.kv_pages, layout.kv_pages, name="kv_pages", what="KV pages", unique=self.UNIQUE)
        check_indices(
            self.state_indices, layout.state_slots, name="state_indices", what="state slots", unique=self.UNIQUE
        )
        check_index(self.aux_index, layout.aux_slots, name="aux_index")
        if self.peer_replica >= peer_replicas:
            raise out_of_range(f"{self.peer_field()} {self.peer_replica} outside 0..{peer_replicas - 1}")

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rank": self.rank,
            "room": self.room,
            "kv_pages": indices_json(self.kv_pages),
            "state_indices": list(self.state_indices),
            self.peer_field(): self.peer_replica,
        }
        if self.aux_index is not None:
            body["aux_index"] = self.aux_index
        return body


@dataclass(frozen=True)
class SendRequest(RoomSubmit):
    """Prefill engine -> agent: send room `room` from these source pages to decode `peer_replica`."""

    PATH = "/v1/send"
    PEER_ROLE = "decode"
    UNIQUE = False


@dataclass(frozen=True)
class ReceiveRequest(RoomSubmit):
    """Decode engine -> agent: room `room` from prefill `peer_replica` lands in these pages."""

    PATH = "/v1/receive"
    PEER_ROLE = "prefill"
    UNIQUE = True

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        msg = super().parse(body)
        if not msg.kv_pages:
            raise malformed("kv_pages is empty: a room moves at least one page")
        return msg


# ---------------------------------------------------------------- peer messages
def _layout(value: Any) -> PoolLayout:
    d = _body_dict(value, "peer room info layout")
    try:
        layout = PoolLayout.from_dict(dict(d))
    except (TypeError, KeyError) as exc:
        raise malformed(f"peer room info has a bad layout: {exc}") from None
    numbers = [v for k, v in vars(layout).items() if k != "aux_items"] + list(layout.aux_items)
    if not all(type(v) is int and v >= 0 for v in numbers):
        raise malformed("peer room info layout fields must be non-negative integers")
    return layout


def _bases(value: Any) -> Bases:
    d = _body_dict(value, "peer room info bases")
    try:
        bases = Bases(**d)
    except TypeError as exc:
        raise malformed(f"peer room info has bad bases: {exc}") from None
    if not all(type(v) is int and v > 0 for v in (bases.kv, bases.state, bases.aux)):
        raise malformed("peer room info bases must be positive integers")
    return bases


@dataclass(frozen=True)
class RoomInfo:
    """Decode agent -> prefill agent: where room `room` of `decode_rank` lands (its engine endpoint,
    pool bases and layout, pages, state slots and aux row), for the source `prefill_rank`."""

    PATH: ClassVar[str] = "/v1/peer/dst"

    room: int
    decode_rank: str
    prefill_rank: str
    endpoint: str
    layout: PoolLayout
    bases: Bases
    kv_pages: list[int]
    state_indices: list[int]
    aux_index: int | None

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        prefill_rank = field_str(body, "prefill_rank")
        room = field_int(body, "room")
        decode_rank = field_str(body, "decode_rank")
        for name in ("endpoint", "layout", "bases", "kv_pages", "state_indices"):
            if name not in body:
                raise malformed(f"peer room info lacks {name!r}")
        layout, bases = _layout(body["layout"]), _bases(body["bases"])
        endpoint = body["endpoint"]
        if not isinstance(endpoint, str) or not endpoint:
            raise malformed("peer room info endpoint must be a non-empty string")
        pages = field_indices(body, "kv_pages", layout.kv_pages, what="KV pages", unique=True)
        state = field_indices(body, "state_indices", layout.state_slots, what="state slots", unique=True)
        aux = field_opt_int(body, "aux_index")
        check_index(aux, layout.aux_slots, name="aux_index")
        return cls(room, decode_rank, prefill_rank, endpoint, layout, bases, pages, state, aux)

    def to_json(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "decode_rank": self.decode_rank,
            "prefill_rank": self.prefill_rank,
            "endpoint": self.endpoint,
            "layout": self.layout.to_dict(),
            "bases": {"kv": self.bases.kv, "state": self.bases.state, "aux": self.bases.aux},
            "kv_pages": pack_indices(self.kv_pages),
            "state_indices": list(self.state_indices),
            "aux_index": self.aux_index,
        }


KINDS = frozenset(kind.value for kind in Kind)


def _bytes_by_path(body: Mapping[str, Any]) -> BytesByPath:
    """Per path, bytes per kind; kinds are a closed set (paths are checked by the receiver against
    the paths it knows: both become metric labels)."""
    by_path = body.get("bytes_by_path") or {}
    if not isinstance(by_path, dict) or not all(
        isinstance(p, str)
        and isinstance(v, dict)
        and all(k in KINDS and type(n) is int and n >= 0 for k, n in v.items())
        for p, v in by_path.items()
    ):
        raise malformed(f"bytes_by_path must map paths to {{kind: bytes}} with kinds in {sorted(KINDS)}")
    return by_path


@dataclass(frozen=True)
class SourceReport:
    """What a done report and a launch notice share: the decode room and the source that speaks."""

    room: int
    decode_rank: str
    prefill_rank: str
    bytes_by_path: BytesByPath

    def _head(self) -> dict[str, Any]:
        return {"room": self.room, "decode_rank": self.decode_rank, "prefill_rank": self.prefill_rank}


def _report_head(body: Mapping[str, Any]) -> tuple[int, str, str]:
    decode_rank = field_str(body, "decode_rank")
    room = field_int(body, "room")
    return room, decode_rank, field_str(body, "prefill_rank")


@dataclass(frozen=True)
class DoneReport(SourceReport):
    """Prefill agent -> decode agent: this source's batches were confirmed (``ok``), with the aux rows
    that travel in the report itself (the TCP side channel), or it failed with ``reason``."""

    PATH: ClassVar[str] = "/v1/peer/done"

    ok: bool
    reason: str = ""
    aux_rows: tuple[tuple[int, bytes], ...] = ()

    @classmethod
    def failure(cls, room: int, decode_rank: str, prefill_rank: str, reason: str) -> DoneReport:
        return cls(room, decode_rank, prefill_rank, {}, ok=False, reason=reason)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        room, decode_rank, prefill_rank = _report_head(body)
        ok = body.get("ok", False)
        if not isinstance(ok, bool):
            raise malformed("field 'ok' must be true or false")
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise malformed("field 'reason' must be a string")
        if not ok:
            return cls(room, decode_rank, prefill_rank, {}, ok=False, reason=reason or "unknown")
        rows = body.get("aux_rows") or []
        if not isinstance(rows, list):
            raise malformed("aux_rows must be a list of [offset, base64] pairs")
        parsed: list[tuple[int, bytes]] = []
        for row in rows:
            try:
                dst_off, data = row
                raw = base64.b64decode(data, validate=True)
            except (TypeError, ValueError):
                raise malformed("aux_rows must be a list of [offset, base64] pairs") from None
            if type(dst_off) is not int:
                raise malformed("aux_rows offsets must be integers")
            parsed.append((dst_off, raw))
        return cls(room, decode_rank, prefill_rank, _bytes_by_path(body), ok=True, aux_rows=tuple(parsed))

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {**self._head(), "ok": False, "reason": self.reason}
        return {
            **self._head(),
            "ok": True,
            "bytes_by_path": self.bytes_by_path,
            "aux_rows": [[off, base64.b64encode(raw).decode()] for off, raw in self.aux_rows],
        }


@dataclass(frozen=True)
class LaunchNotice(SourceReport):
    """Prefill agent -> decode agent: this source's data is in kernels launched just now; it has
    arrived once every completion mark is reached."""

    PATH: ClassVar[str] = "/v1/peer/launched"

    marks: tuple[CompletionMark, ...]

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        room, decode_rank, prefill_rank = _report_head(body)
        by_path = _bytes_by_path(body)
        raw = body.get("marks")
        if not isinstance(raw, list) or not raw:
            raise malformed("marks must be a non-empty list of {board, slot, seq}")
        try:
            marks = tuple(CompletionMark.from_json(m) for m in raw)
        except ValueError as exc:
            raise malformed(f"cannot watch the completion of room {room}: {exc}") from None
        return cls(room, decode_rank, prefill_rank, by_path, marks)

    def to_json(self) -> dict[str, Any]:
        return {**self._head(), "marks": [m.to_json() for m in self.marks], "bytes_by_path": self.bytes_by_path}


PeerMessage = RoomInfo | DoneReport | LaunchNotice
