"""How the agent hands a room to a backend with a kernel path (no GPU): the KV as page lists in
one call, the rest as whole block lists, the engine's 1024-block chunking only when the engine
moves the data, and bytes counted under the path that moved them. Also the INTRA_NODE_NVLINK
start-up check."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdfabric_agent.memory.pools import PoolLayout, RankPools
from pdfabric_agent.node.hardware import Hardware
from pdfabric_agent.node.transport import TransportChoice, TransportError
from pdfabric_agent.process.main import INTRA_NODE_NVLINK_ONE_GPU, check_mem_pool
from pdfabric_agent.protocol.peer_wire import RoomInfo
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.protocol.wire import SendRequest
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.targets import DecodeFailed
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Transport
from pdfabric_core.rankmap import Rank
from pdfabric_core.spec import parse_spec
from tests.unit.agents import Backend, dst_map, kernel_agent, record_posts, run_room

KV_BYTES = 40 * 4 * 2 * 128  # pages x layers x K,V x page bytes (2 heads x 2 tokens x 8 x 4 B)


def test_kernel_backend_gets_the_kv_as_page_lists_in_one_call(tmp_path: Path) -> None:
    pages = list(range(64))[::-1][:40]  # scattered enough that nothing coalesces
    backend = Backend(kernel=True, takes=True)
    sent, room = run_room(tmp_path, backend, pages)
    # KV: one call with every layer and K/V; state (2 layers) and aux (2 items) one call each.
    assert backend.calls == [("pages", 4 * 2 * 40), ("blocks", 2), ("blocks", 2)]
    assert sent["bytes_by_path"] == {"nvlink-kernel": {"kv": KV_BYTES, "state": 64, "aux": 24}}
    assert room.moved == {"kv": KV_BYTES, "state": 64, "aux": 24}


def test_kernel_declining_falls_back_to_chunked_engine_batches(tmp_path: Path) -> None:
    pages = list(range(64))[::-1][:40]
    backend = Backend(kernel=True, takes=False)
    sent, room = run_room(tmp_path, backend, pages)
    # 320 per-page blocks through the engine in batches of transfer.maxBatchEntries (16).
    engine = [n for what, n in backend.calls if what == "engine"]
    assert backend.calls[0] == ("pages", 320)
    assert engine[:20] == [16] * 20 and sum(engine) == 320 + 2 + 2
    # Counted under the engine's label, not the kernel's, though the backend is the wrapper.
    assert sent["bytes_by_path"] == {"mooncake": {"kv": KV_BYTES, "state": 64, "aux": 24}}
    assert room.moved == {"kv": KV_BYTES, "state": 64, "aux": 24}


def test_launches_back_to_back_then_one_wait(tmp_path: Path) -> None:
    pages = list(range(64))[::-1][:40]
    backend = Backend(kernel=True, takes=True, launch=True)
    sent, room = run_room(tmp_path, backend, pages)
    assert backend.calls == [
        ("submit_pages", 320),
        ("submit_blocks", 2),
        ("submit_blocks", 2),
        ("wait", 320),
        ("wait", 2),
        ("wait", 2),
    ]
    assert sent["bytes_by_path"] == {"nvlink-kernel": {"kv": KV_BYTES, "state": 64, "aux": 24}}
    assert room.moved == {"kv": KV_BYTES, "state": 64, "aux": 24}


def test_marks_go_to_the_decode_agent_while_the_kernels_run_and_the_done_report_confirms(tmp_path: Path) -> None:
    backend = Backend(kernel=True, takes=True, launch=True, marks=True)
    posts: list[tuple[str, dict[str, Any]]] = []
    _, room = run_room(tmp_path, backend, list(range(64))[::-1][:40], posts)
    # Marks are taken after the launches and before the wait: the notice travels while kernels run.
    assert backend.calls == [
        ("submit_pages", 320),
        ("submit_blocks", 2),
        ("submit_blocks", 2),
        ("mark", 320),
        ("mark", 2),
        ("mark", 2),
        ("wait", 320),
        ("wait", 2),
        ("wait", 2),
    ]
    # The notice travels while the kernels run; the done report after they landed is only the
    # confirmation that gives the room decode's outcome (decode learned completion from the board).
    assert [p for p, _ in posts] == ["/v1/peer/launched", "/v1/peer/done"]
    body = posts[0][1]
    assert body["marks"] == [{"board": "pdfabric-board-00000000abcd", "slot": 3, "seq": s} for s in (420, 102, 102)]
    assert body["bytes_by_path"] == {"nvlink-kernel": {"kv": KV_BYTES, "state": 64, "aux": 24}}
    assert (body["decode_rank"], body["prefill_rank"], body["room"]) == ("decode-0-tp0", "prefill-0-tp0-cp0", 1)
    assert room.moved == {"kv": KV_BYTES, "state": 64, "aux": 24}
    assert room.targets["decode-0-tp0"].done
    assert {"written:decode-0-tp0", "notified:decode-0-tp0", "acknowledged:decode-0-tp0"} <= set(room.marks)


def test_refused_marks_fall_back_to_the_done_report(tmp_path: Path) -> None:
    backend = Backend(kernel=True, takes=True, launch=True, marks=True)
    posts: list[tuple[str, dict[str, Any]]] = []
    sent, room = run_room(tmp_path, backend, list(range(64))[::-1][:40], posts, refuse="/v1/peer/launched")
    assert [p for p, _ in posts] == ["/v1/peer/launched", "/v1/peer/done"]
    assert sent["ok"] and sent["bytes_by_path"] == {"nvlink-kernel": {"kv": KV_BYTES, "state": 64, "aux": 24}}
    assert room.targets["decode-0-tp0"].done and "notified:decode-0-tp0" not in room.marks


def test_no_marks_when_part_of_the_room_takes_the_engine(tmp_path: Path) -> None:
    # The kernel refuses the launch: the engine moves the room, the done report says so.
    backend = Backend(kernel=True, takes=False, launch=True, marks=True)
    posts: list[tuple[str, dict[str, Any]]] = []
    run_room(tmp_path, backend, list(range(64))[::-1][:40], posts)
    assert [p for p, _ in posts] == ["/v1/peer/done"]
    assert not any(what == "mark" for what, _ in backend.calls)


def test_launch_declined_goes_the_usual_way(tmp_path: Path) -> None:
    backend = Backend(kernel=True, takes=False, launch=True)
    sent, _ = run_room(tmp_path, backend, list(range(64))[::-1][:40])
    assert backend.calls[:4] == [("submit_pages", 320), ("submit_blocks", 2), ("submit_blocks", 2), ("pages", 320)]
    assert sent["bytes_by_path"] == {"mooncake": {"kv": KV_BYTES, "state": 64, "aux": 24}}


def test_refused_launch_still_waits_for_and_counts_what_was_launched(tmp_path: Path) -> None:
    backend = Backend(kernel=True, takes=True, launch=True, refuse_aux=True)
    with pytest.raises(Exception, match="in flight"):
        run_room(tmp_path, backend, list(range(40)))
    assert backend.calls == [("submit_pages", 320), ("submit_blocks", 2), ("wait", 320), ("wait", 2)]


def test_decode_answering_failed_fails_the_room_without_blaming_the_peer(tmp_path: Path) -> None:
    """Decode's deadline passed while this source was still writing: its answer to the done report
    is Failed, so the prefill side fails too (one outcome) and the healthy decode agent stays admitted."""
    backend = Backend(kernel=False, takes=False)
    seen: list[Agent] = []
    with pytest.raises(DecodeFailed, match="reports room 1 Failed: no data"):
        run_room(tmp_path, backend, list(range(40)), answer={"state": "Failed", "reason": "no data in time"}, seen=seen)
    assert not seen[0].peers.is_blacklisted("a2")


def test_engine_only_backend_gets_coalesced_blocks(tmp_path: Path) -> None:
    backend = Backend(kernel=False, takes=False)
    sent, _ = run_room(tmp_path, backend, list(range(40)))
    # One run per layer and K/V, and the state and aux blocks in the same engine batch.
    assert backend.calls == [("engine", 8 + 2 + 2)]
    assert sent["bytes_by_path"] == {"mooncake": {"kv": KV_BYTES, "state": 64, "aux": 24}}


def spec_for(pool: str, fallback: str = "Fail") -> Any:
    return parse_spec({"transfer": {"memPool": pool}, "placement": {"fallback": fallback}})


def test_intra_node_nvlink_with_one_visible_gpu_is_a_startup_error() -> None:
    choice = TransportChoice(Transport.NVLINK_INTRA)
    with pytest.raises(TransportError) as err:
        check_mem_pool(spec_for("INTRA_NODE_NVLINK"), Hardware(gpus=1), choice, {"CUDA_VISIBLE_DEVICES": "3"})
    assert err.value.reason == INTRA_NODE_NVLINK_ONE_GPU
    assert "sees 1 GPU(s)" in str(err.value) and "'3'" in str(err.value)
    # Enough GPUs, or another pool: unchanged.
    assert check_mem_pool(spec_for("INTRA_NODE_NVLINK"), Hardware(gpus=2), choice, {}) is choice
    assert check_mem_pool(spec_for("NONE"), Hardware(gpus=1), choice, {}) is choice


def test_intra_node_nvlink_on_one_gpu_works_when_every_rank_of_the_node_is_on_it() -> None:
    """Prefill and decode on the one GPU of a node: CUDA IPC between processes of one device, no
    peer GPU to see; ranks on two GPUs with one visible stay an error."""
    choice = TransportChoice(Transport.NVLINK_INTRA)
    spec = spec_for("INTRA_NODE_NVLINK")
    assert check_mem_pool(spec, Hardware(gpus=1), choice, {}, rank_gpus=[0, 0, 0]) is choice
    with pytest.raises(TransportError):
        check_mem_pool(spec, Hardware(gpus=1), choice, {}, rank_gpus=[0, 1])
    with pytest.raises(TransportError):
        check_mem_pool(spec, Hardware(gpus=1), choice, {}, rank_gpus=[1])  # a GPU it does not see


def test_intra_node_nvlink_with_one_gpu_falls_back_when_the_spec_says_so() -> None:
    choice = TransportChoice(Transport.NVLINK_INTRA)
    got = check_mem_pool(spec_for("INTRA_NODE_NVLINK", "TCP"), Hardware(gpus=1), choice, {})
    assert got.transport is Transport.TCP and got.fell_back_from is Transport.NVLINK_INTRA
    assert INTRA_NODE_NVLINK_ONE_GPU in got.note


def test_ready_room_is_launched_inside_the_call_that_made_it_ready(tmp_path: Path) -> None:
    """Decode's room info first, then `send`: the kernels are launched before `send` answers (the
    GPU starts at once); the task after it only waits, and the room ends Success."""
    agent = kernel_agent(tmp_path)
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=64, state_slots=2, aux_slots=2)
    pool = SimpleNamespace(addr=0x1000_0000)
    backend = Backend(kernel=True, takes=True, launch=True, marks=True)
    agent.ranks["prefill-0-tp0-cp0"] = LocalRank(Rank("prefill", 0, 0), backend, RankPools(layout, pool, pool, pool))  # type: ignore[arg-type]
    recorded: list[tuple[str, dict[str, Any]]] = []
    record_posts(agent, recorded)
    pages = list(range(64))[::-1][:40]

    async def go() -> None:
        try:
            agent.accept_dst(RoomInfo.parse(
                {"cluster": "uid-1", "prefill_rank": "prefill-0-tp0-cp0", "decode_rank": "decode-0-tp0", "room": 5,
                 "endpoint": "peer:1", "layout": layout.to_dict(),
                 "bases": dst_map(layout),
                 "kv_pages": list(range(40)), "state_indices": [1], "aux_index": 1}
            ))  # fmt: skip
            view = agent.submit_send(SendRequest.parse(
                {"cluster": "uid-1", "rank": "prefill-0-tp0-cp0", "room": 5, "kv_pages": pages,
                 "state_indices": [0], "aux_index": 0, "decode_replica": 0}
            ))  # fmt: skip
            assert view.state is RoomState.TRANSFERRING
            assert [what for what, _ in backend.calls] == ["submit_pages", "submit_blocks", "submit_blocks"] + [
                "mark"
            ] * 3  # launched (and marked) before `send` answered; nothing waited for yet
            final = await agent.poll("prefill-0-tp0-cp0", 5, wait_s=5)
            assert final.state is RoomState.SUCCESS, final
            assert [what for what, _ in backend.calls][-3:] == ["wait"] * 3
            assert [path for path, _ in recorded] == ["/v1/peer/launched", "/v1/peer/done"]
            assert final.moved == {"kv": KV_BYTES, "state": 64, "aux": 24}
        finally:
            await agent.close()

    asyncio.run(go())
