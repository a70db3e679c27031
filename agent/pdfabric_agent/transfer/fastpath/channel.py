"""The sender side of the fast path: one launch per request, completion on the receiver's board.

`FastPathSender` owns one CUDA stream on its source GPU, a block counter for the kernel's
last-block signal, and the IPC mappings of the receivers' pools. `submit` plans the request,
reserves the destination pages in the ledger (refusing overlap), uploads the launch table (or
passes it inline when small) and launches; the returned `Transfer` completes when the receiver's
board slot reaches its sequence number, which the receiver can poll itself with no message from
the sender.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pdfabric_agent.memory import cuda
from pdfabric_agent.memory.completion import BOARD_SLOTS
from pdfabric_agent.memory.ipc import CompletionBoard, PeerMappings, PoolExport
from pdfabric_agent.transfer.fastpath.kernel import GatherScatterKernel, KernelConfig
from pdfabric_agent.transfer.fastpath.layout import Layout, plan_launch
from pdfabric_agent.transfer.fastpath.ledger import ReceiverLedger
from pdfabric_agent.transfer.fastpath.table import BufferPair, CopyGroup, LaunchPlan, PageIndices

STAGE_WORDS = 1 << 17  # 1 MiB of table words per staging slot (no pinned allocation per launch)
STAGE_SLOTS = 4  # launches in flight at once with staged tables (a pipelined request uses two)

# torch leaves these two unannotated; the signatures this module calls them with.
_cuda_init: Callable[[], None] = torch.cuda.init
_new_stream: Callable[[int], torch.cuda.Stream] = torch.cuda.Stream


class TransferTimeout(TimeoutError):
    pass


@dataclass
class Transfer:
    room: Hashable
    seq: int
    board: CompletionBoard
    slot: int
    nbytes: int
    submitted_ns: int
    _ledger: ReceiverLedger | None
    _keepalive: object = None
    _done: bool = field(default=False)
    _on_done: Callable[[], None] | None = None  # frees the sender's table staging buffers

    def done(self) -> bool:
        if not self._done and self.board.read(self.slot) >= self.seq:
            self._done = True
            self._keepalive = None
            if self._on_done is not None:
                self._on_done()
            if self._ledger is not None:
                self._ledger.release(self.room)
        return self._done

    def wait(self, timeout_s: float = 30.0) -> int:
        """Spin until complete; returns nanoseconds from submit to completion seen here."""
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"room {self.room!r}: no completion after {timeout_s} s")
        return time.perf_counter_ns() - self.submitted_ns


@dataclass
class _Route:
    board: CompletionBoard
    slot: int
    seq: itertools.count[int]
    flag: int  # where this sender's kernels store the slot's sequence number


class FastPathSender:
    def __init__(self, device: int, *, cfg: KernelConfig | None = None, ledger: ReceiverLedger | None = None) -> None:
        self.device = device
        self.cfg = cfg or KernelConfig()
        torch.cuda.set_device(device)
        _cuda_init()
        self.kernel = GatherScatterKernel.get(device, self.cfg)
        self.stream = _new_stream(device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=f"cuda:{device}")
        self.peers = PeerMappings(device)
        self.ledger = ledger if ledger is not None else ReceiverLedger()
        self._routes: dict[Hashable, _Route] = {}
        # Reusable pinned + device table slots (a whole request's page-list table is a few KiB): the
        # upload is a memcpy and one async copy instead of a pinned allocation per launch. A slot
        # serves one launch at a time and is freed when its completion is seen; with every slot
        # busy, tables are pinned anew.
        self._stage_words = STAGE_WORDS
        self._stage_host = torch.empty(STAGE_SLOTS, STAGE_WORDS, dtype=torch.int64).pin_memory()
        self._stage_dev = torch.empty(STAGE_SLOTS, STAGE_WORDS, dtype=torch.int64, device=f"cuda:{device}")
        self._stage_lock = threading.Lock()
        self._stage_free = list(range(STAGE_SLOTS))
        self._stage_ptrs = [(self._stage_host[i].data_ptr(), self._stage_dev[i].data_ptr()) for i in range(STAGE_SLOTS)]
        torch.cuda.synchronize(device)  # the counter's zero-fill ran on another stream
        self._stream_ptr = self.stream.cuda_stream  # cached: each lookup is a call into torch
        self._counter_ptr = self.counter.data_ptr()

    # ---- set-up ------------------------------------------------------------------------------
    def map_pool(self, export: PoolExport) -> int:
        """The address this sender writes a receiver pool through."""
        return self.peers.map(export)

    def connect(self, receiver: Hashable, board: CompletionBoard, slot: int) -> None:
        if not 0 <= slot < BOARD_SLOTS:
            raise ValueError(f"board slot {slot} outside 0..{BOARD_SLOTS - 1}")
        start = board.read(slot) + 1  # sequence numbers only rise, also across sender restarts
        # Pin now, not on the first request.
        self._routes[receiver] = _Route(board, slot, itertools.count(start), board.device_pointer(self.device, slot))

    # ---- data path ---------------------------------------------------------------------------
    def submit(self, room: Hashable, receiver: Hashable, groups: Sequence[CopyGroup]) -> Transfer:
        t0 = time.perf_counter_ns()
        plan = plan_launch(groups, chunk_bytes=self.cfg.chunk_bytes)
        return self.submit_plan(room, receiver, plan, t0=t0)

    def layout(self, pools: Sequence[tuple[str, Sequence[BufferPair]]]) -> Layout:
        """Fixed buffers of a connection, planned once; pass it to `submit_layout` per request."""
        return Layout(pools, chunk_bytes=self.cfg.chunk_bytes)

    def submit_layout(
        self, room: Hashable, receiver: Hashable, layout: Layout, pages: Sequence[tuple[PageIndices, PageIndices]]
    ) -> Transfer:
        t0 = time.perf_counter_ns()
        if layout.chunk_bytes != self.cfg.chunk_bytes:
            raise ValueError("layout was planned for another kernel configuration")
        return self.submit_plan(room, receiver, layout.plan(pages), t0=t0)

    def submit_plan(self, room: Hashable, receiver: Hashable, plan: LaunchPlan, *, t0: int | None = None) -> Transfer:
        t0 = time.perf_counter_ns() if t0 is None else t0
        route = self._routes[receiver]
        self.ledger.reserve(room, receiver, plan.dst_pages_by_pool)
        try:
            seq = next(route.seq)
            flag = route.flag
            keep: torch.Tensor | None = None
            on_done: Callable[[], None] | None = None
            words: list[int] | None
            if plan.total_units == 0:
                words, table_ptr = [0] * 8, 0
            elif plan.small:
                words, table_ptr = plan.words(), 0  # a small table is a list: words() is that list
            else:
                words = None
                table = (
                    plan.table if isinstance(plan.table, torch.Tensor) else torch.tensor(plan.table, dtype=torch.int64)
                )
                n = table.numel()
                slot = None
                if n <= self._stage_words:
                    with self._stage_lock:
                        slot = self._stage_free.pop() if self._stage_free else None
                if slot is not None:
                    # Driver calls, not torch ops: a few microseconds instead of tens on the send path.
                    host_ptr, table_ptr = self._stage_ptrs[slot]
                    table = table.contiguous()
                    ctypes.memmove(host_ptr, table.data_ptr(), 8 * n)
                    cuda.primary_context(self.device)
                    cuda.memcpy_htod_async(table_ptr, host_ptr, 8 * n, self._stream_ptr)
                    on_done = functools.partial(self._free_stage, slot)
                else:
                    with torch.cuda.stream(self.stream):
                        keep = table.pin_memory().to(f"cuda:{self.device}", non_blocking=True)
                    table_ptr = keep.data_ptr()
            self.kernel.launch(
                table_ptr=table_ptr,
                small_words=words,
                ngroups=plan.ngroups,
                total_units=plan.total_units,
                stream=self._stream_ptr,
                counter_ptr=self._counter_ptr,
                flag_ptr=flag,
                seq=seq,
            )
        except BaseException:
            if on_done is not None:
                on_done()
            self.ledger.release(room)
            raise
        return Transfer(room, seq, route.board, route.slot, plan.total_bytes, t0, self.ledger, keep, _on_done=on_done)

    def _free_stage(self, slot: int) -> None:
        with self._stage_lock:
            self._stage_free.append(slot)

    def close(self) -> None:
        self.stream.synchronize()
        self.peers.close()
