"""What the last attacks got through (issue 27), against real agents on loopback (tcp, the peer door
on mutual TLS):

- a flood of half-open TLS handshakes against agents held to 1,024 descriptors (the soft limit
  common under containerd) must not fail a room or blacklist a peer;
- a prefill agent stopped (SIGSTOP) in the middle of a write, then resumed, must blame no peer:
  its own pause is not the decode agent's failure, and the next room succeeds;
- a flood from the decode agent's own address (another process of its node, or behind its NAT)
  must not keep decode out of the prefill's door (issue 40: its first room was reset at the bound).
"""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest

from pdfabric_devcluster.agents import AgentProcess
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.transfer import transfer_room
from tests.e2e.attacks import HandshakeFlood
from tests.e2e.specs import TCP_SMALL_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

P, D = "prefill-0-tp0-cp0", "decode-0-tp0"
SPEC = TCP_SMALL_MODEL
DESCRIPTORS = 1024


def hold_descriptors(agent: AgentProcess, soft: int) -> None:
    assert agent.proc is not None
    _, hard = resource.prlimit(agent.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(agent.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))


def open_descriptors(agent: AgentProcess) -> int:
    assert agent.proc is not None
    return len(os.listdir(f"/proc/{agent.proc.pid}/fd"))


def test_rooms_stay_exact_under_a_handshake_flood_at_1024_descriptors() -> None:
    """The flood starts before the first room, so the agents' peer connections are all opened under
    it (a prefill agent whose descriptors the flood took cannot connect to report a room done)."""
    with LocalFabric(SPEC) as lc:
        prefill, decode = lc.agents[lc.agent_of(P)], lc.agents[lc.agent_of(D)]
        for agent in (prefill, decode):
            hold_descriptors(agent, DESCRIPTORS)
        rooms: list[tuple[int, str, list[str]]] = []
        with HandshakeFlood(prefill.peer_address, 1500) as on_prefill, HandshakeFlood(decode.peer_address, 1500):
            time.sleep(2)  # the floods are at full strength
            held = max(open_descriptors(prefill), open_descriptors(decode))
            ends = time.monotonic() + 20
            room = 100
            while time.monotonic() < ends:
                result = transfer_room(lc, room, pages=1 + room % 8, state_slots=1, timeout_s=15)
                rooms.append((room, result.decode[D].state.title, result.errors[D]))
                room += 1
            churn = on_prefill.ended
        blacklisted = lc.metric_sum("pdfabric_peers_blacklisted")
        failed = [r for r in rooms if r[1] != "Success" or r[2]]
        print(f"flood: {len(rooms)} rooms, {churn} flood connections reset by the prefill agent, {held} fds held")
        assert not failed, failed[:3]
        assert len(rooms) >= 20
        assert blacklisted == 0
        assert held < DESCRIPTORS // 2  # the flood holds a bounded share of the agent's descriptors
        assert churn > 0  # the flood was really refused and came back


def test_a_flood_from_the_peers_own_address_lets_its_rooms_through() -> None:
    """1,100 half-open connections to the prefill's peer door from 127.0.0.1, the address the
    decode agent dials from, started before decode's first connection to prefill: every room is
    exact and no peer is blacklisted."""
    with LocalFabric(SPEC) as lc:
        prefill, decode = lc.agents[lc.agent_of(P)], lc.agents[lc.agent_of(D)]
        hold_descriptors(prefill, DESCRIPTORS)
        rooms: list[tuple[int, str, list[str], float]] = []
        with HandshakeFlood(prefill.peer_address, 1100, source="127.0.0.1") as flood:
            time.sleep(2)  # at full strength
            for room in range(200, 205):
                result = transfer_room(lc, room, pages=1 + room % 8, state_slots=1, timeout_s=15)
                rooms.append((room, result.decode[D].state.title, result.errors[D], round(result.elapsed_s, 2)))
            churn = flood.ended
            held = open_descriptors(prefill)
        blacklisted = lc.metric_sum("pdfabric_peers_blacklisted")
        print(f"flood from the peer's address: rooms {rooms}, {churn} flood connections reset, {held} fds held")
        assert [r for r in rooms if r[1] != "Success" or r[2]] == [], rooms
        assert blacklisted == 0
        assert held < DESCRIPTORS // 2
        assert churn > 0
        assert decode.alive() and prefill.alive()


BIG = {**SPEC, "model": {"layers": 4, "kvHeads": 8, "headDim": 128, "pageSizeTokens": 16, "auxRowBytes": [8, 8]}}
ROOM_PAGES = 1024  # 256 MiB of KV: a write that takes long enough on loopback to be stopped in


@pytest.mark.parametrize(("stop_s", "heartbeat_s"), [(4.0, "1"), (12.0, "1"), (8.0, "5")])
def test_a_prefill_stopped_mid_write_blames_no_peer_and_the_next_room_succeeds(stop_s: float, heartbeat_s: str) -> None:
    """SIGSTOP of the prefill agent while its write runs, SIGCONT `stop_s` later (the production
    probe backoff, 30 s: a peer blacklisted now would fail the next room at once). Whatever became
    of the stopped room, no agent blames the other afterwards, and the next room is exact. With 1 s
    heartbeats decode gives the room up while prefill is stopped (and re-admits it when it calls
    again); with the default 5 s, prefill's write outlives the stop and fails when it resumes."""
    with LocalFabric(BIG, env={"PDFABRIC_KV_PAGES": "2048", "PDFABRIC_HEARTBEAT_S": heartbeat_s}) as lc:
        prefill = lc.agents[lc.agent_of(P)]
        pages = list(range(ROOM_PAGES))
        # Decode's destinations above the next room's: a failed room holds its pages for a while.
        lc.client(D).receive(D, 1, [ROOM_PAGES + p for p in pages])
        deadline = time.monotonic() + 10
        while lc.client(D).poll(D, 1).state.title != "WaitingForInput":
            assert time.monotonic() < deadline, "room info not delivered"
            time.sleep(0.02)
        lc.client(P).send(P, 1, pages)
        while lc.client(P).poll(P, 1).state.title != "Transferring":
            assert time.monotonic() < deadline, "the write did not start"
            time.sleep(0.005)
        prefill.signal(signal.SIGSTOP)
        time.sleep(stop_s)
        prefill.signal(signal.SIGCONT)
        stopped = {rank: lc.client(rank).wait(rank, 1, 30) for rank in (P, D)}
        print({rank: (v.state.title, v.reason) for rank, v in stopped.items()})
        result = transfer_room(lc, 2, pages=16)
        blacklisted = {name: lc.metric_sum("pdfabric_peers_blacklisted", [name]) for name in lc.agents}
        reasons = {r: (v.state.title, v.reason) for r, v in {**result.decode, **result.prefill}.items()}
        assert result.errors == {D: []}, reasons
        assert blacklisted == dict.fromkeys(lc.agents, 0.0)
        assert not any("blacklisted" in v.reason for v in stopped.values()), stopped
