"""The engine door's memory registration (POST /v1/memory): the engine's own buffers of one rank,
its KV, state and aux (and its draft KV, its room board), parsed and checked for what the message
alone can say; the agent checks them against the model before it maps anything
(``ranks/engine_memory``). ``to_json`` is the inverse, used by the engine-side client."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.board import BoardShare
from pdfabric_agent.protocol.buffers import BufferShare, StateParts, shares_field
from pdfabric_agent.protocol.draft import DraftKv
from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import (
    MAX_AUX_ITEMS,
    MAX_AUX_ROW_BYTES,
    field_int,
    field_opt_int,
    field_opt_str,
    field_str,
)
from pdfabric_core.policy.types import KvKind


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
