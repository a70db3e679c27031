"""A room sent in several chunks (``SendChunk``, ``POST /v1/send/chunk``): SGLang's chunked prefill
hands a request's pages as each forward writes them, and the agent moves each chunk once decode's
destinations are known, so by the last chunk only the last chunk is left to move.

The chunk at ``page_offset`` 0 opens the room (it carries what a ``SendRequest`` does: the decode
replica and DP group); each later one adds the pages that follow, in order, without gaps or
overlap (``page_offset`` is the number of this rank's source pages the room holds already). The
``final`` chunk carries the state slots and the aux row (SGLang writes them with the last chunk)
and closes the room's page list. A one-shot send is one chunk at offset 0 that is final.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import field_opt_int
from pdfabric_agent.protocol.wire import SendRequest


@dataclass(frozen=True)
class SendChunk(SendRequest):
    """Prefill engine -> agent: the next pages of room `room` (``page_offset`` onwards)."""

    PATH = "/v1/send/chunk"

    page_offset: int = 0
    final: bool = True

    @property
    def opens(self) -> bool:
        return self.page_offset == 0

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        msg = super().parse(body)
        final = body.get("final", True)
        if not isinstance(final, bool):
            raise malformed(f"field 'final' must be true or false, got {type(final).__name__}")
        offset = field_opt_int(body, "page_offset") or 0
        if not final and (msg.state_indices or msg.aux_index is not None or msg.aux_rows or msg.aux_on_board):
            raise malformed(
                "state_indices, aux_index, aux_rows and aux_on_board go with the final chunk (final: true), where "
                "SGLang writes them"
            )
        return dataclasses.replace(msg, page_offset=offset, final=final)

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        body["page_offset"] = self.page_offset
        body["final"] = self.final
        return body
