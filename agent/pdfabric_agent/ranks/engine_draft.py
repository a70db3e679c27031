"""The draft KV group (EAGLE/MTP) of a registration, checked against the PDCluster's model."""

from __future__ import annotations

from pdfabric_agent.protocol.errors import layout_mismatch
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import BufferShare


def draft_buffers(reg: MemoryRegistration, spec_layers: int, want: int, where: str) -> list[BufferShare]:
    """The draft group's buffers, or ``layout_mismatch`` naming the spec field to set: ``want``
    draft layers (``model.draftLayers`` = ``spec_layers`` on the last PP stage, none on the
    others: SGLang runs the draft there only), of the target's KV kind and page bytes (SGLang's
    Mooncake backend slices every KV entry by the target's heads)."""
    have = reg.draft_layers
    if have != want:
        if want == 0 and spec_layers:
            fix = "only the last PP stage, which runs the draft model, registers draft KV"
        elif have:
            fix = f"set spec.model.draftLayers to {have}"
        else:
            fix = (
                "register the draft model's KV buffers (SGLang's num_draft_entries), or set spec.model.draftLayers to 0"
            )
        raise layout_mismatch(
            f"{have} draft KV layers registered, but {where} holds {want} "
            f"(spec.model.draftLayers is {spec_layers}): {fix}"
        )
    if reg.draft is None:
        return []
    if reg.draft.kv_kind is not reg.kv_kind or reg.draft.page_bytes != reg.kv_page_bytes:
        raise layout_mismatch(
            f"a draft KV group of {reg.draft.kv_kind.value} pages of {reg.draft.page_bytes} bytes beside the "
            f"target's {reg.kv_kind.value} pages of {reg.kv_page_bytes}: pdfabric moves a draft of the target's "
            "KV kind, heads and dims (SGLang's Mooncake backend slices every KV entry by the target's heads)"
        )
    return reg.draft.buffers()
