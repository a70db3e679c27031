"""An engine's registered state against the PDCluster's model: its kind, each tensor's item
bytes at this rank's TP, its TP sharding and sub-blocks (``MemoryRegistration.state_parts``);
a mismatch is refused naming both sides and the spec fields that would describe the engine."""

from __future__ import annotations

import json
from typing import Any

from pdfabric_agent.protocol.errors import layout_mismatch
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_core.policy.rank_mapping import local_heads
from pdfabric_core.policy.types import StateKind
from pdfabric_core.spec import PDClusterSpec


def state_items(reg: MemoryRegistration, spec: PDClusterSpec, tp: int, where: str) -> tuple[tuple[int, ...], int]:
    """The registered state against the model's (spec.model's stateKind, stateTensorBytes,
    stateTensorSharded at this TP): each tensor's item bytes and the slots every buffer holds, or
    ``layout_mismatch`` naming both sides. A registration without typed parts is the replicated
    slot state it always was (``state_slot_bytes`` per slot of every buffer)."""
    geo = spec.model
    items, sharded, kind = geo.state_item_bytes(tp), geo.state_sharded, geo.state_kind
    blocks = tuple(geo.state_tensor_blocks[i] if i < len(geo.state_tensor_blocks) else () for i in range(len(items)))
    parts = reg.state_parts
    got: tuple[StateKind, tuple[int, ...], tuple[bool, ...], tuple[tuple[int, ...], ...]]
    if parts is None:
        n = len(reg.state)
        got = (StateKind.SLOT, (reg.state_slot_bytes,) * n, (False,) * n, ((),) * n)
    else:
        got = (parts.kind, parts.item_bytes, parts.sharded, parts.blocks_of(len(parts.item_bytes)))
    if got[:3] == (kind, items, sharded) and got[3] != blocks:
        raise layout_mismatch(
            f"state tensors with sub-blocks sharded apart of {[list(b) for b in got[3]]} whole bytes registered; "
            f"the PDCluster's model has spec.model.stateTensorBlocks {[list(b) for b in blocks]}: set it to the engine's"
        )
    if got[:3] != (kind, items, sharded):
        source = f" (SGLang's {parts.source} state)" if parts is not None else ""
        raise layout_mismatch(
            f"{got[0].value} state{source} of {len(got[1])} tensors of {list(got[1])} bytes per item, TP-sharded "
            f"{list(got[2])}, registered; {where} has {kind.value} state of {len(items)} tensors of {list(items)} "
            f"bytes, TP-sharded {list(sharded)} (spec.model stateKind, stateTensorBytes {list(geo.state_tensors)} "
            f"whole, stateTensorSharded): the engine's state is spec.model {_as_spec(got, spec, tp)}"
        )
    bad = [b.nbytes for b, item in zip(reg.state, items, strict=True) if b.nbytes % item]
    if bad:
        raise layout_mismatch(f"a state buffer of {bad[0]} bytes is not a whole number of its items")
    return items, min((b.nbytes // item for b, item in zip(reg.state, items, strict=True)), default=0)


def _as_spec(
    got: tuple[StateKind, tuple[int, ...], tuple[bool, ...], tuple[tuple[int, ...], ...]], spec: PDClusterSpec, tp: int
) -> str:
    """A registration's state as the spec's fields (whole items: a sharded item times TP; a page of
    this rank's KV heads scaled to every head)."""
    kind, items, sharded, blocks = got
    heads = spec.model.tp_kv_heads
    if kind is StateKind.PAGE:
        whole = [i * heads // local_heads(tp, heads) for i in items]
    else:
        whole = [i * tp if s else i for i, s in zip(items, sharded, strict=True)]
    fields: dict[str, Any] = {"stateKind": kind.value, "stateTensorBytes": whole}
    if kind is StateKind.SLOT and any(sharded):
        fields["stateTensorSharded"] = list(sharded)
    if any(blocks):
        fields["stateTensorBlocks"] = [list(b) for b in blocks]
    return json.dumps(fields)
