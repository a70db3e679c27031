"""SGLang's own disaggregation queues driving one prefill rank and one decode rank of a KV transfer
backend (SGLang's Mooncake or NIXL, or pdfabric through its plugin with its agents moving the bytes
with Mooncake or NIXL), in one process: the harness of
``bench_sglang_backends.py`` and of its smoke test.

What is SGLang's code here (sglang.srt.disaggregation, installed): the backend's KVArgs, manager,
sender, receiver and bootstrap server from ``get_kv_class``; ``Req``; ``MetadataBuffers`` and its
row allocator; prefill: ``PrefillBootstrapQueue.create_sender`` / ``pop_bootstrapped`` (which
``init``s the sender), the scheduler's ``send_kv_chunk`` (page indices from ``req_to_token``, the
metadata row written with the last chunk) and ``maybe_send_cached_prefix_chunk``; the inflight
queue's poll (``poll_and_all_reduce_attn_cp_tp_group``, what ``process_disagg_prefill_inflight_queue``
calls); decode: ``DecodePreallocQueue``'s receiver creation, ``_resolve_pending_reqs`` (receiver
``init``), ``_update_handshake_waiters`` and ``_send_kv_metadata``; ``DecodeTransferQueue.pop_transferred``
(its metadata gate, the room check, the row freed). The queues are built without their
``__init__`` (that wants a model runner and a GPU); what they read of a scheduler is set here: one
TP rank (a gloo group of one), page allocation by a free list, no radix tree, no overlap.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("core", "operator", "agent", "integrations/sglang", "hack")]
os.environ.setdefault("MC_FORCE_TCP", "1")  # SGLang's Mooncake over loopback tcp (no RDMA here)
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
from pdfabric_sglangserver.pd import FABRIC_MOVERS, NIXL_CONTROL_ENV, sglang_backend  # noqa: E402
from pdfabric_sglangserver.servers import CONTROLS, patch_control  # noqa: E402

for _key, _value in NIXL_CONTROL_ENV.items():  # SGLang's NIXL over loopback tcp
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

HOST = "127.0.0.1"
META_ROWS = 512  # MetadataBuffers rows per side (one per request in flight)
HIDDEN = 4096  # MetadataBuffers' hidden-state row: float32 x 4096, the spec's default aux rows


def kv_classes(backend: str) -> dict[str, Any]:
    """SGLang's classes for ``backend`` (its ``--disaggregation-transfer-backend``, ``sglang_backend``).
    pdfabric's come from its plugin: SGLang's ``load_plugins`` when the distribution is installed, else the entry point's
    function itself (``pdfabric_sglang.plugin:register``, what load_plugins would call)."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    if not [e for e in entry_points(group="sglang.srt.plugins") if e.name == "pdfabric"]:
        from pdfabric_sglang.plugin import register

        register()  # before load_plugins, which applies the hooks registered (once per process)
    load_plugins()
    from sglang.srt.disaggregation import utils

    tb = utils.TransferBackend(sglang_backend(backend))
    out = {
        k: utils.get_kv_class(tb, getattr(utils.KVClassType, k))
        for k in ("KVARGS", "MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
    }
    if backend in CONTROLS:  # what SGLang's own backends need on CPU, as their servers have it
        patch_control(sys.modules[out["MANAGER"].__module__])
    if backend == "nixl":  # and NIXL's progress thread waiting for events
        import nixl._api

        patch_control(sys.modules[nixl._api.nixl_agent.__module__])
    return out | {"backend": tb}


_published: dict[str, Any] = {}


def publish(bootstrap_port: int) -> None:
    """SGLang's process configuration, as its scheduler publishes it (the test model's directory;
    the bootstrap port is the one Mooncake's prefill registers at), and a gloo group of one rank
    for the queues' all-reduce of polls."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import SpawnRanks, get_parallel
    from sglang.srt.runtime_context import publish as sglang_publish
    from sglang.srt.server_args import ServerArgs

    from pdfabric_sglangserver.model import write_model_dir

    if "model" not in _published:
        _published["model"] = write_model_dir(Path(tempfile.mkdtemp(prefix="bench-model-")))
    args = ServerArgs(model_path=str(_published["model"]), device="cpu", disaggregation_mode="prefill",
                      disaggregation_bootstrap_port=bootstrap_port, disaggregation_transfer_backend="mooncake")  # fmt: skip
    _published["args"] = args
    sglang_publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)  # one stage: the managers keep it, unused
    if not dist.is_initialized():
        from pdfabric_devcluster.procs import free_port

        dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{free_port()}", rank=0, world_size=1)


class PageAllocator:
    """Free pages of a pool (SGLang's token_to_kv_pool_allocator, by page)."""

    def __init__(self, pages: int) -> None:
        self.free = list(range(1, pages))  # page 0 stays unused, as SGLang's padding slot

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"pool exhausted: {n} pages asked, {len(self.free)} free")
        got, self.free = self.free[:n], self.free[n:]
        return got

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


class Rank:
    """One engine rank: a KV pool (SGLang's [token][head][dim] buffers per layer, in ``shm_dir``),
    stock MetadataBuffers and the backend's manager, built from SGLang's KVArgs class."""

    def __init__(self, classes: dict[str, Any], mode: str, geo: dict[str, int], shm_dir: str) -> None:
        from pdfabric_refengine import KVPool, kv_args
        from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers, ReqToMetadataIdxAllocator

        self.page = geo["page"]
        self.pool = KVPool(layers=geo["layers"], local_heads=geo["heads"], head_dim=geo["head_dim"],
                           num_pages=geo["pages"], page_size=self.page, shm_dir=shm_dir)  # fmt: skip
        self.meta = MetadataBuffers(
            META_ROWS, hidden_size=HIDDEN, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )
        self.rows = ReqToMetadataIdxAllocator(META_ROWS)
        self.pages = PageAllocator(geo["pages"])
        args = kv_args(self.pool, engine_rank=0, page_size=self.page, kv_head_num=geo["heads"],
                       total_kv_head_num=geo["heads"], cls=classes["KVARGS"])  # fmt: skip
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        m = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
        if classes["backend"].value == "mooncake":
            # Each rank its own transfer engine, as in SGLang's one process per rank (the module
            # keeps one per process; in one process both ranks would share it and move nothing
            # over tcp).
            from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

            mte._mooncake_transfer_engine = None
            mte.init_mooncake_transfer_engine(HOST, gpu_id=0, ib_device=None)
        self.manager = classes["MANAGER"](args, m, _published["args"], False)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.pool.k_buffers, *self.pool.v_buffers]

    def close(self) -> None:
        for name in ("close", "shutdown"):
            if callable(getattr(self.manager, name, None)):
                getattr(self.manager, name)()
                break
        self.pool.close()


def new_req(room: int, tokens: int, port: int, slot: int) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"r{room}", "", list(range(1, tokens + 1)), SamplingParams(max_new_tokens=1),
              bootstrap_host=HOST, bootstrap_port=port, bootstrap_room=room)  # fmt: skip
    req.kv.req_pool_idx = slot
    return req


class PrefillSide:
    """The prefill scheduler's part that talks to the backend (SGLang's methods, on this object)."""

    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as _M

    send_kv_chunk = _M.send_kv_chunk
    _send_kv_chunk = _M._send_kv_chunk
    maybe_send_cached_prefix_chunk = _M.maybe_send_cached_prefix_chunk

    def __init__(self, classes: dict[str, Any], rank: Rank, port: int, slots: int, max_tokens: int) -> None:
        import torch.distributed as dist
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        self.rank, self.port = rank, port
        self.attn_cp_cpu_group = self.attn_tp_cpu_group = dist.group.WORLD
        self.token_to_kv_pool_allocator = types.SimpleNamespace(
            page_size=rank.page, translate_kv_indices_for_transfer=lambda x: x
        )
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros((slots, max_tokens), dtype=torch.int64))
        self.disagg_metadata_buffers = rank.meta
        self.enable_staging = self.enable_overlap = False
        self.kv_checksum_computer = None
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.processed_tokens_counter = 0
        q = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
        q.queue, q.pp_size, q.pp_rank, q.tp_rank, q.scheduler = [], 1, 0, 0, self
        q.kv_manager, q.transfer_backend, q.bootstrap_port = rank.manager, classes["backend"], port
        q.metadata_buffers, q.req_to_metadata_buffer_idx_allocator = rank.meta, rank.rows
        q.max_input_len, q.scheduler_stage_metrics = max_tokens, None
        q.draft_token_to_kv_pool, q.pp_poll_sync_work_list = None, []
        self.disagg_prefill_bootstrap_queue = self.bootstrap = q
        self.inflight: list[Any] = []
        self._slots = list(range(slots))

    def handle_bootstrap_failure(self, req: Any) -> None:
        raise RuntimeError(f"prefill bootstrap failed for room {req.bootstrap_room}: {req.disagg_kv_sender.poll()}")

    def add(self, room: int, tokens: int) -> Any:
        req = new_req(room, tokens, self.port, self._slots.pop())
        pages = self.rank.pages.take(-(-tokens // self.rank.page))
        tok = torch.tensor([p * self.rank.page + t for p in pages for t in range(self.rank.page)][:tokens])
        self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :tokens] = tok
        req.bench_pages = pages
        req.output_ids = [room % 30000 + 1]  # the first token, sent in the metadata row
        assert self.bootstrap.create_sender(req, self.rank.pool.local_heads)
        self.bootstrap.queue.append(req)
        return req

    def pop_bootstrapped(self) -> list[Any]:
        return self.bootstrap.pop_bootstrapped()

    def chunk(self, req: Any, end: int, last: bool) -> None:
        """A chunked-prefill step computed ``req`` up to token ``end``: SGLang hands it over."""
        req.extend_end = end
        if last:
            self.inflight.append(req)  # SGLang queues the request before its last send
        self.send_kv_chunk(req, last_chunk=last)

    def cached_prefix(self, req: Any, prefix: int) -> None:
        """A radix-cache hit of ``prefix`` tokens, sent before the forward (SGLang's early send)."""
        req.prefix_len, req.host_hit_length = prefix, 0
        self.maybe_send_cached_prefix_chunk(req)

    def poll_inflight(self) -> list[int]:
        from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

        return poll_and_all_reduce_attn_cp_tp_group(
            [r.disagg_kv_sender for r in self.inflight], self.attn_cp_cpu_group, self.attn_tp_cpu_group
        )

    def finish(self, req: Any) -> None:
        """Success at the inflight queue: SGLang clears the sender and frees the row."""
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        self.inflight.remove(req)
        req.disagg_kv_sender.clear()
        maybe_release_metadata_buffer(req, self.rank.rows)
        self.rank.pages.give(req.bench_pages)
        self._slots.append(req.kv.req_pool_idx)


def fabric_spec(geo: dict[str, int], mover: str = "mooncake") -> dict[str, Any]:
    """pdfabric's PDCluster spec for one prefill and one decode rank of ``geo`` on loopback tcp,
    the bytes moved by ``mover``."""
    model = {"layers": geo["layers"], "kvHeads": geo["heads"], "headDim": geo["head_dim"], "dtype": "float32",
             "pageSizeTokens": geo["page"]}  # fmt: skip
    return {
        "backend": mover,
        "prefill": {"tp": 1},
        "decode": {"tp": 1},
        "transfer": {"transport": "tcp", "timeoutSeconds": 120},
        "model": model,
    }


@contextmanager
def backend_pair(backend: str, geo: dict[str, int], slots: int = 600) -> Iterator[tuple[PrefillSide, Any]]:
    """A prefill and a decode rank of ``backend`` (SGLang's own, ``CONTROLS``, or pdfabric's,
    ``FABRIC_MOVERS``: real agents of a LocalFabric), each behind SGLang's queues, and prefill's
    bootstrap server."""
    from benchmarks.sglang_decode import DecodeSide
    from pdfabric_devcluster.procs import free_port

    port = free_port()
    publish(port)
    classes = kv_classes(backend)
    no_fabric = contextmanager(lambda: (yield None))()
    with _fabric(geo, FABRIC_MOVERS[backend]) if backend in FABRIC_MOVERS else no_fabric as lc:
        shm = lc.shm_dir if lc is not None else tempfile.mkdtemp(prefix="bench-shm-", dir="/dev/shm")
        if lc is not None:
            os.environ["PDFABRIC_AGENT_ADDRESS"] = lc.agents[lc.agent_of("prefill-0-tp0-cp0")].address
        server = classes["BOOTSTRAP_SERVER"](HOST, port)
        ranks: list[Rank] = []
        try:
            ranks.append(Rank(classes, "prefill", geo, shm))
            if lc is not None:
                os.environ["PDFABRIC_AGENT_ADDRESS"] = lc.agents[lc.agent_of("decode-0-tp0")].address
            ranks.append(Rank(classes, "decode", geo, shm))
            yield PrefillSide(classes, ranks[0], port, slots, geo["max_tokens"]), DecodeSide(classes, ranks[1], port)
        finally:
            for rank in ranks:
                rank.close()
            close = getattr(server, "close", None)
            if callable(close):
                close()


@contextmanager
def _fabric(geo: dict[str, int], mover: str) -> Iterator[Any]:
    from pdfabric_devcluster.fabric import LocalFabric

    with LocalFabric(fabric_spec(geo, mover), env={"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "600"}) as lc:
        token = Path(lc.shm_dir) / "bench-engine-token"
        token.write_text(lc.token)
        os.environ["PDFABRIC_ENGINE_TOKEN_FILE"] = str(token)
        yield lc


def fill(rank: Rank, pages: list[int], seed: int) -> None:
    """Random bytes in ``pages`` of every buffer (the prefill forward's KV)."""
    gen = torch.Generator().manual_seed(seed)
    page = rank.page
    for buf in rank.buffers():
        for p in pages:
            buf[p * page : (p + 1) * page] = torch.randn(buf[p * page : (p + 1) * page].shape, generator=gen)


def same_bytes(src: Rank, src_pages: list[int], dst: Rank, dst_pages: list[int]) -> bool:
    page = src.page
    for a, b in zip(src.buffers(), dst.buffers(), strict=True):
        for p, q in zip(src_pages, dst_pages, strict=True):
            if not torch.equal(a[p * page : (p + 1) * page], b[q * page : (q + 1) * page]):
                return False
    return True


def wait_until(what: str, cond: Any, step: Any, timeout_s: float = 60.0) -> None:
    """Run scheduler iterations (``step``) until ``cond()``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s} s")
        step()
        time.sleep(0.0005)
