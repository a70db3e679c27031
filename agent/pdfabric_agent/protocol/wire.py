"""The wire format of the engine door: one typed message per request a serving engine sends its
node's agent, parsed and checked here: ``SendRequest``, ``ReceiveRequest``, ``AbortRequest``,
``MemoryRegistration`` (/v1/memory: the engine's own buffers of a rank). The peer door's messages
are ``peer_wire``'s; the byte counts both carry (``KindBytes``, ``BytesByPath``) are here.

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

from pdfabric_agent.memory.pools import PageOrder, PoolLayout
from pdfabric_agent.protocol.board import MAX_SLOTS as MAX_BOARD_SLOTS
from pdfabric_agent.protocol.board import BoardShare
from pdfabric_agent.protocol.buffers import BufferShare as BufferShare  # importable from here, as before
from pdfabric_agent.protocol.buffers import ShareKind as ShareKind
from pdfabric_agent.protocol.buffers import StateParts, shares_field
from pdfabric_agent.protocol.draft import DraftKv
from pdfabric_agent.protocol.errors import malformed, out_of_range
from pdfabric_agent.protocol.fields import (
    MAX_AUX_ITEMS,
    MAX_AUX_ROW_BYTES,
    MAX_REASON,
    aux_rows_json,
    check_index,
    check_indices,
    field_flag,
    field_index_list,
    field_int,
    field_opt_int,
    field_opt_str,
    field_str,
    indices_json,
    parse_aux_rows,
)
from pdfabric_agent.protocol.labels import Kind
from pdfabric_core.policy.types import KvKind

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


# ---------------------------------------------------------------- engine memory
@dataclass(frozen=True)
class MemoryRegistration:
    """Engine -> its node's agent: rank `rank`'s KV, state and aux live in the engine's own buffers
    (SGLang's KVArgs): per layer a K and a V buffer (``kv_kind`` MHA) or one latent buffer (MLA,
    ``latent``; ``k`` and ``v`` empty) of ``kv_page_bytes`` per page, pages of
    ``page_tokens`` tokens in ``page_order``; per state layer a buffer of ``state_slot_bytes`` per
    slot; per aux item a buffer of ``aux_row_bytes[i]`` per row. The agent checks them against the
    PDCluster's model (``memory.engine_layout``) before it maps or registers anything.

    vLLM keeps a layer's K and V in one buffer (``fused``, alone): each page holds every local head's
    K and V side by side (``[head][K | V]`` or ``[token][head][K | V]``), ``kv_page_bytes`` both.

    Aux buffers the agent cannot map (SGLang's ``MetadataBuffers`` are private CPU memory) stay
    the engine's: it registers no ``aux`` buffers but ``aux_slots`` rows of ``aux_row_bytes``, the
    agent keeps aux rows of its own, a send carries its row (``SendRequest.aux_rows``) and a decode
    room's view hands it back (``RoomView.aux_rows``)."""

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
    aux_slots: int = 0  # rows of private aux buffers (then ``aux`` is empty): the rows travel inline
    kv_kind: KvKind = KvKind.MHA
    latent: list[BufferShare] = dataclasses.field(default_factory=list)  # MLA: one buffer per layer
    # The engine process that registers (``register_memory``'s rule: a second live one is refused).
    instance: str = ""
    # The state typed (kind, SGLang's state type, per buffer item bytes and TP sharding); None: the
    # ``state`` buffers are ``state_slot_bytes`` slots each, replicated (an engine before typed state).
    state_parts: StateParts | None = None
    # The draft model's KV (EAGLE/MTP), a second KV group after the target's; None: no draft.
    draft: DraftKv | None = None
    # A room board (protocol/board.py) the agent writes successful room ends into; None: the feed only.
    board: BoardShare | None = None
    # SGLang's --enable-kv-cache-sharding: the ranks this rank's KV pages are striped over (its
    # pool holds logical page l at l // kv_shard_size when it owns it); 1: every page is here.
    kv_shard_size: int = 1
    fused: list[BufferShare] = dataclasses.field(default_factory=list)  # vLLM: K and V of a layer in one

    @property
    def kv_fused(self) -> bool:
        return bool(self.fused)

    @property
    def aux_inline(self) -> bool:
        return not self.aux and self.aux_slots > 0

    @property
    def board_row_bytes(self) -> list[int]:
        """The aux row a board slot holds: the private rows that travel with a room's view, or none."""
        return list(self.aux_row_bytes) if self.aux_inline else []

    @property
    def draft_layers(self) -> int:
        return self.draft.layers if self.draft is not None else 0

    def target_kv_buffers(self) -> list[BufferShare]:
        """The target model's KV buffers in (layer, buffer) order: each layer's K then V, or its latent."""
        if self.kv_kind is KvKind.MLA or self.fused:  # one buffer per layer: the latent, or K and V fused
            return list(self.latent or self.fused)
        return [b for pair in zip(self.k, self.v, strict=True) for b in pair]

    def kv_buffers(self) -> list[BufferShare]:
        """Every KV buffer the agent maps: the target's, then the draft's (``DraftKv.buffers``)."""
        return self.target_kv_buffers() + (self.draft.buffers() if self.draft is not None else [])

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        rank = field_str(body, "rank")
        try:
            order = PageOrder(str(body.get("page_order")))
        except ValueError:
            raise malformed(f"field 'page_order' must be one of {[o.value for o in PageOrder]}") from None
        aux = shares_field(body, "aux")
        rows = body.get("aux_row_bytes", [])
        inline_slots = field_opt_int(body, "aux_slots", minimum=1) or 0
        if inline_slots and aux:
            raise malformed("give aux buffers or aux_slots (private aux rows that travel inline), not both")
        if not isinstance(rows, list) or len(rows) > MAX_AUX_ITEMS or (len(rows) != len(aux) and not inline_slots):
            raise malformed("field 'aux_row_bytes' must give the row bytes of every aux buffer")
        try:
            kind = KvKind(str(body.get("kv_kind", KvKind.MHA.value)))
        except ValueError:
            raise malformed(f"field 'kv_kind' must be one of {[k.value for k in KvKind]}") from None
        k, v, latent = shares_field(body, "k"), shares_field(body, "v"), shares_field(body, "latent")
        fused = shares_field(body, "fused")
        state = shares_field(body, "state")
        mla = kind is KvKind.MLA
        if fused and (mla or k or v):
            raise malformed("fused K and V buffers (one per layer) are MHA's, and come instead of K and V buffers")
        if mla == bool(k or v or fused) or mla != bool(latent) or len(k) != len(v):
            raise malformed(
                "give K and V buffers of every layer (kv_kind MHA), fused K and V buffers (MHA, one per layer) "
                "or latent buffers (MLA), one of them"
            )
        return cls(
            rank=rank,
            page_order=order,
            page_tokens=field_int(body, "page_tokens", minimum=1),
            kv_page_bytes=field_int(body, "kv_page_bytes", minimum=1),
            k=k,
            v=v,
            state_slot_bytes=field_int(body, "state_slot_bytes"),
            state=state,
            aux_row_bytes=[_int_item(r, "aux_row_bytes") for r in rows],
            aux=aux,
            aux_slots=inline_slots,
            kv_kind=kind,
            latent=latent,
            instance=field_opt_str(body, "instance"),
            state_parts=StateParts.parse(body.get("state_parts"), len(state)),
            draft=DraftKv.parse(body.get("draft")),
            board=BoardShare.parse(body.get("board")),
            kv_shard_size=field_opt_int(body, "kv_shard_size", minimum=1) or 1,
            fused=fused,
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
            **({"aux_slots": self.aux_slots} if self.aux_slots else {}),
            **(
                {"kv_kind": self.kv_kind.value, "latent": [b.to_json() for b in self.latent]}
                if self.kv_kind is KvKind.MLA
                else {}
            ),  # an MHA registration reads as it always did
            **({"instance": self.instance} if self.instance else {}),
            **({"state_parts": self.state_parts.to_json()} if self.state_parts else {}),
            **({"draft": self.draft.to_json()} if self.draft else {}),
            **({"board": self.board.to_json()} if self.board else {}),
            **({"kv_shard_size": self.kv_shard_size} if self.kv_shard_size > 1 else {}),
            **({"fused": [b.to_json() for b in self.fused]} if self.fused else {}),
        }


def _int_item(value: Any, name: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_AUX_ROW_BYTES:
        raise malformed(f"every entry of {name!r} must be an integer within 1..{MAX_AUX_ROW_BYTES}")
    return value
