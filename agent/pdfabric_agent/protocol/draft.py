"""The draft model's KV (EAGLE, MTP/NextN) a registration declares as its second KV group.

SGLang appends the draft pool's buffers after the target's in ``kv_data_ptrs`` (MHA: draft K of
every layer, then draft V; MLA: one latent per draft layer) and indexes them by the target's page
ids. The engine declares them apart, typed, so the agent checks them against ``model.draftLayers``
and plans them by the target group's route (``memory.plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.protocol.buffers import BufferShare, shares_field
from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import check_object, field_int
from pdfabric_core.policy.types import KvKind


@dataclass(frozen=True)
class DraftKv:
    """The draft's KV buffers: per draft layer a K and a V (``kv_kind`` MHA) or one latent (MLA),
    of ``page_bytes`` per page, on the target's page ids."""

    kv_kind: KvKind
    page_bytes: int
    k: list[BufferShare]
    v: list[BufferShare]
    latent: list[BufferShare]

    @property
    def layers(self) -> int:
        return len(self.latent) if self.kv_kind is KvKind.MLA else len(self.k)

    def buffers(self) -> list[BufferShare]:
        """Every draft buffer in (layer, buffer) order, as the target's ``kv_buffers``."""
        if self.kv_kind is KvKind.MLA:
            return list(self.latent)
        return [b for pair in zip(self.k, self.v, strict=True) for b in pair]

    @classmethod
    def parse(cls, value: Any) -> Self | None:
        if value is None:
            return None
        d = check_object(value, "draft")
        try:
            kind = KvKind(str(d.get("kv_kind", KvKind.MHA.value)))
        except ValueError:
            raise malformed(f"draft.kv_kind must be one of {[k.value for k in KvKind]}") from None
        k, v, latent = shares_field(d, "k"), shares_field(d, "v"), shares_field(d, "latent")
        mla = kind is KvKind.MLA
        if mla == bool(k or v) or mla != bool(latent) or len(k) != len(v) or not (k or latent):
            raise malformed("draft: give K and V buffers of every draft layer (kv_kind MHA) or latent buffers (MLA)")
        return cls(kind, field_int(d, "page_bytes", minimum=1), k, v, latent)

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_kind": self.kv_kind.value,
            "page_bytes": self.page_bytes,
            "k": [b.to_json() for b in self.k],
            "v": [b.to_json() for b in self.v],
            "latent": [b.to_json() for b in self.latent],
        }
