"""Agent.engine_exited: a serving engine's exit fails the open rooms of its ranks at once (peers
told, as for an abort), leaves other ranks' rooms and finished rooms alone, and unlinks the
shared-memory files of its registrations that lie in the shm directory, keeping the agent's
mapping."""

from __future__ import annotations

import asyncio
import mmap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdfabric_agent.memory.pools import Pool
from pdfabric_agent.protocol.peer_wire import DoneReport
from pdfabric_agent.protocol.views import RoomState
from pdfabric_agent.rooms.room import DecodeRoom, PrefillRoom, Target
from pdfabric_agent.service.agent import Agent
from pdfabric_core.policy.types import Device
from pdfabric_core.rankmap import AgentEntry, Rank
from tests.unit.agents import make_agent, peer_answer

PREFILL, DECODE = "prefill-0-tp0-cp0", "decode-0-tp0"
REASON = "engine prefill-0 exited (exit code 1)"


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    shm = tmp_path / "shm"
    shm.mkdir()
    entries = (
        AgentEntry("a1", "n1", (Rank("prefill", 0, 0), Rank("decode", 0, 0))),
        AgentEntry("a2", "n2", (Rank("prefill", 1, 0), Rank("decode", 1, 0))),
    )
    env = {"PDFABRIC_SHM_DIR": str(shm), "PDFABRIC_HEARTBEAT_S": "1000"}
    return make_agent(tmp_path, raw={"prefill": {"tp": 1}, "decode": {"tp": 1}}, entries=entries, env=env)


def prefill_room(agent: Agent, room: int) -> PrefillRoom:
    r = PrefillRoom(
        rank=PREFILL, room=room, submitted=0.0, deadline=1e12, src_pages=[0], src_state=[], src_aux=None,
        targets={"decode-1-tp0": Target("decode-1-tp0", 0, "a2")},
    )  # fmt: skip
    agent.rooms.add(r)
    return r


def decode_room(agent: Agent, room: int) -> DecodeRoom:
    r = DecodeRoom(
        rank=DECODE, room=room, submitted=0.0, deadline=1e12, dst_pages=[0], dst_state=[], dst_aux=None,
        expected={"prefill-1-tp0-cp0": "a2"},
    )  # fmt: skip
    agent.rooms.add(r)
    return r


def test_an_engine_exit_fails_its_ranks_open_rooms_and_tells_the_peers(agent: Agent) -> None:
    posted: list[tuple[str, Any]] = []

    async def post(agent_name: str, msg: Any, timeout_s: float) -> Any:
        posted.append((agent_name, msg))
        return peer_answer(msg)

    agent.peers.post = post  # type: ignore[method-assign]

    async def go() -> None:
        mine, done, other = prefill_room(agent, 1), prefill_room(agent, 2), decode_room(agent, 3)
        agent.rooms.finish(done, RoomState.SUCCESS)
        assert agent.engine_exited([PREFILL], REASON) == 1
        assert (mine.state, mine.reason) == (RoomState.FAILED, REASON)
        assert done.state is RoomState.SUCCESS and other.state is RoomState.BOOTSTRAPPING
        await asyncio.sleep(0.05)  # the failure notice goes out beside the call
        assert len(posted) == 1 and posted[0][0] == "a2"
        report = posted[0][1]
        assert isinstance(report, DoneReport) and (report.ok, report.reason, report.room) == (False, REASON, 1)
        # A decode engine's exit fails its waiting rooms the same way.
        assert agent.engine_exited([DECODE], "engine decode-0 exited (killed by signal 9)") == 1
        assert (other.state, other.reason) == (RoomState.FAILED, "engine decode-0 exited (killed by signal 9)")
        assert agent.rooms.open_count == 0
        await agent.close()

    asyncio.run(go())


def test_an_engine_exit_unlinks_its_shm_files_in_the_shm_dir_only(agent: Agent, tmp_path: Path) -> None:
    shm, outside = Path(agent.cfg.shm_dir), tmp_path / "outside"
    kv, aux, stray = shm / "engine-kv", shm / "engine-aux", outside
    for f in (kv, aux, stray):
        f.write_bytes(b"\0" * 4096)
    with open(kv, "r+b") as fh:
        mapped = mmap.mmap(fh.fileno(), 4096)
    regions = [
        Pool("engine:k0", 4096, Device.CPU, 0, str(kv), None),
        Pool("engine:v0", 4096, Device.CPU, 0, str(kv), None),  # one file, two buffers
        Pool("engine:aux0", 4096, Device.CPU, 0, str(aux), None),
        Pool("engine:x", 4096, Device.CPU, 0, str(stray), None),  # refused at registration; never unlinked
        Pool("engine:gpu", 4096, Device.CUDA, 0, '{"handle": "ab"}', None, 0),
    ]
    engine = SimpleNamespace(regions=lambda: tuple(regions))
    agent.ranks[PREFILL] = SimpleNamespace(rank=Rank("prefill", 0, 0), engine=engine)  # type: ignore[assignment]
    agent.ranks[DECODE] = SimpleNamespace(rank=Rank("decode", 0, 0), engine=None)  # type: ignore[assignment]

    async def go() -> None:
        assert agent.engine_exited([PREFILL, DECODE], REASON) == 0
        await agent.close()

    asyncio.run(go())
    assert not kv.exists() and not aux.exists() and stray.exists()
    mapped[0:3] = b"abc"  # the agent's mapping outlives the name, until the engine registers again
    assert mapped[0:3] == b"abc"
    mapped.close()
