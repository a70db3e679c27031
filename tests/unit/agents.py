"""Fakes for unit tests of one agent in this process: a transfer backend with an optional kernel
path that records its calls, a peer session that records posts, and one agent factory (a spec, the
node it runs on, the ranks it serves with fake pools)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pdfabric_agent.memory.completion import CompletionMark
from pdfabric_agent.memory.plan import Bases, MemoryMap
from pdfabric_agent.memory.pools import PoolLayout, RankPools
from pdfabric_agent.peers.client import PeerRefused
from pdfabric_agent.protocol.peer_wire import PeerMessage, RoomCancel, RoomInfo
from pdfabric_agent.ranks.local import LocalRank
from pdfabric_agent.rooms.room import PrefillRoom, Target
from pdfabric_agent.runtime.config import load_config
from pdfabric_agent.service.agent import Agent
from pdfabric_agent.transfer.base import KernelPath, TransferBackend
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import AgentEntry, Rank, RankMap, replica_ranks
from pdfabric_core.spec import PDClusterSpec, parse_spec

# A tcp spec whose every kind of memory moves, and the kernel path's (nvlink-intra, 16-block batches).
TCP_RAW: dict[str, Any] = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp"},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 8, "pageSizeTokens": 2, "dtype": "float32",
              "stateBytesPerRequest": 64, "stateLayers": 2, "auxRowBytes": [8, 16]},
}  # fmt: skip
KERNEL_RAW: dict[str, Any] = {
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
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


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


# What a peer answers by default, as the JSON its door writes (the fakes read it like the real client).
DEFAULT_ANSWERS: dict[str, dict[str, Any]] = {RoomInfo.PATH: {"accepted": "room"}, RoomCancel.PATH: {"fenced": True}}


def peer_answer(msg: PeerMessage[Any], doc: dict[str, Any] | None = None) -> Any:
    """The typed answer to ``msg`` read from ``doc`` (default: the peer took it; a done report or a
    launch notice: the decode room is Success)."""
    return msg.read_answer(doc if doc is not None else DEFAULT_ANSWERS.get(msg.PATH, {"state": "Success"}))


def record_posts(
    agent: Agent, posts: list[tuple[str, dict[str, Any]]], refuse: str = "", answer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Replace the agent's peer posts by a recorder; posts to path `refuse` are refused, others
    answered with `answer` (decode's answer to a done report: the room's state)."""
    sent: dict[str, Any] = {}

    async def post(agent_name: str, msg: PeerMessage[Any], timeout_s: float) -> Any:
        body = msg.to_json()
        posts.append((msg.PATH, body))
        if refuse == msg.PATH:
            raise PeerRefused(agent_name, msg.PATH, 400, "malformed", "cannot watch")
        sent.update(body)
        return peer_answer(msg, answer)

    agent.peers.post = post  # type: ignore[method-assign]
    return sent


def make_agent(
    tmp_path: Path,
    node: str = "n1",
    local: Sequence[Rank] = (),
    *,
    raw: dict[str, Any] | None = None,
    transport: str = "tcp",
    entries: Sequence[AgentEntry] | None = None,
    env: dict[str, str] | None = None,
    clock: Callable[[], float] | None = None,
    cluster: str = "c",
) -> Agent:
    """The one agent factory of the unit tests: an agent on `node` of a rank map (by default two
    agents: a1 on n1 holds prefill-0, a2 on n2 decode-0; or `entries`), serving `local` with fake
    pools and a ``Backend`` without a kernel path; settings from the environment as the process
    reads them (`env` adds to it). Metrics are process-wide: a test whose agents must not add
    series to another test's `cluster` names its own."""
    raw = TCP_RAW if raw is None else raw
    token = tmp_path / "token"
    token.write_text("t" * 32)
    environ = {"NODE_NAME": node, "PDFABRIC_RANKMAP": "unused", "PDFABRIC_TOKEN_FILE": str(token)}
    environ["PDFABRIC_ENGINE_TOKEN_FILE"] = str(token)
    environ.update(env or {})
    if entries is None:
        entries = (
            AgentEntry("a1", "n1", (Rank(Role.PREFILL, 0, 0),)),
            AgentEntry("a2", "n2", (Rank(Role.DECODE, 0, 0),)),
        )
    spec = parse_spec(raw)
    rankmap = RankMap("ns", cluster, "uid-1", transport, raw, tuple(entries))
    cfg = load_config(environ)
    agent = (
        Agent(cfg, rankmap, spec, {}, transport) if clock is None else Agent(cfg, rankmap, spec, {}, transport, clock)
    )
    for rank in local:
        group = spec.prefill if rank.role is Role.PREFILL else spec.decode
        layout = PoolLayout.from_geometry(spec.model, group.tp, kv_pages=16, state_slots=4, aux_slots=4)
        pool = SimpleNamespace(addr=0x1000_0000)
        pools = RankPools(layout, pool, pool, pool)  # type: ignore[arg-type]
        agent.ranks[rank.rank_id] = LocalRank(rank, Backend(kernel=False, takes=False), pools)
    return agent


def kernel_agent(tmp_path: Path) -> Agent:
    """The prefill agent of the kernel path's spec, serving no rank yet."""
    return make_agent(tmp_path, raw=KERNEL_RAW, transport="nvlink-intra")


def room_info(room: int, **changes: Any) -> RoomInfo:
    layout = PoolLayout.from_geometry(parse_spec(TCP_RAW).model, 1, kv_pages=16, state_slots=4, aux_slots=4)
    info = RoomInfo(room, D, P, "peer:1", layout, Bases(1 << 30, 2 << 30, 3 << 30), [0, 1], [0], 0)
    return dataclasses.replace(info, **changes)


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
    agent = kernel_agent(tmp_path)
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


def agent_per_replica(
    cluster: str, replicas: int, tp: int, transport: str = "tcp"
) -> tuple[RankMap, PDClusterSpec, tuple[AgentEntry, ...]]:
    """``replicas`` prefill and decode replicas of TP ``tp``, one agent per replica (``prefill-3``,
    ``decode-0``: an 8-GPU node each at TP 8), the rank map of PDCluster ``cluster``."""
    raw: dict[str, Any] = {
        "prefill": {"tp": tp, "replicas": replicas},
        "decode": {"tp": tp, "replicas": replicas},
        "transfer": {"transport": transport},
        "model": {"layers": 2, "kvHeads": tp, "headDim": 8, "pageSizeTokens": 2},
    }
    spec = parse_spec(raw)
    entries = tuple(
        AgentEntry(f"{role}-{r}", f"node-{role}-{r}", tuple(replica_ranks(spec, role, r)))
        for role in (Role.PREFILL, Role.DECODE)
        for r in range(replicas)
    )
    return RankMap("ns", cluster, f"uid-{cluster}", transport, raw, entries), spec, entries
