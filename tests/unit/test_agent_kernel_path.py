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

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Bases, MemoryMap
from pdfabric_agent.memory.pools import PoolLayout, RankPools
from pdfabric_agent.node.hardware import Hardware
from pdfabric_agent.node.transport import TransportChoice, TransportError
from pdfabric_agent.peers.client import PeerRefused
from pdfabric_agent.process.main import INTRA_NODE_NVLINK_ONE_GPU, check_mem_pool
from pdfabric_agent.protocol.peer_wire import PeerMessage, RoomInfo
from pdfabric_agent.protocol.wire import SendRequest
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.agent import Agent
from pdfabric_agent.rooms.registry import PrefillRoom, Target
from pdfabric_agent.rooms.targets import DecodeFailed
from pdfabric_agent.runtime.config import load_config
from pdfabric_agent.transfer.base import KernelPath, TransferBackend
from pdfabric_core.policy.types import Transport
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap
from pdfabric_core.spec import parse_spec

RAW: dict[str, Any] = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"maxBatchEntries": 16},
    "model": {
        "layers": 4,
        "kvHeads": 2,
        "headDim": 8,
        "pageSizeTokens": 2,
        "dtype": "float32",
        "stateBytesPerRequest": 64,
        "stateLayers": 2,
        "auxRowBytes": [8, 16],
    },
}


class Kernel(KernelPath):
    """The kernel-only calls; `takes` says whether the kernel accepts, `launch` whether it launches
    without waiting (else only the try_write_* calls take data), `marks` whether launches name
    where the receiver sees them complete (the real FastPathBackend does all three)."""

    def __init__(self, calls: list[tuple[str, int]], takes: bool, launch: bool, refuse_aux: bool, marks: bool) -> None:
        self.calls, self.takes, self.launch, self.refuse_aux, self.marks = calls, takes, launch, refuse_aux, marks

    def submit_pages(self, peer: str, kvp: Any) -> Any:
        if not self.launch:
            return None
        self.calls.append(("submit_pages", kvp.units))
        return ("h", kvp.units) if self.takes else None

    def submit_blocks(self, peer: str, blocks: Any) -> Any:
        if not self.launch:
            return None
        if self.refuse_aux and len(blocks) == 2 and blocks[0].length == 8:
            raise RuntimeError("receiver pages in flight for another request")
        self.calls.append(("submit_blocks", len(blocks)))
        return ("h", len(blocks)) if self.takes else None

    def completion_mark(self, handle: Any) -> CompletionMark | None:
        if not self.marks:
            return None
        self.calls.append(("mark", handle[1]))
        return CompletionMark("pdfabric-board-00000000abcd", 3, 100 + handle[1])

    def wait(self, handle: Any) -> str:
        self.calls.append(("wait", handle[1]))
        return "nvlink-kernel"

    def try_write_pages(self, peer: str, kvp: Any) -> str | None:
        self.calls.append(("pages", kvp.units))
        return "nvlink-kernel" if self.takes else None

    def try_write_blocks(self, peer: str, blocks: Any) -> str | None:
        self.calls.append(("blocks", len(blocks)))
        return "nvlink-kernel" if self.takes else None


class Backend(TransferBackend):
    """Engine plus, when `kernel`, a kernel path (``Kernel``)."""

    name = "mooncake"
    transport = Transport.NVLINK_INTRA
    max_batch_entries = 1024

    def __init__(
        self, kernel: bool, takes: bool, launch: bool = False, refuse_aux: bool = False, marks: bool = False
    ) -> None:
        self.path = "nvlink-kernel" if kernel else "mooncake"
        self.calls: list[tuple[str, int]] = []
        self._kernel = Kernel(self.calls, takes, launch, refuse_aux, marks) if kernel else None

    @property
    def kernel(self) -> KernelPath | None:
        return self._kernel

    def endpoint(self) -> str:
        return "127.0.0.1:1"

    def register(self, pool: Any) -> None:
        pass

    def write_batch(self, peer: str, blocks: Any) -> str | None:
        self.calls.append(("engine", len(blocks)))
        return "mooncake" if self.path == "nvlink-kernel" else None

    def probe(self, peer: str) -> bool:
        return True

    def close(self) -> None:
        pass


def record_posts(
    agent: Agent, posts: list[tuple[str, dict[str, Any]]], refuse: str = "", answer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Replace the agent's peer posts by a recorder; posts to path `refuse` are refused, others
    answered with `answer` (decode's answer to a done report: the room's state)."""
    sent: dict[str, Any] = {}

    async def post(agent_name: str, msg: PeerMessage, timeout_s: float) -> dict[str, Any]:
        body = msg.to_json()
        posts.append((msg.PATH, body))
        if refuse == msg.PATH:
            raise PeerRefused(agent_name, msg.PATH, 400, "malformed", "cannot watch")
        sent.update(body)
        return dict(answer or {"state": "Success"})

    agent.peers.post = post  # type: ignore[method-assign]
    return sent


def make_agent(tmp_path: Path) -> Agent:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    env = {"NODE_NAME": "n1", "PDFABRIC_RANKMAP": "unused", "PDFABRIC_TOKEN_FILE": str(token)}
    env["PDFABRIC_ENGINE_TOKEN_FILE"] = str(token)
    entries = (
        AgentEntry("a1", "n1", (Rank("prefill", 0, 0),)),
        AgentEntry("a2", "n2", (Rank("decode", 0, 0),)),
    )
    spec = parse_spec(RAW)
    rankmap = RankMap("ns", "c", "uid-1", "nvlink-intra", RAW, entries)
    return Agent(load_config(env), rankmap, spec, {}, "nvlink-intra")


def dst_map(layout: PoolLayout) -> dict[str, list[int]]:
    """The decode side's buffers on the wire: the pools of a rank at these bases."""
    m = MemoryMap.of_pools(layout, Bases(0x4000_0000, 0x5000_0000, 0x6000_0000))
    return {"kv": list(m.kv), "state": list(m.state), "aux": list(m.aux)}


def run_room(
    tmp_path: Path,
    backend: Backend,
    pages: list[int],
    posts: list[tuple[str, dict[str, Any]]] | None = None,
    refuse: str = "",
    answer: dict[str, Any] | None = None,
    seen: list[Agent] | None = None,
) -> tuple[dict[str, Any], PrefillRoom]:
    """One room through `_send_target`; peer posts are recorded in `posts` (path `refuse` fails)."""
    agent = make_agent(tmp_path)
    if seen is not None:
        seen.append(agent)
    layout = PoolLayout.from_geometry(agent.spec.model, 1, kv_pages=64, state_slots=2, aux_slots=2)
    pool = SimpleNamespace(addr=0x1000_0000)
    local = LocalRank(Rank("prefill", 0, 0), backend, RankPools(layout, pool, pool, pool))  # type: ignore[arg-type]
    dst = RoomInfo(
        room=1, decode_rank="decode-0-tp0", prefill_rank="prefill-0-tp0-cp0", endpoint="peer:1", layout=layout,
        bases=Bases(0x4000_0000, 0x5000_0000, 0x6000_0000), kv_pages=list(range(len(pages))), state_indices=[1],
        aux_index=1,
    )  # fmt: skip
    target = Target("decode-0-tp0", 0, "a2")
    target.dst = dst
    room = PrefillRoom(
        rank="prefill-0-tp0-cp0", room=1, submitted=0.0, deadline=1e9, src_pages=pages, src_state=[0],
        src_aux=0, targets={"decode-0-tp0": target},
    )  # fmt: skip
    sent = record_posts(agent, posts if posts is not None else [], refuse, answer)

    async def go() -> None:
        try:
            await agent.sender.targets.send_target(room, local, target)
        finally:
            await agent.close()

    asyncio.run(go())
    return sent, room


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
    assert backend.calls == [("engine", 8), ("engine", 2), ("engine", 2)]  # one run per layer and K/V
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
    agent = make_agent(tmp_path)
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
            assert view["state"] == "Transferring"
            assert [what for what, _ in backend.calls] == ["submit_pages", "submit_blocks", "submit_blocks"] + [
                "mark"
            ] * 3  # launched (and marked) before `send` answered; nothing waited for yet
            final = await agent.poll("prefill-0-tp0-cp0", 5, wait_s=5)
            assert final["state"] == "Success", final
            assert [what for what, _ in backend.calls][-3:] == ["wait"] * 3
            assert [path for path, _ in recorded] == ["/v1/peer/launched", "/v1/peer/done"]
            assert final["bytes"] == {"kv": KV_BYTES, "state": 64, "aux": 24}
        finally:
            await agent.close()

    asyncio.run(go())
