"""Sender-side staging of GPU sources on tcp (issue 24).

Mooncake's TCP transport moves device memory itself, but for a GPU *source* it copies every 64 KiB
into a fresh host buffer with a blocking ``cudaMemcpy`` on its single I/O thread (tcp_transport.cpp,
``ClientSession::writeBody``). Measured on one H200 over loopback that halves its rate, while a GPU
*destination* costs nothing measurable (benchmarks/results/gpu-2026-12-02-tcp-gpu: Mooncake host ->
GPU moved 0.215 / 0.725 / 1.37 / 2.25 GB/s for 4 / 16 / 64 / 256 KiB blocks where host -> host moved
0.194 / 0.758 / 1.74 / 2.21, and GPU -> host only 0.147 / 0.514 / 0.779 / 1.16). So the sender
gathers a batch's GPU sources into pinned host memory it owns (registered with the engine) and the
engine sends from there to the same destinations: destinations, lengths and every rule that made
the blocks (head slices, CP shards and dedup, PP, coalescing, chunking, verify) are unchanged, and
the receiver needs nothing. Pipelined: the gather of the next slice is queued on a CUDA stream
before the engine sends this one, so copy-out overlaps the network.

``plan_stages`` is pure (which blocks are staged, into which slice and at which offset);
``HostStaging`` runs it with torch.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric_agent.memory.plan import Block

SLOT_BYTES = 16 << 20  # one staging slot; a lane has two (double buffering)


@dataclass(frozen=True)
class Region:
    """A registered GPU buffer: [addr, addr + size), its uint8 tensor."""

    addr: int
    size: int
    tensor: Any = field(compare=False, default=None)


@dataclass(frozen=True)
class Group:
    """Blocks of one region and one length, staged at ``at`` one after another."""

    region: int  # index into the regions
    length: int
    offsets: tuple[int, ...]  # in the region
    dsts: tuple[int, ...]
    at: int  # offset in the slot


@dataclass(frozen=True)
class Stage:
    """One slot's worth: its groups and the bytes they take."""

    groups: tuple[Group, ...]
    nbytes: int


def plan_stages(
    blocks: Sequence[Block], regions: Sequence[Region], slot_bytes: int = SLOT_BYTES
) -> tuple[list[Block], list[Stage]]:
    """(blocks whose source is host memory, sent as they are; the GPU-sourced rest in slices of at
    most ``slot_bytes``). A block longer than a slot is split; a block's bytes are staged whole
    within one slice otherwise."""
    starts = [r.addr for r in regions]
    host: list[Block] = []
    staged: list[tuple[int, int, int, int]] = []  # (region, offset, length, dst)
    for b in blocks:
        i = bisect.bisect_right(starts, b.src) - 1
        if i < 0 or b.src + b.length > regions[i].addr + regions[i].size:
            host.append(b)
            continue
        off = b.src - regions[i].addr
        for k in range(0, b.length, slot_bytes):
            staged.append((i, off + k, min(slot_bytes, b.length - k), b.dst + k))
    stages: list[Stage] = []
    current: list[tuple[int, int, int, int]] = []
    used = 0
    for entry in staged:
        if used + entry[2] > slot_bytes:
            stages.append(_stage(current))
            current, used = [], 0
        current.append(entry)
        used += entry[2]
    if current:
        stages.append(_stage(current))
    return host, stages


def _stage(entries: list[tuple[int, int, int, int]]) -> Stage:
    by_key: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for region, off, length, dst in entries:
        by_key.setdefault((region, length), []).append((off, dst))
    groups, at = [], 0
    for (region, length), items in by_key.items():
        groups.append(Group(region, length, tuple(o for o, _ in items), tuple(d for _, d in items), at))
        at += length * len(items)
    return Stage(tuple(groups), at)


def stage_blocks(stage: Stage, slot_addr: int) -> list[Block]:
    """The engine's blocks for a staged slice: from the slot to the original destinations."""
    return [Block(slot_addr + g.at + j * g.length, dst, g.length) for g in stage.groups for j, dst in enumerate(g.dsts)]


class _Lane:
    """Two pinned slots and a stream: what one batch in flight uses."""

    def __init__(self, gpu: int, slot_bytes: int, register: Callable[[int, int], None]) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(f"cuda:{gpu}")
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        for slot in self.slots:
            register(slot.data_ptr(), slot_bytes)

    def gather(self, stage: Stage, slot: int, regions: Sequence[Region]) -> Any:
        """Queue the copy-out of a slice into slot `slot`; returns the event that marks it done."""
        torch = self.torch
        dst = self.slots[slot]
        with torch.cuda.stream(self.stream):
            for g in stage.groups:
                src = regions[g.region].tensor
                offs = torch.tensor(g.offsets, dtype=torch.int64).to(self.device, non_blocking=True)
                n, length = len(g.offsets), g.length
                if all(o % length == 0 for o in g.offsets):  # whole rows (pages): one row gather
                    rows = src[: src.numel() // length * length].view(-1, length).index_select(0, offs // length)
                else:  # byte gather (head slices, odd offsets)
                    idx = (offs[:, None] + torch.arange(length, device=self.device)[None, :]).reshape(-1)
                    rows = src.index_select(0, idx)
                dst[g.at : g.at + n * length].view(n, length).copy_(rows.view(n, length), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def slot_addr(self, slot: int) -> int:
        return int(self.slots[slot].data_ptr())


class HostStaging:
    """GPU regions a backend registered and the pinned lanes that stage their bytes; thread-safe
    (one lane per batch in flight, made on demand and reused)."""

    def __init__(self, gpu: int, register: Callable[[int, int], None], slot_bytes: int = SLOT_BYTES) -> None:
        self.gpu = gpu
        self.slot_bytes = slot_bytes
        self._register = register
        self._regions: list[Region] = []
        self._free: list[_Lane] = []
        self._lock = threading.Lock()

    def add(self, addr: int, size: int, tensor: Any) -> None:
        with self._lock:
            self._regions = sorted([*self._regions, Region(addr, size, tensor)], key=lambda r: r.addr)

    def remove(self, addr: int) -> None:
        with self._lock:
            self._regions = [r for r in self._regions if r.addr != addr]

    @contextlib.contextmanager
    def _lane(self) -> Iterator[_Lane]:
        with self._lock:
            lane = self._free.pop() if self._free else None
        if lane is None:
            lane = _Lane(self.gpu, self.slot_bytes, self._register)
        try:
            yield lane
        finally:
            with self._lock:
                self._free.append(lane)

    def write(self, blocks: Sequence[Block], send: Callable[[list[Block]], None]) -> bool:
        """Send `blocks` through `send`, GPU sources staged; False (nothing sent) when none is on
        a registered GPU region."""
        regions = self._regions  # a snapshot: registrations change only between rooms
        host, stages = plan_stages(blocks, regions, self.slot_bytes)
        if not stages:
            return False
        if host:
            send(host)
        with self._lane() as lane:
            pending = lane.gather(stages[0], 0, regions)
            for i, stage in enumerate(stages):
                # The next slice's copy-out is queued before this one is sent: it overlaps the send.
                following = lane.gather(stages[i + 1], (i + 1) % 2, regions) if i + 1 < len(stages) else None
                pending.synchronize()
                send(stage_blocks(stage, lane.slot_addr(i % 2)))
                pending = following
        return True
