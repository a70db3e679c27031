"""The wire format of the engine door: one typed message per request a serving engine sends its
node's agent about its rooms, parsed and checked here: ``SendRequest``, ``ReceiveRequest``,
``AbortRequest``; its memory registration (/v1/memory) is ``memory_registration``'s. The peer
door's messages are ``peer_wire``'s; the byte counts both carry (``KindBytes``, ``BytesByPath``)
are here.

``parse`` checks what the message alone can say (types, closed sets, self-consistent bounds) and
raises ``ApiError`` (400) with the field to fix; what needs the agent's state (the rank's layout,
the rank map, the room) is checked by the handler right after. ``to_json`` is the inverse, used by
the client and by peers, so both sides of a message are written in one place.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pdfabric_agent.memory.pools import PoolLayout
from pdfabric_agent.protocol.board import MAX_SLOTS as MAX_BOARD_SLOTS
from pdfabric_agent.protocol.buffers import BufferShare as BufferShare  # importable from here, as before
from pdfabric_agent.protocol.buffers import ShareKind as ShareKind
from pdfabric_agent.protocol.errors import malformed, out_of_range
from pdfabric_agent.protocol.fields import (
    MAX_REASON,
    aux_rows_json,
    check_index,
    check_indices,
    field_flag,
    field_index_list,
    field_int,
    field_opt_int,
    field_str,
    indices_json,
    parse_aux_rows,
)
from pdfabric_agent.protocol.labels import Kind

CHECKSUM = re.compile(r"[0-9a-f]{1,16}:[0-9a-f]{16}")  # integrity.checksum's form
# Bytes per kind ("kv", "state", "aux") and, per `path` label, the bytes that path moved.
KindBytes = dict[str, int]
BytesByPath = dict[str, KindBytes]


def zero_bytes() -> KindBytes:
    return {kind.value: 0 for kind in Kind}


# The engine door's GET routes (its POSTs are the messages' own ``PATH``).
INFO_PATH = "/v1/info"
ROOM_ROUTE = "/v1/rooms/{rank}/{room}"  # a room view; ``?wait_s=`` makes it a long poll
# A rank's room feed: one JSON object per line (FeedHello, then RoomViews), an empty line as a
# heartbeat every FEED_HEARTBEAT_S while nothing changes.
EVENTS_ROUTE = "/v1/events/{rank}"
FEED_HEARTBEAT_S = 2.0


def room_path(rank: str, room: int, wait_s: float) -> str:
    return ROOM_ROUTE.format(rank=rank, room=room) + f"?wait_s={wait_s:g}"


# ---------------------------------------------------------------- client messages
@dataclass(frozen=True)
class RoomSubmit:
    """What `send` and `receive` share: a room on one local rank, its pages, state slots and aux row,
    and the replica of the other role it pairs with, and its DP group there (``peer_dp``: SGLang's
    prefill DP rank for a receive, the decode rank's DP group for a send)."""

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
    peer_dp: int = 0
    board_slot: int | None = None  # the slot of the rank's room board the agent writes the end into

    PEER_FIELD: ClassVar[str]  # the field names of `peer_replica` and `peer_dp`, from PEER_ROLE
    PEER_DP_FIELD: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "PEER_ROLE" in cls.__dict__:
            cls.PEER_FIELD, cls.PEER_DP_FIELD = f"{cls.PEER_ROLE}_replica", f"{cls.PEER_ROLE}_dp"

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        return cls(
            rank=field_str(body, "rank"),
            room=field_int(body, "room"),
            kv_pages=field_index_list(body, "kv_pages"),
            state_indices=field_index_list(body, "state_indices"),
            aux_index=field_opt_int(body, "aux_index"),
            peer_replica=field_int(body, cls.PEER_FIELD),
            engine_memory=field_flag(body, "engine_memory"),
            peer_dp=field_opt_int(body, cls.PEER_DP_FIELD) or 0,
            board_slot=field_opt_int(body, "board_slot", maximum=MAX_BOARD_SLOTS - 1),
        )

    def check_bounds(self, layout: PoolLayout, peer_replicas: int, peer_dps: int = 1) -> None:
        """Against the local rank's pools and the spec's replica and DP group counts."""
        check_indices(self.kv_pages, layout.kv_pages, name="kv_pages", what="KV pages", unique=self.UNIQUE)
        check_indices(
            self.state_indices, layout.state_slots, name="state_indices", what="state slots", unique=self.UNIQUE
        )
        check_index(self.aux_index, layout.aux_slots, name="aux_index")
        if self.peer_replica >= peer_replicas:
            raise out_of_range(f"{self.PEER_FIELD} {self.peer_replica} outside 0..{peer_replicas - 1}")
        if self.peer_dp >= peer_dps:
            raise out_of_range(f"{self.PEER_DP_FIELD} {self.peer_dp} outside 0..{peer_dps - 1} (the spec's dp)")

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rank": self.rank,
            "room": self.room,
            "kv_pages": indices_json(self.kv_pages),
            "state_indices": list(self.state_indices),
            self.PEER_FIELD: self.peer_replica,
        }
        if self.aux_index is not None:
            body["aux_index"] = self.aux_index
        if self.engine_memory:
            body["engine_memory"] = True
        if self.peer_dp:
            body[self.PEER_DP_FIELD] = self.peer_dp
        if self.board_slot is not None:
            body["board_slot"] = self.board_slot
        return body


@dataclass(frozen=True)
class SendRequest(RoomSubmit):
    """Prefill engine -> agent: send room `room` from these source pages to decode `peer_replica`."""

    PATH = "/v1/send"
    PEER_ROLE = "decode"
    UNIQUE = False

    # The room's aux row, one bytes per aux item, from an engine that keeps its aux buffers private
    # (registered with ``aux_slots``): the agent puts them in its own aux row ``aux_index`` first.
    aux_rows: tuple[bytes, ...] = ()
    # Instead of ``aux_rows``: the engine wrote the row into the room's slot of its room board
    # (``protocol.board``) before this send, and the agent reads it from there.
    aux_on_board: bool = False

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        msg = super().parse(body)
        on_board = field_flag(body, "aux_on_board")
        if "aux_rows" not in body and not on_board:
            return msg
        if msg.aux_index is None:
            raise malformed("aux_rows or aux_on_board without aux_index: name the aux row they belong to")
        if on_board:
            if "aux_rows" in body:
                raise malformed("aux_rows and aux_on_board: the row comes one way, in the body or on the board")
            return dataclasses.replace(msg, aux_on_board=True)
        return dataclasses.replace(msg, aux_rows=parse_aux_rows(body["aux_rows"], "aux_rows"))

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        if self.aux_rows:
            body["aux_rows"] = aux_rows_json(self.aux_rows)
        if self.aux_on_board:
            body["aux_on_board"] = True
        return body


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
    # A decode rank's room it has not submitted yet: the prefill replica (and DP group) it was to come
    # from, whose agents are told (else the prefill side learns only at its bootstrap deadline).
    peer_replica: int | None = None
    peer_dp: int = 0

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        reason = body.get("reason", cls.reason)
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise malformed(f"field 'reason' must be a string of at most {MAX_REASON} characters")
        peer_dp = field_opt_int(body, "peer_dp") or 0
        return cls(
            field_str(body, "rank"), field_int(body, "room"), reason, field_opt_int(body, "peer_replica"), peer_dp
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"rank": self.rank, "room": self.room, "reason": self.reason}
        if self.peer_replica is not None:
            body["peer_replica"] = self.peer_replica
        if self.peer_dp:
            body["peer_dp"] = self.peer_dp
        return body
