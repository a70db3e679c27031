"""The fast path behind the agent's TransferBackend interface, with the engine kept as fallback.

`FastPathBackend` wraps the rank's engine backend (Mooncake under INTRA_NODE_NVLINK). It registers
every pool with the engine as before and, for GPU pools, also publishes their CUDA IPC exports in
a small JSON file in the agent's shared-memory directory, named after the engine endpoint (the
files and the peers found through them: `peers`). A `write_batch` to a peer endpoint whose file
exists there (an agent on the same node) and whose blocks all fall inside GPU pools on both sides
runs as one kernel launch into the peer's mapped pools; anything else (another node, CPU pools, a
peer without exports) goes through the engine.
Completion is confirmed on a completion board before `write_batch` returns, so the agent's
"written, then tell the peer" sequence keeps its meaning. The board is a file beside the exports;
`completion_mark` names a launch's word on it, so the receiving agent can watch the word itself
(`pdfabric_agent.memory.completion`) instead of waiting for a report sent after completion.

This module holds the launch logic: which requests the kernel takes, planning them (`plan`),
reserving the receiver's pages and launching (`channel`), waiting on the board; and
`maybe_fast_path`, the choice between this backend and the engine alone at start-up.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence

import torch

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.ipc import CompletionBoard, ExportDoc, export_pool
from pdfabric_agent.memory.plan import Block, KvPages
from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.transfer.base import KernelPath, TransferBackend, TransferError
from pdfabric_agent.transfer.fastpath.channel import FastPathSender
from pdfabric_agent.transfer.fastpath.kernel import KernelConfig
from pdfabric_agent.transfer.fastpath.launched import Launched, as_launched, page_spans
from pdfabric_agent.transfer.fastpath.layout import Layout, page_layout
from pdfabric_agent.transfer.fastpath.peers import PeerDirectory, PeerMap, PublishedPool, export_file, publish_exports
from pdfabric_agent.transfer.fastpath.plan import plan_blocks, plan_blocks_list, plan_pages
from pdfabric_agent.transfer.fastpath.select import TransferPath
from pdfabric_agent.transfer.fastpath.table import LaunchPlan
from pdfabric_core.policy.types import Device

log = logging.getLogger("pdfabric.fastpath")
SMALL_BATCH = 256  # up to this many blocks are planned in plain Python (aux rows, coalesced requests)
# The most blocks one kernel batch takes: its table (16 bytes a block) stays within MAX_TABLE_BYTES.
KERNEL_MAX_BLOCKS = 1 << 21
# Requests of at least PIPELINE_MIN_PAGES pages launch their first 1/PIPELINE_HEAD of pages alone.
PIPELINE_MIN_PAGES = 64
PIPELINE_HEAD = 8
SPIN_S = 200e-6  # spin this long on the completion word, then poll with short sleeps (frees the GIL)


class FastPathBackend(TransferBackend):
    """Engine backend plus the kernel path. Besides the protocol's ``write_batch`` (kernel when it
    can, else the engine; returns the label of what moved the batch), it offers ``kernel`` (itself:
    see ``backend.KernelPath``): launch-now calls that return None, having moved nothing, when the
    kernel cannot take the data: ``submit_pages``/``try_write_pages`` (a route's whole KV from its
    page lists, one launch) and ``submit_blocks``/``try_write_blocks`` (any number of blocks up to
    KERNEL_MAX_BLOCKS, one launch)."""

    path = TransferPath.FASTPATH.value

    def __init__(
        self,
        inner: TransferBackend,
        *,
        gpu: int,
        shm_dir: str,
        cfg: KernelConfig | None = None,
        timeout_s: float = 30.0,
        sender: FastPathSender | None = None,  # tests hand in a stand-in (no GPU)
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.transport = inner.transport
        self.max_batch_entries = inner.max_batch_entries  # write_batch may fall back to the engine
        self.gpu = gpu
        self.timeout_s = timeout_s
        self._dir = shm_dir
        self._local: list[tuple[int, int]] = []
        self._exports: list[PublishedPool] = []
        self._sender = sender if sender is not None else FastPathSender(gpu, cfg=cfg)
        self._board = CompletionBoard(directory=shm_dir)  # beside the exports: peers read it there
        self._directory = PeerDirectory(gpu=gpu, shm_dir=shm_dir, sender=self._sender, board=self._board)
        self._batches = itertools.count()
        self.kernel_batches = 0
        self.engine_batches = 0
        self._trace = os.environ.get("PDFABRIC_FASTPATH_TRACE") == "1"  # per-batch timings in the log
        self._submit_lock = threading.Lock()  # sequence numbers must reach the stream in order
        # Per pair of pools (a connection): the whole-page table's fixed part and the buffer pairs.
        self._layouts: dict[tuple[Hashable, ...], Layout] = {}
        self._pairs: dict[tuple[Hashable, ...], list[tuple[int, int]]] = {}

    @property
    def kernel(self) -> KernelPath:
        return self

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, self.inner.path)

    @property
    def device_memory(self) -> bool:
        return self.inner.device_memory

    @property
    def host_memory_only_because(self) -> str:
        return self.inner.host_memory_only_because

    def endpoint(self) -> str:
        return self.inner.endpoint()

    def register(self, pool: Pool) -> None:
        try:
            self.inner.register(pool)
        except TransferError:
            # Mooncake cannot register GPU memory this process opened from another one (an
            # engine's buffer, by CUDA IPC): the kernels reach it, a batch left to the engine
            # fails (TransferError) instead of moving the bytes.
            if pool.device != Device.CUDA or not pool.handle or json.loads(pool.handle).get("owner_pid") == os.getpid():
                raise
            log.warning(
                "%s: kernel path only (the engine cannot register memory mapped from another process)", pool.name
            )
        if pool.device != Device.CUDA:
            return
        torch.cuda.synchronize(self.gpu)  # what was written into the pool lands before a peer writes it
        # Pool.allocate already exported it for clients; the same export serves peers.
        exp: ExportDoc = (
            json.loads(pool.handle) if pool.handle else export_pool(pool.addr, pool.size, self.gpu).to_json()
        )
        self._local.append((pool.addr, pool.size))
        self._exports.append({"addr": pool.addr, "size": pool.size, "export": exp})
        publish_exports(export_file(self._dir, self.endpoint()), self.gpu, self._exports)

    def unregister(self, pool: Pool) -> None:
        self.inner.unregister(pool)
        if (pool.addr, pool.size) in self._local:
            self._local.remove((pool.addr, pool.size))
            self._exports = [e for e in self._exports if (e["addr"], e["size"]) != (pool.addr, pool.size)]
            publish_exports(export_file(self._dir, self.endpoint()), self.gpu, self._exports)

    def _peer(self, peer: str) -> PeerMap | None:
        """The peer's pools as writable here, or None (engine path): ``peers.PeerDirectory.lookup``."""
        return self._directory.lookup(peer)

    def write_batch(self, peer: str, blocks: Sequence[Block]) -> str | None:
        if not blocks:
            return None
        used = self.try_write_blocks(peer, blocks)
        if used is not None:
            return used
        self.engine_batches += 1
        return self.inner.write_batch(peer, blocks) or self.inner.path

    def try_write_blocks(self, peer: str, blocks: Sequence[Block]) -> str | None:
        """All blocks in one kernel launch, confirmed; None (nothing moved) when the kernel cannot
        take them: peer not on this node, a block outside the GPU pools, too many blocks."""
        launched = self.submit_blocks(peer, blocks)
        return None if launched is None else self.wait(launched)

    def try_write_pages(self, peer: str, kvp: KvPages) -> str | None:
        """A route's KV (``plan.KvPages``: every layer and K/V of its page lists) in one launch,
        confirmed; None (nothing moved) when the kernel cannot take it."""
        launched = self.submit_pages(peer, kvp)
        return None if launched is None else self.wait(launched)

    def submit_blocks(self, peer: str, blocks: Sequence[Block]) -> Launched | None:
        """``try_write_blocks`` up to the launch: returns without waiting; pass it to ``wait``."""
        if not blocks or len(blocks) > KERNEL_MAX_BLOCKS:
            return None
        t0 = time.perf_counter()
        pm = self._peer(peer)
        if pm is None:
            return None
        planned = self._plan_small(pm, blocks) if len(blocks) <= SMALL_BATCH else self._plan_large(pm, blocks)
        if planned is None:
            return None
        plan, ranges = planned
        return self._launch(peer, plan, ranges, t0, f"{len(blocks)} blocks", time.perf_counter())

    def submit_pages(self, peer: str, kvp: KvPages) -> Launched | None:
        """``try_write_pages`` up to the launch: returns without waiting; pass it to ``wait``.

        A large request goes as two launches on the one stream: the first PIPELINE_HEAD-th of its
        pages, planned and launched first, then the rest, planned while the first one runs, so
        the GPU starts after a small fraction of the planning. The handle is the second launch
        (its completion implies the first's: stream order) holding the first in ``before``."""
        if not kvp.src_pages:
            return None
        t0 = time.perf_counter()
        pm = self._peer(peer)
        if pm is None or len(kvp.src_pages) != len(kvp.dst_pages):
            return None
        spans = page_spans(kvp)
        if spans is None:
            return None
        s_span, d_span = spans
        # A route's buffers (every layer and K/V) lie in one KV pool on each side: check the
        # envelope once and shift every destination by one offset; buffer by buffer otherwise.
        lo_s, lo_d = min(kvp.src_bases), min(kvp.dst_bases)
        mapped_lo = pm.translate_one(lo_d, max(kvp.dst_bases) - lo_d + d_span)
        if mapped_lo is not None and self._local_ok(lo_s, max(kvp.src_bases) - lo_s + s_span):
            delta = mapped_lo - lo_d
            key: tuple[Hashable, ...] = (kvp.src_bases, kvp.dst_bases, delta, kvp.item, kvp.src_limit, kvp.dst_limit)
            pairs = self._pairs.get(key)
            if pairs is None:
                pairs = [(sb, db + delta) for sb, db in zip(kvp.src_bases, kvp.dst_bases, strict=True)]
        else:
            pairs = []
            for sb, db in zip(kvp.src_bases, kvp.dst_bases, strict=True):
                mapped = pm.translate_one(db, d_span)
                if mapped is None or not self._local_ok(sb, s_span):
                    return None
                pairs.append((sb, mapped))
            key = (kvp.src_bases, tuple(pairs), kvp.item, kvp.src_limit, kvp.dst_limit)
        # The ledger key: this route's slice of the receiver's KV pool (a decode page index names
        # the same bytes in every layer and K/V buffer of it).
        pool = f"kv@{kvp.dst_bases[0]:#x}/{kvp.item}"
        chunk = self._sender.cfg.chunk_bytes
        layout: Layout | None = None
        if kvp.whole_page:
            layout = self._layouts.get(key)
            if layout is None:
                if len(self._layouts) > 64:
                    self._layouts.clear()
                    self._pairs.clear()
                layout = self._layouts[key] = page_layout(
                    pool, pairs, kvp.item, chunk, src_pages=kvp.src_limit, dst_pages=kvp.dst_limit
                )
                self._pairs[key] = pairs
        src, dst = kvp.src_pages, kvp.dst_pages
        n = len(src)
        head = n // PIPELINE_HEAD if n >= PIPELINE_MIN_PAGES else 0

        def launch(lo: int, hi: int, t_start: float) -> Launched:
            s_part, d_part = (src, dst) if (lo, hi) == (0, n) else (src[lo:hi], dst[lo:hi])
            plan = plan_pages(
                pool, pairs, kvp.item, kvp.src_stride, kvp.dst_stride, s_part, d_part, chunk, layout,
                limits=(kvp.src_limit, kvp.dst_limit),
            )  # fmt: skip
            what = f"{len(pairs) * (hi - lo)} pages x buffers"
            return self._launch(peer, plan, None, t_start, what, time.perf_counter())

        if not head:
            return launch(0, n, t0)
        first = launch(0, head, t0)
        try:
            rest = launch(head, n, time.perf_counter())
        except BaseException:
            self.wait(first)  # its pages are being written: let them land (and free the ledger)
            raise
        rest.before = first
        return rest

    def _launch(
        self,
        peer: str,
        plan: LaunchPlan,
        ranges: Iterable[tuple[int, int]] | None,
        t0: float,
        what: str,
        t_planned: float,
    ) -> Launched:
        room = ("batch", next(self._batches))
        with self._submit_lock:
            if ranges is not None:
                # Exact byte ranges on the receiver: an overlapping concurrent batch is refused.
                self._sender.ledger.reserve_ranges(room, peer, ranges)
            try:
                tr = self._sender.submit_plan(room, peer, plan)  # reserves plan.dst_pages_by_pool
            except BaseException:
                self._sender.ledger.release(room)
                raise
        return Launched(tr, t0, time.perf_counter(), what, plan.total_bytes, t_planned)

    def completion_mark(self, handle: object) -> CompletionMark:
        """Where the receiver sees this launch complete: its sequence number on this sender's board."""
        tr = as_launched(handle).transfer
        return CompletionMark(tr.board.name, tr.slot, tr.seq)

    def wait(self, handle: object) -> str:
        """Until the receiver's completion word says every byte of the launch landed; returns the
        path label. Spins briefly, then polls with short sleeps (other threads keep the GIL).
        ``kernel_batches`` counts requests (a pipelined request's two launches are one)."""
        launched = as_launched(handle)
        if launched.before is not None:
            self._wait_launch(launched.before)
        self._wait_launch(launched)
        self.kernel_batches += 1
        return self.path

    def _wait_launch(self, launched: Launched) -> None:
        tr, t1 = launched.transfer, launched.t1
        deadline = t1 + self.timeout_s
        while not tr.done():
            now = time.perf_counter()
            if now > deadline:
                tr.wait(0.0)  # raises TransferTimeout with the room in the message
            if now - t1 > SPIN_S:
                time.sleep(20e-6)
        if self._trace:
            t2 = time.perf_counter()
            log.info(
                "fastpath batch: %s, %d bytes, prepare+launch %.3f ms (plan %.3f), launch->confirmed %.3f ms",
                launched.what, launched.nbytes, (t1 - launched.t0) * 1e3, (launched.t_planned - launched.t0) * 1e3,
                (t2 - t1) * 1e3,
            )  # fmt: skip

    def _local_ok(self, src: int, length: int) -> bool:
        return any(base <= src and src + length <= base + size for base, size in self._local)

    def _plan_small(self, pm: PeerMap, blocks: Sequence[Block]) -> tuple[LaunchPlan, list[tuple[int, int]]] | None:
        triples: list[tuple[int, int, int]] = []
        ranges: list[tuple[int, int]] = []
        for b in blocks:
            mapped = pm.translate_one(b.dst, b.length)
            if mapped is None or not self._local_ok(b.src, b.length):
                return None
            triples.append((b.src, mapped, b.length))
            ranges.append((b.dst, b.dst + b.length))
        return plan_blocks_list(triples, self._sender.cfg.chunk_bytes), ranges

    def _plan_large(self, pm: PeerMap, blocks: Sequence[Block]) -> tuple[LaunchPlan, Iterable[tuple[int, int]]] | None:
        t = torch.tensor([(b.src, b.dst, b.length) for b in blocks], dtype=torch.int64)
        src, dst, length = t[:, 0], t[:, 1], t[:, 2]
        local_ok = torch.zeros_like(src, dtype=torch.bool)
        for base, size in self._local:
            local_ok |= (src >= base) & (src + length <= base + size)
        mapped = pm.translate(dst, length) if bool(local_ok.all()) else None
        if mapped is None:
            return None
        ranges = zip(dst.tolist(), (dst + length).tolist(), strict=True)
        return plan_blocks(src, mapped, length, self._sender.cfg.chunk_bytes), ranges

    def probe(self, peer: str) -> bool:
        return self.inner.probe(peer)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.unlink(export_file(self._dir, self.endpoint()))
        with contextlib.suppress(Exception):
            self._sender.close()
        with contextlib.suppress(Exception):
            self._board.close()
        self.inner.close()


def maybe_fast_path(inner: TransferBackend, *, gpu: int, env: Mapping[str, str] | None = None) -> TransferBackend:
    """The backend an intra-node NVLink rank uses: the fast path over `inner` when this process can
    run it (peer access from its GPU, driver + NVRTC, not disabled), else `inner` alone. Never
    raises: the engine path is always there to fall back on, and the reason is logged."""
    from pdfabric_agent.transfer.fastpath.select import choose_path, fastpath_enabled
    from pdfabric_core.policy.types import MemPool

    env = dict(os.environ) if env is None else env
    try:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ok, why = cuda.available()
        peers = [p for p in range(visible) if p != gpu]
        peer_access = bool(peers) and ok and all(cuda.can_access_peer(gpu, p) for p in peers)
        choice = choose_path(
            MemPool.INTRA_NODE_NVLINK,
            inner.transport,
            visible_gpus=visible,
            src_device=gpu,
            dst_device=peers[0] if peers else gpu,
            peer_access=peer_access,
            kernel_available=(ok, why),
            enabled=fastpath_enabled(env),
        )
        if choice.path is not TransferPath.FASTPATH:
            log.info("GPU %d: engine path (%s)", gpu, choice.reason)
            return inner
        return FastPathBackend(inner, gpu=gpu, shm_dir=env.get("PDFABRIC_SHM_DIR") or "/dev/shm")
    except Exception as exc:
        log.warning("GPU %d: fast path unavailable, engine path kept: %s", gpu, exc)
        return inner
