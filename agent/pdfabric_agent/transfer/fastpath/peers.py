"""How the fast path finds the agents on its node: pool export files and the peers' mapped pools.

Every `FastPathBackend` publishes the CUDA IPC exports of its GPU pools in a small JSON file in the
agent's shared-memory directory, named after its engine endpoint (`export_file`,
`publish_exports`). A sender whose peer endpoint has such a file there is on the same node:
`PeerDirectory` maps the peer's pools into this process (or, for a peer in this process, enables
peer access), connects the sender to the peer on its completion board, and keeps the result as a
`PeerMap` (the peer's pool addresses as writable from here) until the peer publishes again. A peer
without a file, on this GPU, or one that cannot be mapped gets None: the engine path.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import TypedDict

import torch

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.completion import BOARD_SLOTS
from pdfabric_agent.memory.ipc import CompletionBoard, ExportDoc, PoolExport
from pdfabric_agent.transfer.fastpath.channel import FastPathSender

log = logging.getLogger("pdfabric.fastpath")


class PublishedPool(TypedDict):
    """One GPU pool in an export file: where the owner sees it, and its CUDA IPC export."""

    addr: int
    size: int
    export: ExportDoc


class ExportsFile(TypedDict):
    """An export file: the publishing process, its GPU, and its GPU pools."""

    pid: int
    gpu: int
    pools: list[PublishedPool]


def export_file(shm_dir: str, endpoint: str) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in endpoint)
    return os.path.join(shm_dir, f"pdfabric-fastpath-{safe}.json")


def publish_exports(path: str, gpu: int, pools: list[PublishedPool]) -> None:
    """(Re)write an endpoint's export file with every GPU pool registered so far."""
    tmp = f"{path}.{os.getpid()}.tmp"
    doc: ExportsFile = {"pid": os.getpid(), "gpu": gpu, "pools": pools}
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)  # readers never see half a file


@dataclass(frozen=True)
class PeerMap:
    """A peer's pools as this process writes them."""

    ranges: tuple[tuple[int, int, int], ...]  # (peer addr, size, address writable from here)

    def translate_one(self, dst: int, length: int) -> int | None:
        for base, size, mapped in self.ranges:
            if base <= dst and dst + length <= base + size:
                return dst - base + mapped
        return None

    def translate(self, dst: torch.Tensor, length: torch.Tensor) -> torch.Tensor | None:
        out = torch.full_like(dst, -1)
        for base, size, mapped in self.ranges:
            inside = (dst >= base) & (dst + length <= base + size)
            out = torch.where(inside, dst - base + mapped, out)
        return None if bool((out < 0).any()) else out


class PeerDirectory:
    """The peers of one sender, from their export files in ``shm_dir``; each peer gets its own slot
    on the sender's completion board."""

    def __init__(self, *, gpu: int, shm_dir: str, sender: FastPathSender, board: CompletionBoard) -> None:
        self.gpu = gpu
        self._dir = shm_dir
        self._sender = sender
        self._board = board
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[tuple[int, int] | None, PeerMap | None]] = {}  # peer -> (file stamp, map)
        self._slot_of: dict[str, int] = {}
        self._slots = itertools.count()

    def lookup(self, peer: str) -> PeerMap | None:
        """The peer's pools as writable here, or None (engine path). The export file is checked on
        every batch (one stat): a peer agent that restarted publishes new pools under the same
        endpoint, and writing through the old mapping would land in memory nobody reads."""
        path = export_file(self._dir, peer)
        try:
            st = os.stat(path)
            stamp: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)  # each publish is a new file
        except OSError:
            stamp = None
        with self._lock:
            cached = self._peers.get(peer)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            pm = None
            if stamp is not None:
                try:
                    pm = self._map_peer(peer, path)
                except Exception as exc:  # a peer we cannot map must not break the transfer
                    log.warning("fast path to %s unavailable, using the engine: %s", peer, exc)
            self._peers[peer] = (stamp, pm)
            return pm

    def _map_peer(self, peer: str, path: str) -> PeerMap | None:
        with open(path, encoding="utf-8") as fh:
            info: ExportsFile = json.load(fh)
        if info["pid"] == os.getpid():  # same process: its addresses are valid here once peers can talk
            if info["gpu"] != self.gpu:  # on one GPU there is no peer to enable
                cuda.enable_peer_access(self.gpu, info["gpu"])
            ranges = tuple((p["addr"], p["size"], p["addr"]) for p in info["pools"])
        else:
            ranges = tuple(
                (p["addr"], p["size"], self._sender.map_pool(PoolExport.from_json(p["export"]))) for p in info["pools"]
            )
        if peer not in self._slot_of:
            slot = next(self._slots)
            if slot >= BOARD_SLOTS:
                raise RuntimeError("completion board full")
            self._slot_of[peer] = slot
        self._sender.connect(peer, self._board, self._slot_of[peer])
        return PeerMap(ranges)
