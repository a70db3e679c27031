"""The engine memory a registration (``memory_registration.MemoryRegistration``) names: how the agent reaches each
engine buffer (``BufferShare``), and the engine's typed state (``StateParts``: its kind, SGLang's
state type, and each state tensor's item bytes and TP sharding)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from pdfabric_agent.protocol.errors import malformed
from pdfabric_agent.protocol.fields import MAX_BUFFERS, MAX_STR, check_object, check_str, field_int, too_large
from pdfabric_core.policy.types import StateKind


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


def shares_field(body: Mapping[str, Any], name: str) -> list[BufferShare]:
    value = body.get(name, [])
    if not isinstance(value, list):
        raise malformed(f"field {name!r} must be a list of buffers")
    if len(value) > MAX_BUFFERS:
        raise too_large(f"field {name!r} has {len(value)} buffers; at most {MAX_BUFFERS}")
    return [BufferShare.parse(v, f"{name}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class StateParts:
    """An engine's state, typed: ``kind`` (slot, page or row: how a room indexes it), SGLang's state
    type it came from (``mamba``, ``swa``, ``request_row``), and per state buffer its item bytes
    on this rank and whether attention TP shards it (SGLang's ``state_dim_per_tensor`` above 0)."""

    kind: StateKind
    source: str
    item_bytes: tuple[int, ...]
    sharded: tuple[bool, ...]
    # Per buffer, the whole bytes of its sub-blocks TP shards apart (GDN's conv q | k | v); () one block.
    blocks: tuple[tuple[int, ...], ...] = ()

    def blocks_of(self, n: int) -> tuple[tuple[int, ...], ...]:
        """``blocks`` padded to ``n`` buffers (a buffer without an entry is one block)."""
        return tuple(self.blocks[i] if i < len(self.blocks) else () for i in range(n))

    @classmethod
    def parse(cls, value: Any, buffers: int) -> Self | None:
        if value is None:
            return None
        d = check_object(value, "state_parts")
        try:
            kind = StateKind(str(d.get("kind")))
        except ValueError:
            raise malformed(f"state_parts.kind must be one of {[k.value for k in StateKind]}") from None
        items, sharded = d.get("item_bytes"), d.get("sharded")
        if not isinstance(items, list) or not isinstance(sharded, list) or not len(items) == len(sharded) == buffers:
            raise malformed(
                f"state_parts.item_bytes and state_parts.sharded must each give one entry per state buffer ({buffers})"
            )
        if not all(isinstance(s, bool) for s in sharded):
            raise malformed("every entry of state_parts.sharded must be true or false")
        blocks = d.get("blocks", [])
        if (
            not isinstance(blocks, list)
            or len(blocks) > buffers
            or not all(isinstance(b, list) and len(b) <= 64 for b in blocks)
        ):
            raise malformed("state_parts.blocks must be a list, a buffer at most, of lists of sub-block bytes")
        return cls(
            kind,
            check_str(d.get("source", kind.value), "state_parts.source", limit=MAX_STR),
            tuple(field_int({"item": i}, "item", minimum=1) for i in items),
            tuple(sharded),
            tuple(tuple(field_int({"block": n}, "block", minimum=1) for n in b) for b in blocks),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "source": self.source,
            "item_bytes": list(self.item_bytes),
            "sharded": list(self.sharded),
            **({"blocks": [list(b) for b in self.blocks]} if any(self.blocks) else {}),
        }
