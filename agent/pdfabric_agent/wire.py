"""The wire format: one typed message per request the agent takes, parsed and checked here.

Client messages (the serving engine -> its node's agent): ``SendRequest``, ``ReceiveRequest``,
``MemoryRegistration`` (/v1/memory: the engine's own buffers of a rank).
Peer messages (agent -> agent): ``RoomInfo`` (/v1/peer/dst: where a decode room's data lands),
``DoneReport`` (/v1/peer/done: a source's data landed, or failed), ``LaunchNotice``
(/v1/peer/launched: a source's kernels run; watch their completion marks), ``RoomCancel``
(/v1/peer/cancel: the decode side gave a room up; the source stops and says whether its writes
are over).

``parse`` checks what the message alone can say (types, closed sets, self-consistent bounds) and
raises ``ApiError`` (400) with the field to fix; what needs the agent's state (the rank's layout,
the rank map, the room) is checked by the handler right after. ``to_json`` is the inverse, used by
the client and by peers, so both sides of a message are written in one place.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pdfabric_agent.completion import CompletionMark
from pdfabric_agent.errors import malformed, out_of_range
from pdfabric_agent.fields import (
    MAX_AUX_ITEMS,
    MAX_AUX_ROW_BYTES,
    MAX_BUFFERS,
    MAX_INT,
    MAX_MARKS,
    MAX_PATHS,
    MAX_REASON,
    MAX_STR,
    check_index,
    check_indices,
    check_object,
    check_str,
    field_flag,
    field_index_list,
    field_indices,
    field_int,
    field_opt_int,
    field_str,
    indices_json,
    pack_indices,
    too_large,
)
from pdfabric_agent.labels import Kind
from pdfabric_agent.plan import Bases, MemoryMap
from pdfabric_agent.pools import PageOrder, PoolLayout

CHECKSUM = re.compile(r"[0-9a-f]{1,16}:[0-9a-f]{16}")  # integrity.checksum's form
# Bytes per kind ("kv", "state", "aux") and, per `path` label, the bytes that path moved.
KindBytes = dict[str, int]
BytesByPath = dict[str, KindBytes]


def zero_bytes() -> KindBytes:
    return {kind.value: 0 for kind in Kind}


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
    # The pages are in the engine's own registered memory (POST /v1/memory), never the agent's pools:
    # an agent that restarted and lost the registration refuses the room instead of moving its pools.
    engine_memory: bool = False

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
            engine_memory=field_flag(body, "engine_memory"),
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
        if self.engine_memory:
            body["engine_memory"] = True
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

    # Prompt tokens decode already holds (SGLang's decode radix cache: ``decode_prefix_len``): the
    # pages here are those after them, and the prefill sends from that token on.
    prefix_tokens: int = 0

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        msg = super().parse(body)
        if not msg.kv_pages:
            raise malformed("kv_pages is empty: a room moves at least one page")
        prefix = field_opt_int(body, "prefix_tokens")
        return dataclasses.replace(msg, prefix_tokens=prefix) if prefix else msg

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        if self.prefix_tokens:
            body["prefix_tokens"] = self.prefix_tokens
        return body


@dataclass(frozen=True)
class AbortRequest:
    """Engine -> agent: the engine gave up room `room` on `rank` (SGLang's ``abort``): it fails now,
    and its peers are told."""

    PATH: ClassVar[str] = "/v1/abort"

    rank: str
    room: int
    reason: str = "aborted by the engine"
    # A decode rank's room it has not submitted yet: the prefill replica it was to come from, whose
    # agents are told (else the prefill side learns only at its bootstrap deadline).
    peer_replica: int | None = None

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        reason = body.get("reason", cls.reason)
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise malformed(f"field 'reason' must be a string of at most {MAX_REASON} characters")
        return cls(field_str(body, "rank"), field_int(body, "room"), reason, field_opt_int(body, "peer_replica"))

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"rank": self.rank, "room": self.room, "reason": self.reason}
        if self.peer_replica is not None:
            body["peer_replica"] = self.peer_replica
        return body


# ---------------------------------------------------------------- peer messages
def _layout(value: Any) -> PoolLayout:
    d = check_object(value, "peer room info layout")
    try:
        layout = PoolLayout.from_dict(dict(d))
    except (TypeError, KeyError, ValueError) as exc:
        raise malformed(f"peer room info has a bad layout: {exc}") from None
    if len(layout.aux_items) > MAX_AUX_ITEMS:
        raise too_large(f"peer room info layout has {len(layout.aux_items)} aux items; at most {MAX_AUX_ITEMS}")
    numbers = [v for k, v in vars(layout).items() if k not in ("aux_items", "page_order")] + list(layout.aux_items)
    if not all(type(v) is int and 0 <= v <= MAX_INT for v in numbers):
        raise malformed(f"peer room info layout fields must be integers within 0..{MAX_INT}")
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
            if len(data) > 4 * -(-MAX_AUX_ROW_BYTES // 3):  # before decoding
                raise too_large(
                    f"an aux row of {len(data)} base64 characters; rows are at most {MAX_AUX_ROW_BYTES} bytes"
                )
            try:
                raw = base64.b64decode(data, validate=True)
            except ValueError:  # binascii.Error, and non-ASCII characters
                raise malformed("aux_rows must be a list of [address, base64] pairs") from None
            parsed.append((dst_off, raw))
        checksum = body.get("checksum")
        if checksum is not None and (not isinstance(checksum, str) or not CHECKSUM.fullmatch(checksum)):
            raise malformed("field 'checksum' must be '<length hex>:<16 hex digits>'")
        return cls(
            room, decode_rank, prefill_rank, _bytes_by_path(body), ok=True, aux_rows=tuple(parsed), checksum=checksum
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

    def to_json(self) -> dict[str, Any]:
        return {"room": self.room, "decode_rank": self.decode_rank, "prefill_rank": self.prefill_rank,
                "reason": self.reason}  # fmt: skip


PeerMessage = RoomInfo | DoneReport | LaunchNotice | RoomCancel


# ---------------------------------------------------------------- engine memory
class ShareKind(enum.StrEnum):
    SHM = "shm"  # a CPU buffer in a shared-memory file the engine owns: path, offset
    CUDA_IPC = "cuda-ipc"  # a GPU buffer: its allocation's CUDA IPC handle and the buffer's offset


@dataclass(frozen=True)
class BufferShare:
    """How the agent reaches one engine buffer: ``nbytes`` at ``offset`` of a shared-memory file
    (``path``), or of a CUDA allocation (``export``: fastpath.ipc's ExportDoc)."""

    kind: ShareKind
    nbytes: int
    offset: int
    path: str = ""
    export: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, value: Any, name: str) -> Self:
        d = check_object(value, name)
        try:
            kind = ShareKind(str(d.get("kind")))
        except ValueError:
            raise malformed(f"{name}.kind must be one of {[k.value for k in ShareKind]}") from None
        nbytes = field_int(d, "nbytes", minimum=1)
        offset = field_int(d, "offset")
        if kind is ShareKind.SHM:
            path = check_str(d.get("path"), f"{name}.path", limit=MAX_STR)
            if not path.startswith("/"):
                raise malformed(f"{name}.path must be an absolute path of a shared-memory file")
            return cls(kind, nbytes, offset, path=path)
        export = check_object(d.get("export"), f"{name}.export")
        handle = export.get("handle")
        if not (isinstance(handle, str) and 0 < len(handle) <= 256 and all(c in "0123456789abcdef" for c in handle)):
            raise malformed(f"{name}.export.handle must be the CUDA IPC handle in lowercase hex")
        for key in ("offset", "nbytes", "device", "owner_pid"):
            field_int(export, key)
        return cls(kind, nbytes, offset, export=dict(export))

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": self.kind.value, "nbytes": self.nbytes, "offset": self.offset}
        if self.kind is ShareKind.SHM:
            body["path"] = self.path
        else:
            body["export"] = dict(self.export or {})
        return body


def _shares(body: Mapping[str, Any], name: str) -> list[BufferShare]:
    value = body.get(name, [])
    if not isinstance(value, list):
        raise malformed(f"field {name!r} must be a list of buffers")
    if len(value) > MAX_BUFFERS:
        raise too_large(f"field {name!r} has {len(value)} buffers; at most {MAX_BUFFERS}")
    return [BufferShare.parse(v, f"{name}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class MemoryRegistration:
    """Engine -> its node's agent: rank `rank`'s KV, state and aux live in the engine's own buffers
    (SGLang's KVArgs): per layer a K and a V buffer of ``kv_page_bytes`` per page, pages of
    ``page_tokens`` tokens in ``page_order``; per state layer a buffer of ``state_slot_bytes`` per
    slot; per aux item a buffer of ``aux_row_bytes[i]`` per row. The agent checks them against the
    PDCluster's model (``memory.engine_layout``) before it maps or registers anything."""

    PATH: ClassVar[str] = "/v1/memory"

    rank: str
    page_order: PageOrder
    page_tokens: int
    kv_page_bytes: int
    k: list[BufferShare]
    v: list[BufferShare]
    state_slot_bytes: int
    state: list[BufferShare]
    aux_row_bytes: list[int]
    aux: list[BufferShare]

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        rank = field_str(body, "rank")
        try:
            order = PageOrder(str(body.get("page_order")))
        except ValueError:
            raise malformed(f"field 'page_order' must be one of {[o.value for o in PageOrder]}") from None
        aux = _shares(body, "aux")
        rows = body.get("aux_row_bytes", [])
        if not isinstance(rows, list) or len(rows) != len(aux):
            raise malformed("field 'aux_row_bytes' must give the row bytes of every aux buffer")
        return cls(
            rank=rank,
            page_order=order,
            page_tokens=field_int(body, "page_tokens", minimum=1),
            kv_page_bytes=field_int(body, "kv_page_bytes", minimum=1),
            k=_shares(body, "k"),
            v=_shares(body, "v"),
            state_slot_bytes=field_int(body, "state_slot_bytes"),
            state=_shares(body, "state"),
            aux_row_bytes=[_int_item(r, "aux_row_bytes") for r in rows],
            aux=aux,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "page_order": self.page_order.value,
            "page_tokens": self.page_tokens,
            "kv_page_bytes": self.kv_page_bytes,
            "k": [b.to_json() for b in self.k],
            "v": [b.to_json() for b in self.v],
            "state_slot_bytes": self.state_slot_bytes,
            "state": [b.to_json() for b in self.state],
            "aux_row_bytes": list(self.aux_row_bytes),
            "aux": [b.to_json() for b in self.aux],
        }


def _int_item(value: Any, name: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_AUX_ROW_BYTES:
        raise malformed(f"every entry of {name!r} must be an integer within 1..{MAX_AUX_ROW_BYTES}")
    return value
