"""The peer door's messages (agent -> agent), parsed and checked here like the engine door's
(``wire``): ``RoomInfo`` (/v1/peer/dst: where a decode room's data lands), ``DoneReport``
(/v1/peer/done: a source's data landed, or failed), ``LaunchNotice`` (/v1/peer/launched: a source's
kernels run; watch their completion marks), ``RoomCancel`` (/v1/peer/cancel: the decode side gave a
room up; the source stops and says whether its writes are over).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, TypeVar

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Bases, MemoryMap
from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import (
    MAX_AUX_ITEMS,
    MAX_BUFFERS,
    MAX_INT,
    MAX_MARKS,
    MAX_PATHS,
    MAX_REASON,
    MAX_STR,
    check_index,
    check_object,
    check_str,
    decode_aux_row,
    field_indices,
    field_int,
    field_opt_int,
    field_str,
    indices_json,
    pack_indices,
    too_large,
)
from pdfabric_agent.protocol.labels import Kind
from pdfabric_agent.protocol.peer_answers import CancelAnswer, RoomInfoTaken, SourceAnswer
from pdfabric_agent.protocol.wire import CHECKSUM, BytesByPath
from pdfabric_core.policy.types import StateKind

# The peer door's GET routes (its POSTs are the messages' own ``PATH``).
PING_PATH = "/v1/peer/ping"
PROBE_PATH = "/v1/peer/probe"  # the link check's probe regions (node.probe)
# ?rank=R: the rank's transfer metadata (``TransferMetadata``), which a writer's backend loads before
# its first write there (NIXL); a backend whose engines handshake on their own has none (404).
METADATA_PATH = "/v1/peer/metadata"
# A WebSocket on which a peer's messages travel as frames ``{"id", "path", "body"}``, each answered
# ``{"id", "status", "body"}`` as its POST would be (peers/stream.py, http/peer_stream.py).
STREAM_PATH = "/v1/peer/stream"


def _layout(value: Any) -> PoolLayout:
    d = check_object(value, "peer room info layout")
    try:
        layout = PoolLayout.from_dict(dict(d))
    except (TypeError, KeyError, ValueError) as exc:
        raise malformed(f"peer room info has a bad layout: {exc}") from None
    if len(layout.aux_items) > MAX_AUX_ITEMS:
        raise too_large(f"peer room info layout has {len(layout.aux_items)} aux items; at most {MAX_AUX_ITEMS}")
    lists = ("aux_items", "state_items", "state_whole")
    if max(len(layout.state_items), len(layout.state_whole)) > MAX_BUFFERS:
        raise too_large(f"peer room info layout has more than {MAX_BUFFERS} state tensors")
    numbers = [v for k, v in vars(layout).items() if k not in (*lists, "page_order", "state_kind")]
    numbers += [v for k in lists for v in getattr(layout, k)]
    if not all(type(v) is int and 0 <= v <= MAX_INT for v in numbers):
        raise malformed(f"peer room info layout fields must be integers within 0..{MAX_INT}")
    if layout.state_kind not in tuple(StateKind):
        raise malformed(f"peer room info layout's state_kind must be one of {[k.value for k in StateKind]}")
    return layout


def _bases(value: Any, layout: PoolLayout) -> MemoryMap:
    """Where each buffer of the peer's rank starts: a list of addresses per kind."""
    d = check_object(value, "peer room info bases")
    lists: list[tuple[int, ...]] = []
    for kind in ("kv", "state", "aux"):
        addrs = d.get(kind)
        if not isinstance(addrs, list) or len(addrs) > 2 * MAX_BUFFERS:
            raise malformed("peer room info bases must give a list of addresses for kv, state and aux")
        if not all(type(a) is int and 0 < a <= MAX_INT for a in addrs):
            raise malformed(f"peer room info bases must be integers within 1..{MAX_INT}")
        lists.append(tuple(addrs))
    memory = MemoryMap(*lists)
    try:
        memory.check(layout)
    except ValueError as exc:
        raise malformed(f"peer room info: {exc}") from None
    return memory


@dataclass(frozen=True)
class RoomInfo:
    """Decode agent -> prefill agent: where room `room` of `decode_rank` lands (its engine endpoint,
    layout and where each of its buffers starts, pages, state slots and aux row), for the source
    `prefill_rank`. ``bases`` may be given as the agent's pool ``Bases``; it is kept as the
    ``MemoryMap`` they make."""

    PATH: ClassVar[str] = "/v1/peer/dst"

    room: int
    decode_rank: str
    prefill_rank: str
    endpoint: str
    layout: PoolLayout
    bases: MemoryMap
    kv_pages: list[int]
    state_indices: list[int]
    aux_index: int | None
    prefix_tokens: int = 0  # the decode radix prefix (ReceiveRequest.prefix_tokens)

    def __post_init__(self) -> None:
        given: object = self.bases  # Bases at run time when built from the agent's pools
        if isinstance(given, Bases):
            object.__setattr__(self, "bases", MemoryMap.of_pools(self.layout, given))

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        prefill_rank = field_str(body, "prefill_rank")
        room = field_int(body, "room")
        decode_rank = field_str(body, "decode_rank")
        for name in ("endpoint", "layout", "bases", "kv_pages", "state_indices"):
            if name not in body:
                raise malformed(f"peer room info lacks {name!r}")
        layout = _layout(body["layout"])
        bases = _bases(body["bases"], layout)
        endpoint = check_str(body["endpoint"], "endpoint")
        pages = field_indices(body, "kv_pages", layout.kv_pages, what="KV pages", unique=True)
        state = field_indices(body, "state_indices", layout.state_slots, what="state slots", unique=True)
        aux = field_opt_int(body, "aux_index")
        check_index(aux, layout.aux_slots, name="aux_index")
        prefix = field_opt_int(body, "prefix_tokens") or 0
        return cls(room, decode_rank, prefill_rank, endpoint, layout, bases, pages, state, aux, prefix)

    def read_answer(self, doc: Any) -> RoomInfoTaken:
        return RoomInfoTaken.parse(doc)

    def to_json(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "decode_rank": self.decode_rank,
            "prefill_rank": self.prefill_rank,
            "endpoint": self.endpoint,
            "layout": self.layout.to_dict(),
            "bases": {"kv": list(self.bases.kv), "state": list(self.bases.state), "aux": list(self.bases.aux)},
            "kv_pages": pack_indices(self.kv_pages),
            "state_indices": list(self.state_indices),
            "aux_index": self.aux_index,
            "prefix_tokens": self.prefix_tokens,
        }


KINDS = frozenset(kind.value for kind in Kind)


def _bytes_by_path(body: Mapping[str, Any]) -> BytesByPath:
    """Per path, bytes per kind; kinds are a closed set (paths are checked by the receiver against
    the paths it knows: both become metric labels)."""
    by_path = body.get("bytes_by_path") or {}
    if isinstance(by_path, dict) and len(by_path) > MAX_PATHS:
        raise too_large(f"bytes_by_path names {len(by_path)} paths; at most {MAX_PATHS}")
    if not isinstance(by_path, dict) or not all(
        isinstance(p, str)
        and len(p) <= MAX_STR
        and isinstance(v, dict)
        and all(k in KINDS and type(n) is int and 0 <= n <= MAX_INT for k, n in v.items())
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

    def read_answer(self, doc: Any) -> SourceAnswer:
        return SourceAnswer.parse(doc)


def _report_head(body: Mapping[str, Any]) -> tuple[int, str, str]:
    decode_rank = field_str(body, "decode_rank")
    room = field_int(body, "room")
    return room, decode_rank, field_str(body, "prefill_rank")


@dataclass(frozen=True)
class DoneReport(SourceReport):
    """Prefill agent -> decode agent: this source's batches were confirmed (``ok``), with the aux rows
    that travel in the report itself (the TCP side channel), or it failed with ``reason``.

    A report is sent once the source's writes into the room are over, except a failure with
    ``fenced`` false: that source may still be writing (a write it could not stop), so the decode
    side keeps the room's destinations from other rooms until its transfer timeout has passed."""

    PATH: ClassVar[str] = "/v1/peer/done"

    ok: bool
    reason: str = ""
    aux_rows: tuple[tuple[int, bytes], ...] = ()
    checksum: str | None = None  # of the bytes sent to this decode rank (spec.transfer.verify), integrity.py
    fenced: bool = False  # (a failure) nothing of this source lands in the room any more
    # MLA KV cache sharding: the request positions whose pages this source wrote (the pages it owns,
    # which depend on the request's page ids); decode checks every position came exactly once.
    kv_positions: tuple[int, ...] | None = None

    @classmethod
    def failure(cls, room: int, decode_rank: str, prefill_rank: str, reason: str, *, fenced: bool) -> DoneReport:
        return cls(room, decode_rank, prefill_rank, {}, ok=False, reason=reason, fenced=fenced)

    @property
    def writes_over(self) -> bool:
        return self.ok or self.fenced

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        room, decode_rank, prefill_rank = _report_head(body)
        ok = body.get("ok", False)
        if not isinstance(ok, bool):
            raise malformed("field 'ok' must be true or false")
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise malformed("field 'reason' must be a string")
        if len(reason) > MAX_REASON:
            raise too_large(f"field 'reason' has {len(reason)} characters; at most {MAX_REASON}")
        if not ok:
            fenced = body.get("fenced", False)
            if not isinstance(fenced, bool):
                raise malformed("field 'fenced' must be true or false")
            return cls(room, decode_rank, prefill_rank, {}, ok=False, reason=reason or "unknown", fenced=fenced)
        rows = body.get("aux_rows") or []
        if not isinstance(rows, list):
            raise malformed("aux_rows must be a list of [address, base64] pairs")
        if len(rows) > MAX_AUX_ITEMS:
            raise too_large(f"aux_rows has {len(rows)} rows; at most {MAX_AUX_ITEMS}")
        parsed: list[tuple[int, bytes]] = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], str)):
                raise malformed("aux_rows must be a list of [address, base64] pairs")
            dst_off, data = row
            if type(dst_off) is not int or not 0 <= dst_off <= MAX_INT:
                raise malformed(f"aux_rows addresses must be integers within 0..{MAX_INT}")
            parsed.append((dst_off, decode_aux_row(data, "aux_rows must be a list of [address, base64] pairs")))
        checksum = body.get("checksum")
        if checksum is not None and (not isinstance(checksum, str) or not CHECKSUM.fullmatch(checksum)):
            raise malformed("field 'checksum' must be '<length hex>:<16 hex digits>'")
        positions = None
        if body.get("kv_positions") is not None:
            # Checked against the room's own pages when it is taken (decode.py); here only the form.
            positions = tuple(field_indices(body, "kv_positions", MAX_INT, what="request positions", unique=True))
        return cls(
            room,
            decode_rank,
            prefill_rank,
            _bytes_by_path(body),
            ok=True,
            aux_rows=tuple(parsed),
            checksum=checksum,
            kv_positions=positions,
        )

    def to_json(self) -> dict[str, Any]:
        if not self.ok:
            return {**self._head(), "ok": False, "reason": self.reason, "fenced": self.fenced}
        return {
            **self._head(),
            "ok": True,
            "bytes_by_path": self.bytes_by_path,
            "aux_rows": [[off, base64.b64encode(raw).decode()] for off, raw in self.aux_rows],
            **({} if self.checksum is None else {"checksum": self.checksum}),
            **({} if self.kv_positions is None else {"kv_positions": indices_json(self.kv_positions)}),
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
        if len(raw) > MAX_MARKS:
            raise too_large(f"marks has {len(raw)} entries; at most {MAX_MARKS}")
        if any(isinstance(m, Mapping) and type(m.get("seq")) is int and m["seq"] > MAX_INT for m in raw):
            raise malformed(f"completion mark seq must be within 1..{MAX_INT}")
        try:
            marks = tuple(CompletionMark.from_json(m) for m in raw)
        except ValueError as exc:
            raise malformed(f"cannot watch the completion of room {room}: {exc}") from None
        return cls(room, decode_rank, prefill_rank, by_path, marks)

    def to_json(self) -> dict[str, Any]:
        return {**self._head(), "marks": [m.to_json() for m in self.marks], "bytes_by_path": self.bytes_by_path}


@dataclass(frozen=True)
class RoomCancel:
    """Decode agent -> prefill agent: the decode side gave room `room` of `decode_rank` up (its
    engine aborted it, its deadline passed, another source failed). The prefill rank writes nothing
    more there: room info it holds for the room is dropped, and a room of its own that has not
    written yet fails. The answer says whether its writes into that room are over (``fenced``), so
    the decode side can give the room's destinations to the next room at once."""

    PATH: ClassVar[str] = "/v1/peer/cancel"

    room: int
    decode_rank: str
    prefill_rank: str
    reason: str

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        room, decode_rank, prefill_rank = _report_head(body)
        reason = body.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise malformed(f"field 'reason' must be a string of at most {MAX_REASON} characters")
        return cls(room, decode_rank, prefill_rank, reason or "cancelled by the decode side")

    def read_answer(self, doc: Any) -> CancelAnswer:
        return CancelAnswer.parse(doc)

    def to_json(self) -> dict[str, Any]:
        return {"room": self.room, "decode_rank": self.decode_rank, "prefill_rank": self.prefill_rank,
                "reason": self.reason}  # fmt: skip


Answer = TypeVar("Answer", covariant=True)  # the answer type of one message


class PeerMessage(Protocol[Answer]):
    """A message for the peer door: its route, its body, and how its answer is read."""

    PATH: ClassVar[str]

    def to_json(self) -> dict[str, Any]: ...

    def read_answer(self, doc: Any) -> Answer: ...
