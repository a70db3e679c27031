"""pdfabric's vLLM connector driven by vLLM's own classes, not a harness standing in for vLLM: run by
the vLLM environment's python (``hack/vllm/venv.sh``), under whichever vLLM its PYTHONPATH gives
(the CPU build, or the official release overlaid by ``hack/vllm/official.sh``), it prints a JSON
report on its last line (tests/e2e/test_vllm_official_classes.py asserts on it).

vLLM's real v1 ``Scheduler`` loads the connector through its own factory
(``kv_connector_module_path``) with the scheduler role; requests carry ``kv_transfer_params`` as
vLLM's router sends them; each step is vLLM's ``schedule()`` and ``update_from_output()`` with a
``ModelRunnerOutput`` (sampled tokens, ``KVConnectorOutput``) standing in for the model runner, the
one part of vLLM that cannot run here. Checked: what vLLM does with the connector's answers (a
decode request waits for its KV in blocks vLLM allocated, proceeds from the matched tokens, fails or
recomputes on a load error as its policy says; prefill's blocks are held until sent; aborts free;
one preempted after its KV arrived recomputes its prompt here, with no second transfer).

With agents (``--agents``: a JSON file the pytest module writes from a ``LocalFabric``), the worker
side too: both roles' connectors built by vLLM's factory with the worker role, their KV caches
allocated in the connector's memory pool context and registered with real agents, the metadata the
schedulers built bound to them, their ``get_finished`` fed back to the schedulers as vLLM's
``KVConnectorOutput``: a prompt's KV moves from prefill's blocks into decode's, byte-exact."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import vllm
from pdfabric_vllm.connector import PdfabricConnector, PdfabricMetadata
from pdfabric_vllm.params import RemotePrefill
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

# The e2e servers' model (tests/e2e/vllm_servers.py): 2 layers, 2 KV heads of 32, float32, pages of 32.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 32, 32, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4 * HEAD_DIM,
    "intermediate_size": 8 * HEAD_DIM, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "vocab_size": 320, "bos_token_id": 256, "eos_token_id": 257,
}  # fmt: skip
PROMPT_TOKENS = 70  # three blocks, the last partial
PREEMPT_BLOCKS = 7  # the preemption case's pool: the null block and six (decode_preempted)
EOS = 257


class CheckFailed(AssertionError):
    pass


def check(cond: object, what: str, *detail: object) -> None:
    if not cond:
        raise CheckFailed(f"{what}: {detail}" if detail else what)


# ---------------------------------------------------------------------------------------- vLLM's objects
def model_dir() -> str:
    """A config-only checkpoint (no weights, no tokenizer: nothing here runs the model)."""
    path = Path(tempfile.mkdtemp(prefix="pdfabric-vllm-model-"))
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(path)


def vllm_config(model: str, kv_role: str, load_failure_policy: str = "fail") -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector="PdfabricConnector",
        kv_connector_module_path="pdfabric_vllm.connector",
        kv_role=kv_role,
        kv_load_failure_policy=load_failure_policy,
    )
    model_config = ModelConfig(model=model, dtype="float32", max_model_len=1024, seed=0, skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_model_len=1024, is_encoder_decoder=False, max_num_seqs=16, max_num_batched_tokens=256
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv,
    )


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One group of full-attention layers in one backing allocation, layer-outermost (vLLM's CPU
    layout, LBHNC): layer ``l``'s block ``b`` at ``l * layer_stride + b * block_stride``."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    page = spec.page_size_bytes
    backing = KVCacheTensor(
        size=page * num_blocks * LAYERS, layers=LAYER_NAMES, layer_stride=page * num_blocks, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[backing], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)]
    )


def scheduler(config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    config.cache_config.num_gpu_blocks = num_blocks  # what vLLM's engine core sets from the workers' profile
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


# vLLM's prefix-cache hashes, as its engine core sets them up (decode's local prefix hits need them).
init_none_hash(sha256)
BLOCK_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


def request(
    req_id: str,
    kv_transfer_params: dict[str, Any] | None,
    max_tokens: int = 4,
    first: int = 0,
    tokens: int = PROMPT_TOKENS,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    params.extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    prompt = [(first + i) % 250 for i in range(tokens)]
    return Request(
        request_id=req_id, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
        block_hasher=BLOCK_HASHER,
    )  # fmt: skip


def connector_of(sched: Scheduler) -> PdfabricConnector:
    conn = sched.get_kv_connector()
    check(isinstance(conn, PdfabricConnector), "vLLM's factory loaded pdfabric's connector", type(conn))
    assert isinstance(conn, PdfabricConnector)
    return conn


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(sched: Scheduler, req_id: str) -> list[int]:
    (ids,) = sched.kv_cache_manager.get_block_ids(req_id)
    return list(ids)


def metadata(out: SchedulerOutput) -> PdfabricMetadata:
    meta = out.kv_connector_metadata
    check(isinstance(meta, PdfabricMetadata), "the step's connector metadata is pdfabric's", type(meta))
    assert isinstance(meta, PdfabricMetadata)
    return meta


def runner_output(out: SchedulerOutput, kv: KVConnectorOutput | None = None, token: int = 7) -> ModelRunnerOutput:
    """What the model runner returns for ``out``: one sampled token per request that reached the end
    of its prompt (a partial prefill samples nothing), and the connector's output."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        new = [r for r in out.scheduled_new_reqs if r.req_id == req_id]
        done = (new[0].num_computed_tokens if new else 0) + out.num_scheduled_tokens[req_id]
        sampled.append([token] if not new or done >= len(new[0].prompt_token_ids or ()) else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )


def step(
    sched: Scheduler, kv: KVConnectorOutput | None = None, worker: KVConnectorBase_V1 | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step as vLLM's engine core and model runner run it: schedule; with a worker
    connector, bind the step's metadata, read ``get_finished`` and the load errors, clear; update."""
    out = sched.schedule()
    if worker is not None:
        assert out.kv_connector_metadata is not None
        worker.bind_connector_metadata(out.kv_connector_metadata)
        sending, recving = worker.get_finished(out.finished_req_ids)
        kv = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
        )
        worker.clear_connector_metadata()
    engine_outputs = sched.update_from_output(out, runner_output(out, kv))
    return out, [o for eo in engine_outputs.values() for o in eo.outputs]


def finished(outputs: list[EngineCoreOutput], req_id: str) -> EngineCoreOutput | None:
    return next((o for o in outputs if o.request_id == req_id and o.finish_reason is not None), None)


# ---------------------------------------------------------------------------------------- scenarios
def prefill_holds_blocks_until_sent(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill (``do_remote_decode``, max_tokens 1, as vLLM's router sends it): the request ends at
    its first token, the connector delays the free and answers the room; the send order names the
    prompt's blocks; vLLM frees them at ``finished_sending``. An aborted prefill frees at once."""
    sched = scheduler(vllm_config(model, "kv_producer"))
    conn = connector_of(sched)
    total = free_blocks(sched)
    sched.add_request(request("p-1", {"do_remote_decode": True}, max_tokens=1))
    out, outputs = step(sched)
    check(out.num_scheduled_tokens.get("p-1") == PROMPT_TOKENS, "prefill computes the prompt", out.num_scheduled_tokens)
    done = finished(outputs, "p-1")
    check(done is not None, "prefill ends after one token", outputs)
    assert done is not None
    params = done.kv_transfer_params
    check(params is not None and params.get("do_remote_prefill") is True, "prefill answers kv_transfer_params", params)
    assert params is not None
    remote = RemotePrefill.parse(params)
    check(remote.num_tokens == PROMPT_TOKENS, "the room holds the prompt's tokens", remote)
    held = block_ids(sched, "p-1")
    check(len(held) == 3 and free_blocks(sched) == total - 3, "vLLM holds the blocks (delay_free)", held)
    check(conn.has_pending_push_work(), "the connector asks vLLM to keep stepping while the room is held")
    out, _ = step(sched)
    sends = metadata(out).sends
    check(len(sends) == 1 and sends[0].req_id == "p-1", "the next step's metadata orders the send", sends)
    check(
        sends[0].room == remote.room and list(sends[0].pages) == held, "sent: the room, vLLM's blocks", sends[0], held
    )
    step(sched, KVConnectorOutput(finished_sending={"p-1"}))
    check(free_blocks(sched) == total, "finished_sending frees prefill's blocks", free_blocks(sched), total)
    check("p-1" not in sched.requests, "vLLM forgot the request")
    check(not conn.has_pending_push_work(), "nothing pending once sent")

    sched.add_request(request("p-abort", {"do_remote_decode": True}, max_tokens=1, first=100))
    sched.finish_requests("p-abort", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    check(not metadata(out).sends, "an aborted prefill sends nothing", metadata(out))
    check(free_blocks(sched) == total, "an aborted prefill holds nothing")
    return {"room_blocks": held, "kv_transfer_params": params}, params


def decode_receives(model: str, params: dict[str, Any]) -> dict[str, Any]:
    """Decode (``do_remote_prefill`` with prefill's answer): vLLM allocates the prompt's blocks and
    parks the request in WAITING_FOR_REMOTE_KVS; the receive order names those blocks; at
    ``finished_recving`` it runs from the matched tokens (the last prompt token recomputed)."""
    sched = scheduler(vllm_config(model, "kv_consumer"))
    conn = connector_of(sched)
    total = free_blocks(sched)
    req = request("d-1", dict(params))
    sched.add_request(req)
    out, _ = step(sched)
    check(req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "decode waits for its KV", req.status)
    check(not out.num_scheduled_tokens, "nothing computed while the KV is on its way", out.num_scheduled_tokens)
    got = block_ids(sched, "d-1")
    check(len(got) == 3 and free_blocks(sched) == total - 3, "vLLM allocated the prompt's blocks", got)
    receives = metadata(out).receives
    room = RemotePrefill.parse(params).room
    check(len(receives) == 1 and receives[0].room == room, "the metadata orders the receive", receives)
    check(list(receives[0].pages) == got and receives[0].prefix_tokens == 0, "into vLLM's blocks", receives[0], got)
    check(conn.has_pending_push_work(), "the connector keeps vLLM stepping while the KV moves")
    out, _ = step(sched)  # no news: still waiting
    check(req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "still waiting without finished_recving")
    out, outputs = step(sched, KVConnectorOutput(finished_recving={"d-1"}))
    check(not conn.has_pending_push_work(), "nothing pending once received")
    # vLLM promotes the request at the next schedule: the prompt's KV is there but its last token,
    # recomputed to sample the next one.
    out, outputs = step(sched)
    check(req.status == RequestStatus.RUNNING, "decode runs once received", req.status)
    check(out.num_scheduled_tokens.get("d-1") == 1, "only the last prompt token computed", out.num_scheduled_tokens)
    check(req.num_output_tokens == 1, "and a token sampled", req.output_token_ids)
    for _ in range(4):
        out, outputs = step(sched)
        if finished(outputs, "d-1"):
            break
    check(finished(outputs, "d-1") is not None and free_blocks(sched) == total, "decode ends, blocks freed")
    return {"blocks": got, "computed_after_receive": PROMPT_TOKENS - 1}


def decode_load_failure(model: str, params: dict[str, Any], policy: str) -> dict[str, Any]:
    """A receive that fails: the worker reports its pages as load errors (``invalid_block_ids``, as
    vLLM's runner collects ``get_block_ids_with_load_errors``) with the request in finished_recving.
    ``fail``: vLLM ends the request with an error and frees its blocks; ``recompute``: it computes
    the prompt here from the first bad block."""
    sched = scheduler(vllm_config(model, "kv_consumer", policy))
    total = free_blocks(sched)
    req = request(f"d-{policy}", dict(params))
    sched.add_request(req)
    out, _ = step(sched)
    (receive,) = metadata(out).receives
    bad = set(receive.pages[1:])  # the first page landed, the rest did not
    out, outputs = step(sched, KVConnectorOutput(finished_recving={req.request_id}, invalid_block_ids=bad))
    if policy == "fail":
        done = finished(outputs, req.request_id)
        check(done is not None, "fail policy: vLLM ends the request", outputs, req.status)
        assert done is not None
        check(req.status == RequestStatus.FINISHED_ERROR, "as an error", req.status)
        check(free_blocks(sched) == total, "and frees its blocks", free_blocks(sched), total)
        return {"policy": policy, "finish_reason": str(done.finish_reason), "status": req.status.name}
    out, _ = step(sched)
    check(req.status == RequestStatus.RUNNING, "recompute policy: the request runs", req.status)
    scheduled = out.num_scheduled_tokens.get(req.request_id)
    check(scheduled == PROMPT_TOKENS - BLOCK_SIZE, "from the first bad block", scheduled)
    return {"policy": policy, "recomputed_tokens": scheduled, "status": req.status.name}


def decode_aborts(model: str, params: dict[str, Any]) -> dict[str, Any]:
    """Aborted while its KV moves: vLLM keeps the blocks (the agent may still write them), the
    connector orders the abort, and the blocks are freed at the worker's finished_recving. Aborted
    before it was scheduled: the connector releases prefill's room, nothing was allocated."""
    sched = scheduler(vllm_config(model, "kv_consumer"))
    conn = connector_of(sched)
    total = free_blocks(sched)
    sched.add_request(request("d-abort", dict(params)))
    out, _ = step(sched)
    room = metadata(out).receives[0].room
    sched.finish_requests("d-abort", RequestStatus.FINISHED_ABORTED)
    check(free_blocks(sched) == total - 3, "vLLM holds an aborted receive's blocks until the worker is done")
    out, _ = step(sched)
    aborts = metadata(out).aborts
    check([(a.req_id, a.room) for a in aborts] == [("d-abort", room)], "the metadata orders the abort", aborts)
    step(sched, KVConnectorOutput(finished_recving={"d-abort"}))
    check(free_blocks(sched) == total, "freed once the worker reported it", free_blocks(sched), total)
    check(not conn.has_pending_push_work(), "nothing pending after the abort")

    sched.add_request(request("d-early", dict(params), first=50))
    sched.finish_requests("d-early", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    releases = metadata(out).releases
    check([(r.req_id, r.room) for r in releases] == [("d-early", room)], "a never-scheduled abort releases", releases)
    check(free_blocks(sched) == total, "and holds nothing")
    return {"abort_order": True, "release_order": True}


def decode_preempted(model: str) -> dict[str, Any]:
    """Preempted after its KV arrived: one transfer per request (the connector clears
    ``do_remote_prefill`` once it ordered the receive, as vLLM's NixlConnector does), so a decode
    request vLLM preempts recomputes its prompt when rescheduled (beyond what vLLM's prefix cache
    kept of it): the connector matches nothing, orders no second receive and no release or abort,
    vLLM frees and reallocates its blocks as any request's, and it finishes. Preempted by vLLM's own
    mechanics: a pool of 6 blocks (and the null block) that three requests of two blocks fill, so a
    running request's next block is not there and vLLM preempts the last running one. A request
    still waiting for its KV is not running, so not preempted: its blocks stay the receive's."""
    sched = scheduler(vllm_config(model, "kv_consumer"), PREEMPT_BLOCKS)
    conn = connector_of(sched)
    # What vLLM asks the connector and what it answers, per request (a spy on vLLM's calls).
    matched: list[tuple[str, int, tuple[int | None, bool]]] = []
    allocated: list[tuple[str, int]] = []
    answer, after_alloc = conn.get_num_new_matched_tokens, conn.update_state_after_alloc

    def spy_matched(req: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        got = answer(req, num_computed_tokens)
        matched.append((req.request_id, num_computed_tokens, got))
        return got

    def spy_alloc(req: Request, blocks: Any, num_external_tokens: int) -> None:
        allocated.append((req.request_id, num_external_tokens))
        after_alloc(req, blocks, num_external_tokens)

    conn.get_num_new_matched_tokens = spy_matched  # type: ignore[method-assign]
    conn.update_state_after_alloc = spy_alloc  # type: ignore[method-assign]
    orders: list[PdfabricMetadata] = []
    outputs: list[EngineCoreOutput] = []

    def run(kv: KVConnectorOutput | None = None) -> SchedulerOutput:
        out, step_outputs = step(sched, kv)
        orders.append(metadata(out))
        outputs.extend(step_outputs)
        return out

    total = free_blocks(sched)
    check(total == 2 * 3, "a pool of six blocks", total)
    prompt = 40  # two blocks, the second with room for 24 more tokens
    # A local request that reaches its third block at its fifth token (prompt 60: block 2 ends at 64).
    local = request("c-local", None, max_tokens=8, first=150, tokens=60)
    running = request("d-run", RemotePrefill(1001, 0, 0, prompt).to_params(), max_tokens=6, tokens=prompt)
    waiting = request("d-wait", RemotePrefill(1002, 0, 0, prompt).to_params(), max_tokens=2, first=100, tokens=prompt)
    for req in (local, running, waiting):
        sched.add_request(req)
    out = run()
    check(out.num_scheduled_tokens == {"c-local": 60}, "the local prompt computed", out.num_scheduled_tokens)
    for req in (running, waiting):
        check(req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "decode waits for its KV", req.request_id, req.status)
    run_blocks, wait_blocks = block_ids(sched, "d-run"), block_ids(sched, "d-wait")
    check(
        [(r.req_id, r.room, list(r.pages)) for r in orders[-1].receives]
        == [("d-run", 1001, run_blocks), ("d-wait", 1002, wait_blocks)],
        "each receive ordered into vLLM's blocks",
        orders[-1].receives,
    )
    check(free_blocks(sched) == 0, "the pool is full", free_blocks(sched))
    run(KVConnectorOutput(finished_recving={"d-run"}))
    out = run()
    check(running.status == RequestStatus.RUNNING, "d-run runs from its KV", running.status)
    check(out.num_scheduled_tokens.get("d-run") == 1, "its last prompt token", out.num_scheduled_tokens)
    # Decode until the local request needs a block: vLLM preempts the last running request, d-run.
    preempted_at = None
    for _ in range(8):
        before = block_ids(sched, "c-local")
        out = run()
        if running.status != RequestStatus.RUNNING:
            preempted_at = len(orders)
            break
    check(preempted_at is not None, "vLLM preempted d-run", running.status)
    check(running.status == RequestStatus.PREEMPTED and running.num_preemptions == 1, "preempted", running.status)
    check(running.num_computed_tokens == 0, "preemption resets its computed tokens", running.num_computed_tokens)
    check("d-run" in (out.preempted_req_ids or ()), "vLLM tells the workers", out.preempted_req_ids)
    check(out.num_scheduled_tokens == {"c-local": 1}, "the local request goes on", out.num_scheduled_tokens)
    grown = block_ids(sched, "c-local")
    check(grown[:-1] == before and grown[-1] in run_blocks, "with a block of d-run's", before, grown, run_blocks)
    check(free_blocks(sched) == 1, "d-run's other block free (its prefix cached)", free_blocks(sched))
    check(waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "d-wait is not preempted", waiting.status)
    check(block_ids(sched, "d-wait") == wait_blocks, "its receive's blocks stay put", block_ids(sched, "d-wait"))
    # d-wait's KV lands in those blocks; everything runs to its end.
    run(KVConnectorOutput(finished_recving={"d-wait"}))
    resumed: dict[str, Any] = {}
    for _ in range(24):
        tokens_before, wait_started = running.num_tokens, waiting.num_computed_tokens > 0
        out = run()
        if "d-wait" in out.num_scheduled_tokens and not wait_started:
            check(out.num_scheduled_tokens["d-wait"] == 1, "d-wait runs from its KV", out.num_scheduled_tokens)
            check(block_ids(sched, "d-wait")[:2] == wait_blocks, "in its receive's blocks", block_ids(sched, "d-wait"))
        if "d-run" in out.num_scheduled_tokens and not resumed:
            resumed = {"tokens": tokens_before, "scheduled": out.num_scheduled_tokens["d-run"]}
            resumed["blocks"] = block_ids(sched, "d-run")
        if not sched.requests:
            break
    receives = [(r.req_id, r.room) for m in orders for r in m.receives]
    check(receives == [("d-run", 1001), ("d-wait", 1002)], "one receive per request, no second", receives)
    check(not any(m.releases or m.aborts for m in orders), "no release, no abort", orders)
    done = {o.request_id: str(o.finish_reason) for o in outputs if o.finish_reason is not None}
    check(sorted(done) == ["c-local", "d-run", "d-wait"], "all three finish", done, sched.requests.keys())
    check(running.num_output_tokens == 6, "d-run gave its 6 tokens", running.output_token_ids)
    check(free_blocks(sched) == total, "every block back", free_blocks(sched), total)
    check(not conn.has_pending_push_work(), "nothing pending")
    # What the connector was asked and ordered.
    asked = [(n, got) for req_id, n, got in matched if req_id == "d-run"]
    check(len(asked) >= 2 and asked[0] == (0, (prompt, True)), "d-run's KV matched remotely once", asked)
    hit, again = asked[-1]
    check(again == (0, False), "rescheduled, it matches nothing remote", asked)
    check(resumed and resumed["scheduled"] == resumed["tokens"] - hit, "it computes all but its local prefix", resumed)
    check(resumed["scheduled"] > 1, "more than a receive would leave it", resumed)
    kept = hit // BLOCK_SIZE
    check(resumed["blocks"][:kept] == run_blocks[:kept], "its prefix from its own cached blocks", resumed, run_blocks)
    return {
        "preempted": "d-run", "preempted_at_step": preempted_at, "receives": len(receives),
        "local_prefix_hit": hit, "resumed_tokens": resumed["tokens"], "recomputed_tokens": resumed["scheduled"],
        "blocks_before": run_blocks, "blocks_after": resumed["blocks"],
        "matched": asked, "update_state_after_alloc": [n for req_id, n in allocated if req_id == "d-run"],
        "waiting_blocks_kept": wait_blocks, "finish": done,
    }  # fmt: skip


def sleep_mode_refused(model: str) -> str:
    """vLLM 0.33 asks the connector whether it follows sleep mode's KV cache remap (it does not:
    its agent registration would go stale) and refuses the server; 0.32 does not ask."""
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        return "not asked"
    kv = KVTransferConfig(
        kv_connector="PdfabricConnector", kv_connector_module_path="pdfabric_vllm.connector", kv_role="kv_consumer"
    )
    check(not KVConnectorFactory.get_connector_class(kv).supports_sleep_mode(kv), "sleep mode refused")
    return "refused"


# ---------------------------------------------------------------------------------------- worker side
@contextlib.contextmanager
def one_rank_world(config: VllmConfig) -> Iterator[None]:
    """vLLM's process groups of a TP 1 worker (gloo), which the connector asks for its rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_connector(config: VllmConfig, agents: dict[str, Any], role: str) -> tuple[KVConnectorBase_V1, Any]:
    """The connector vLLM's worker builds (its factory, the worker role), its KV cache allocated in
    the connector's memory pool context as vLLM's runner does, per-layer views of the backing
    buffer laid out as the KV cache config says, registered with the rank's agent."""
    rank = agents["ranks"][role]
    os.environ.update({
        "PDFABRIC_AGENT_ADDRESS": rank["address"], "PDFABRIC_RANK": rank["rank"], "PDFABRIC_REPLICA": "0",
        "PDFABRIC_ENGINE_TOKEN_FILE": agents["token_file"], "PDFABRIC_SHM_DIR": agents["shm_dir"],
    })  # fmt: skip
    cache_config = kv_cache_config()
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, cache_config)
    check(isinstance(conn, PdfabricConnector) and conn.worker is not None, "a worker-role pdfabric connector", conn)
    (backing,) = cache_config.kv_cache_tensors
    with conn.get_mem_pool_context() or contextlib.nullcontext():
        # As vLLM's runner allocates it: the device named (the pool context redirects only that).
        raw = torch.zeros(backing.size, dtype=torch.int8, device=config.device_config.device)
    page_floats = backing.block_stride // 4
    views = {
        name: raw.view(torch.float32)[i * backing.layer_stride // 4 : (i + 1) * backing.layer_stride // 4]
        .view(NUM_BLOCKS, page_floats)
        .view(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
        for i, name in enumerate(backing.layers)
    }
    conn.register_kv_caches(views)
    return conn, raw


def page_bytes(raw: torch.Tensor, blocks: list[int]) -> list[bytes]:
    """Each layer's bytes of ``blocks``, in order."""
    page = len(raw) // (LAYERS * NUM_BLOCKS)
    layers = raw.view(LAYERS, NUM_BLOCKS, page)
    return [layers[layer, block].numpy().tobytes() for layer in range(LAYERS) for block in blocks]


def worker_moves_a_room(model: str, agents: dict[str, Any]) -> dict[str, Any]:
    """Both roles end to end through vLLM's schedulers and pdfabric's worker connectors on real
    agents: prefill's prompt KV lands in decode's blocks (other ids than prefill's), byte-exact, and
    decode runs from it; prefill's blocks are freed once the send ended."""
    p_conf, d_conf = vllm_config(model, "kv_producer"), vllm_config(model, "kv_consumer")
    p_sched, d_sched = scheduler(p_conf), scheduler(d_conf)
    started = time.monotonic()
    with one_rank_world(p_conf):
        p_worker, p_raw = worker_connector(p_conf, agents, "prefill")
        d_worker, d_raw = worker_connector(d_conf, agents, "decode")
        registered = time.monotonic()
        try:
            gen = torch.Generator().manual_seed(11)
            p_raw.copy_(torch.randint(-128, 128, p_raw.shape, dtype=torch.int8, generator=gen))
            d_raw.fill_(-91)  # 0xA5: what is not addressed must still read it
            p_total, d_total = free_blocks(p_sched), free_blocks(d_sched)
            # Decode computes another prompt first, so the room lands in other block ids than prefill's.
            d_sched.add_request(request("d-local", None, max_tokens=1, first=200))
            step(d_sched, worker=d_worker)
            p_sched.add_request(request("p-w", {"do_remote_decode": True}, max_tokens=1))
            _, outputs = step(p_sched, worker=p_worker)
            done = finished(outputs, "p-w")
            check(done is not None and done.kv_transfer_params, "prefill answered its room", outputs)
            assert done is not None and done.kv_transfer_params is not None
            p_blocks = block_ids(p_sched, "p-w")
            req = request("d-w", dict(done.kv_transfer_params))
            d_sched.add_request(req)
            d_blocks: list[int] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (req.status != RequestStatus.RUNNING or "p-w" in p_sched.requests):
                step(p_sched, worker=p_worker)
                step(d_sched, worker=d_worker)
                if not d_blocks and "d-w" in d_sched.requests:
                    d_blocks = block_ids(d_sched, "d-w")
                time.sleep(0.002)
            moved = time.monotonic()
            check(req.status == RequestStatus.RUNNING, "decode runs once its KV landed", req.status)
            check(req.num_computed_tokens >= PROMPT_TOKENS, "from the received prompt", req.num_computed_tokens)
            check("p-w" not in p_sched.requests and free_blocks(p_sched) == p_total, "prefill's blocks freed")
            check(
                len(d_blocks) == 3 and d_blocks != p_blocks, "decode's block ids are not prefill's", p_blocks, d_blocks
            )
            check(page_bytes(d_raw, d_blocks) == page_bytes(p_raw, p_blocks), "decode's blocks hold prefill's KV")
            others = [b for b in range(NUM_BLOCKS) if b not in d_blocks]
            check(bool((d_raw.view(LAYERS, NUM_BLOCKS, -1)[:, others] == -91).all()), "nothing else was written")
            for _ in range(8):
                _, outputs = step(d_sched, worker=d_worker)
                if finished(outputs, "d-w"):
                    break
            check(free_blocks(d_sched) == d_total, "decode ends, its blocks freed", free_blocks(d_sched), d_total)
        finally:
            p_worker.shutdown()
            d_worker.shutdown()
    return {
        "prefill_blocks": p_blocks, "decode_blocks": d_blocks, "byte_exact": True,
        "kv_bytes": len(b"".join(page_bytes(d_raw, d_blocks))),
        "register_seconds": round(registered - started, 2), "move_seconds": round(moved - registered, 2),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", help="a JSON file naming the agents (the worker side runs when given)")
    args = parser.parse_args()
    started = time.monotonic()
    model = model_dir()
    report: dict[str, Any] = {"vllm": vllm.__version__, "vllm_path": os.path.dirname(vllm.__file__)}
    # Decode's requests carry what prefill answered, as vLLM's router passes it on.
    report["prefill"], params = prefill_holds_blocks_until_sent(model)
    report["decode"] = decode_receives(model, params)
    report["load_failure"] = [decode_load_failure(model, params, policy) for policy in ("fail", "recompute")]
    report["abort"] = decode_aborts(model, params)
    report["preemption"] = decode_preempted(model)
    report["sleep_mode"] = sleep_mode_refused(model)
    report["scheduler_seconds"] = round(time.monotonic() - started, 2)
    if args.agents:
        report["worker"] = worker_moves_a_room(model, json.loads(Path(args.agents).read_text()))
    report["ok"] = True
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
