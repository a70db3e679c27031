"""What a NIXL rank hands its peers and what a writer keeps of them: the rank's metadata blob
(its NIXL agent metadata and registered regions, ``RankMetadata``), the endpoint that names the
agent and the blob's digest (``name#digest``), and the regions by address (``Regions``)."""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdfabric_agent.transfer.base import TransferError

DIGEST_CHARS = 16


def metadata_digest(metadata: bytes) -> str:
    return hashlib.sha256(metadata).hexdigest()[:DIGEST_CHARS]


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """An endpoint's NIXL agent name and metadata digest; ValueError if it is not a NIXL endpoint."""
    name, sep, digest = endpoint.rpartition("#")
    if not sep or not name or len(digest) != DIGEST_CHARS:
        raise ValueError(f"{endpoint!r} is not a nixl endpoint (name#digest)")
    return name, digest


@dataclass(frozen=True)
class Region:
    """One registered region: where it is and NIXL's segment type for it."""

    addr: int
    size: int
    segment: str
    device_id: int = 0  # the GPU of a VRAM region

    def holds(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.size


class Regions:
    """Registered regions by start address, for finding which one holds a block."""

    def __init__(self, regions: Sequence[Region] = ()) -> None:
        self._by_addr = sorted(regions, key=lambda r: r.addr)
        self._starts = [r.addr for r in self._by_addr]

    def find(self, addr: int, length: int) -> Region | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self._by_addr[i].holds(addr, length):
            return self._by_addr[i]
        return None

    def add(self, region: Region) -> Regions:
        return Regions([*self._by_addr, region])

    def without(self, addr: int) -> Regions:
        return Regions([r for r in self._by_addr if r.addr != addr])

    def __iter__(self) -> Any:
        return iter(self._by_addr)


@dataclass(frozen=True)
class RankMetadata:
    """What a writer needs of a peer rank: its NIXL agent metadata and its regions (for the segment
    type of a destination, and to refuse a block outside them before NIXL does). ``encode`` is the
    blob the agent's peer door hands out, opaque to everything but this module."""

    nixl: bytes
    regions: tuple[Region, ...]

    def encode(self) -> bytes:
        regions = [[r.addr, r.size, r.segment, r.device_id] for r in self.regions]
        return json.dumps({"nixl": base64.b64encode(self.nixl).decode(), "regions": regions}).encode()

    @classmethod
    def decode(cls, blob: bytes) -> RankMetadata:
        try:
            doc = json.loads(blob)
            regions = tuple(Region(int(a), int(s), str(g), int(d)) for a, s, g, d in doc["regions"])
            return cls(base64.b64decode(doc["nixl"], validate=True), regions)
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"malformed NIXL rank metadata: {exc}") from exc
