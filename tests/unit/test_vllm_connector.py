"""The vLLM connector's own logic, without vLLM (its real servers run it in
tests/e2e/test_vllm_servers.py): what a request's kv_transfer_params say (``params``), which
orders the scheduler side gives for vLLM's calls (``scheduler``), and how vLLM's KV cache is
registered (``memory``: one fused K and V buffer per layer, in shared memory on CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pdfabric_vllm.memory import page_order, registration
from pdfabric_vllm.orders import ReceiveOrder, ReleaseOrder, SendOrder
from pdfabric_vllm.params import ParamsError, RemotePrefill
from pdfabric_vllm.scheduler import SchedulerSide

from pdfabric_agent.client.shares import UnshareableBuffer
from pdfabric_agent.client.shm import shared_cpu_allocations
from pdfabric_agent.memory.pools import PageOrder
from pdfabric_agent.protocol.memory_registration import MemoryRegistration
from pdfabric_agent.protocol.wire import ShareKind
from pdfabric_core.policy.types import Role

BLOCK = 32


def request(req_id: str, prompt: int, params: dict[str, Any] | None, status: str = "RUNNING", computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=list(range(prompt)), kv_transfer_params=params,
        status=SimpleNamespace(name=status), num_computed_tokens=computed,
    )  # fmt: skip


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_the_params_round_trip_and_say_what_is_missing() -> None:
    remote = RemotePrefill(room=(1 << 63) - 1, prefill_replica=3, prefill_dp=1, num_tokens=700)
    params = remote.to_params()
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == 700
    assert RemotePrefill.parse(params) == remote
    with pytest.raises(ParamsError, match="no 'pdfabric' object"):
        RemotePrefill.parse({"do_remote_prefill": True, "remote_block_ids": [1]})  # NixlConnector's
    with pytest.raises(ParamsError, match="room must be an integer"):
        RemotePrefill.parse({"pdfabric": {**params["pdfabric"], "room": -1}})
    with pytest.raises(ParamsError, match="prefill_replica"):
        RemotePrefill.parse({"pdfabric": {**params["pdfabric"], "prefill_replica": "0"}})


def test_prefill_holds_the_prompt_pages_of_a_finished_request_and_names_its_room() -> None:
    side = SchedulerSide(Role.PREFILL, 2, 0, BLOCK)
    req = request("a", 70, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED", computed=70)
    delay, params = side.request_finished(req, [5, 6, 7])
    assert delay and params is not None
    remote = RemotePrefill.parse(params)
    assert (remote.prefill_replica, remote.num_tokens) == (2, 70)
    (send,) = side.build_connector_meta(None).sends
    assert send == SendOrder("a", remote.room, (5, 6, 7), BLOCK) and side.has_pending_push_work()
    side.update_connector_output(SimpleNamespace(finished_sending={"a"}, finished_recving=None))
    assert not side.has_pending_push_work() and not side.build_connector_meta(None)
    # A prompt of 64 tokens fills two pages; a third, begun by the sampled token, is not sent.
    delay, params = side.request_finished(
        request("b", 64, {"do_remote_decode": True}, "FINISHED_STOPPED", 65), [1, 2, 3]
    )
    assert delay and side.build_connector_meta(None).sends[0].pages == (1, 2)


@pytest.mark.parametrize(
    ("params", "status", "pages"),
    [
        ({"do_remote_decode": True}, "FINISHED_ABORTED", [1]),  # aborted: nothing to hand over
        ({"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED", []),  # nothing computed
        (None, "FINISHED_LENGTH_CAPPED", [1]),  # an ordinary request
    ],
)
def test_prefill_frees_at_once_what_it_does_not_hand_over(params: Any, status: str, pages: list[int]) -> None:
    side = SchedulerSide(Role.PREFILL, 0, 0, BLOCK)
    assert side.request_finished(request("a", 40, params, status, 40), pages) == (False, None)
    assert not side.build_connector_meta(None) and not side.has_pending_push_work()


def test_decode_loads_the_prompt_after_its_own_prefix_asynchronously() -> None:
    side = SchedulerSide(Role.DECODE, 0, 0, BLOCK)
    params = RemotePrefill(room=77, prefill_replica=1, prefill_dp=0, num_tokens=100).to_params()
    req = request("d", 100, params)
    assert side.get_num_new_matched_tokens(req, 32) == (68, True)  # one page from its prefix cache
    side.update_state_after_alloc(req, blocks([9, 4, 8, 2]), 68)
    (recv,) = side.build_connector_meta(None).receives
    assert recv == ReceiveOrder("d", 77, 1, 0, (4, 8, 2), 32)
    assert params["do_remote_prefill"] is False and side.has_pending_push_work()
    side.update_state_after_alloc(req, blocks([9, 4, 8, 2, 6]), 0)  # vLLM's second call: nothing new
    assert not side.build_connector_meta(None)
    # Aborted while its KV is on its way: the room is given up; vLLM holds the pages meanwhile.
    assert side.request_finished(req, [9, 4, 8, 2]) == (False, None)
    (abort,) = side.build_connector_meta(None).aborts
    assert abort.room == 77


def test_decode_releases_what_it_will_not_receive() -> None:
    side = SchedulerSide(Role.DECODE, 0, 0, BLOCK)
    remote = RemotePrefill(room=5, prefill_replica=0, prefill_dp=0, num_tokens=64)
    whole = request("w", 64, remote.to_params())
    assert side.get_num_new_matched_tokens(whole, 64) == (0, False)  # the prompt is all cached here
    side.update_state_after_alloc(whole, blocks([1, 2]), 0)
    early = request("e", 64, RemotePrefill(6, 0, 0, 64).to_params())
    assert side.request_finished(early, []) == (False, None)  # aborted before it was scheduled
    releases = side.build_connector_meta(None).releases
    assert [(r.room, r.req_id) for r in releases] == [(5, "w"), (6, "e")]
    assert all(isinstance(r, ReleaseOrder) and r.reason for r in releases)


def test_decode_computes_a_prompt_whose_params_name_no_room() -> None:
    side = SchedulerSide(Role.DECODE, 0, 0, BLOCK)
    assert side.get_num_new_matched_tokens(request("n", 10, {"do_remote_prefill": True}), 0) == (0, False)
    assert "no 'pdfabric' object" in side.refused["n"]
    assert side.get_num_new_matched_tokens(request("p", 10, None), 0) == (0, False)


def layer_views(
    raw: torch.Tensor, layers: int, blocks_: int, heads: int, tokens: int, content: int
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of one backing buffer, layer-compact (LBHNC)."""
    per_layer = blocks_ * heads * tokens * content
    flat = raw.view(torch.float32)
    return {
        f"layers.{i}.attn": flat[i * per_layer : (i + 1) * per_layer].view(blocks_, heads, tokens, content)
        for i in range(layers)
    }


def test_vllms_cache_registers_as_one_fused_buffer_per_layer(tmp_path: Path) -> None:
    with shared_cpu_allocations(str(tmp_path)):
        raw = torch.zeros(2 * 8 * 2 * BLOCK * 64 * 4, dtype=torch.int8, device="cpu")
    views = layer_views(raw, 2, 8, 2, BLOCK, 64)
    reg = registration("decode-0-tp0", views, None)
    page = 2 * BLOCK * 64 * 4
    assert (reg.page_order, reg.page_tokens, reg.kv_page_bytes, reg.k, reg.v) == (
        PageOrder.HEAD_MAJOR,
        BLOCK,
        page,
        [],
        [],
    )
    assert [(s.kind, s.nbytes, s.offset) for s in reg.fused] == [
        (ShareKind.SHM, 8 * page, 0),
        (ShareKind.SHM, 8 * page, 8 * page),
    ]
    assert MemoryRegistration.parse(reg.to_json()) == reg
    # Token-major views ([blocks, tokens, heads, K|V] in memory) register as such.
    token_major = {k: v.view(8, BLOCK, 2, 64).permute(0, 2, 1, 3) for k, v in views.items()}
    assert page_order(next(iter(token_major.values()))) is PageOrder.TOKEN_MAJOR


def test_what_the_agent_cannot_take_is_refused_by_name(tmp_path: Path) -> None:
    private = {"l0": torch.zeros(4, 2, BLOCK, 64), "l1": torch.zeros(4, 2, BLOCK, 64)}
    with pytest.raises(UnshareableBuffer, match="private memory"):
        registration("decode-0-tp0", private, None)
    with shared_cpu_allocations(str(tmp_path)):
        raw = torch.zeros(8 * 2 * 2 * BLOCK * 64, dtype=torch.float32, device="cpu")
    # Block-outermost: [blocks, layers, heads, tokens, K|V]; a layer's pages are not contiguous.
    outer = raw.view(8, 2, 2, BLOCK, 64)
    with pytest.raises(UnshareableBuffer, match="block-outermost"):
        registration("decode-0-tp0", {"l0": outer[:, 0], "l1": outer[:, 1]}, None)
    shared = layer_views(raw.view(torch.int8), 1, 16, 2, BLOCK, 64)["layers.0.attn"]
    with pytest.raises(UnshareableBuffer, match="cross-layer"):
        registration("decode-0-tp0", {"l0": shared, "l1": shared}, None)
    with pytest.raises(UnshareableBuffer, match="one page geometry"):
        registration("decode-0-tp0", {"l0": shared, "l1": shared[:, :1].contiguous()}, None)


def test_the_stats_add_up_over_workers_and_intervals() -> None:
    from pdfabric_vllm import stats

    a, b = stats.empty(), stats.empty()
    assert stats.is_empty(a)
    stats.record(a, failed=False, kv_bytes=1_000_000, seconds=0.010)
    stats.record(b, failed=True, kv_bytes=0, seconds=0.030)
    stats.record(b, failed=False, kv_bytes=500_000, seconds=0.020)
    merged = stats.merge(a, b)
    assert (merged["rooms"], merged["failed_rooms"], merged["kv_bytes"]) == (3, 1, 1_500_000)
    assert stats.reduce(merged) == {
        "Rooms": 3, "Failed rooms": 1, "KV MB moved": 1.5, "Avg room ms": 20.0, "P90 room ms": 30.0,
    }  # fmt: skip
    assert stats.reduce(stats.empty())["Avg room ms"] == 0.0
