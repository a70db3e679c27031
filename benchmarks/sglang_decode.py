"""The decode scheduler's part that talks to the backend, built on SGLang's own queues
(``DecodePreallocQueue``, ``DecodeTransferQueue``); see ``sglang_queues.py``."""

from __future__ import annotations

import types
from typing import Any

import torch

from benchmarks.sglang_queues import Rank, new_req


class _NoSpec:
    def is_none(self) -> bool:
        return True


class DecodeSide:
    def __init__(self, classes: dict[str, Any], rank: Rank, port: int) -> None:
        import torch.distributed as dist
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

        self.rank, self.port = rank, port
        group = dist.group.WORLD
        # What the queues read of SGLang's decode scheduler: no hicache, no speculative decoding,
        # no metrics, no checksum; the first token's reasoning count is not kept.
        self.enable_decode_hicache = self.enable_hisparse = False
        self.kv_checksum_computer = None
        self.spec_algorithm = _NoSpec()
        self.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
        self.batch_result_processor = types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, tok: None)
        self.output_streamer = types.SimpleNamespace(stream_output=lambda *a, **k: None)
        t = DecodeTransferQueue.__new__(DecodeTransferQueue)
        t.queue, t.gloo_group, t.tp_rank, t.scheduler = [], group, 0, self
        t.metadata_buffers, t.req_to_metadata_buffer_idx_allocator = rank.meta, rank.rows
        t.enable_host_receive = t.enable_staging = t.enable_deferred_kv_release = False
        t.staging_handler, t.tree_cache, t.spec_algorithm = None, None, self.spec_algorithm
        t._skipped_checksum_signatures, t._deferred_releases = set(), []
        p = DecodePreallocQueue.__new__(DecodePreallocQueue)
        p.queue, p.pending_reqs, p.retracted_queue, p.pp_size, p.tp_rank = [], [], [], 1, 0
        p.gloo_group, p.scheduler, p.transfer_queue = group, self, t
        p.kv_manager, p.transfer_backend = rank.manager, classes["backend"]
        p.req_to_metadata_buffer_idx_allocator = rank.rows
        p._ensure_last_attempt_time, p._ensure_retry_count, p._prefill_dp_rank_queries = {}, {}, {}
        p._ensure_retry_interval, p._max_ensure_retries = 0.01, 10_000
        p._num_published_destinations = 0
        self.disagg_decode_prealloc_queue, self.prealloc, self.transfer = p, p, t

    def add(self, room: int, tokens: int) -> Any:
        """A request the router sent: its receiver (``DecodePreallocQueue.add``'s enqueue, without
        the KV-capacity check that wants a model runner), resolved and ``init``ed as SGLang does."""
        req = new_req(room, tokens, self.port, 0)
        req.bench_pages = self.rank.pages.take(-(-tokens // self.rank.page))
        decode_req = self.prealloc._create_receiver_and_enqueue(req)
        self.prealloc.pending_reqs.append(decode_req)
        return decode_req

    def step_prealloc(self) -> list[Any]:
        """One iteration of the prealloc queue: resolve pending receivers, poll the handshakes, and
        for those decode can take, send their pages and a metadata row (then the transfer queue
        holds them)."""
        p = self.prealloc
        p._resolve_pending_reqs()
        p._update_handshake_waiters()
        ready = [d for d in p.queue if d.waiting_for_input]
        for d in ready:
            page = self.rank.page
            kv = torch.tensor([x * page + t for x in d.req.bench_pages for t in range(page)], dtype=torch.int64)
            p._send_kv_metadata(d, kv, page)
        p.queue = [d for d in p.queue if not d.waiting_for_input]
        if ready:
            self.transfer.extend(ready)
        return ready

    def pop_transferred(self) -> list[Any]:
        return self.transfer.pop_transferred()

    def poll_transfer(self) -> list[int]:
        """The transfer queue's per-iteration poll alone (its metadata gate included)."""
        return self.transfer._poll_with_metadata_gate()

    def release(self, req: Any) -> None:
        self.rank.pages.give(req.bench_pages)
