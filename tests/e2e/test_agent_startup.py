"""Start-up of real agent processes: a transport the node cannot carry is a readiness reason,
not a silent fallback; configuration errors exit with a clear message; only the needed ports
listen, on the configured address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from pdfabric_devcluster.agents import AgentProcess
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.procs import REPO_ROOT
from pdfabric_devcluster.transfer import transfer_room

# Real agent processes over the real engine; every test here starts at least one cluster.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = {"layers": 1, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4}


def cluster_spec(**placement: Any) -> dict[str, Any]:
    return {"prefill": {"tp": 2}, "decode": {"tp": 1}, "model": MODEL, "placement": placement}


def wait_readyz(lc: LocalFabric, name: str, timeout_s: float = 60) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = lc.readyz(name)
        # The metrics server answers before the engines start, and a sending rank's link check
        # waits for its peers (none started here: up to probe.DISCOVER_S): wait for a settled reason.
        if status and body.get("reason") not in ("Starting", "Probing"):
            return status, body
        time.sleep(0.1)
    pytest.fail(f"{name} gave no settled /readyz within {timeout_s} s:\n{lc.log(name)}")


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband"), reason="this machine has RDMA devices")
@pytest.mark.parametrize(
    ("transport", "reason"),
    [("rdma", "NoRdmaDevice"), ("nvlink-intra", "NoGpu"), ("nvlink", "NoGpu")],
    ids=["rdma-without-hca", "intra-node-nvlink-without-gpu", "mnnvl-without-gpu"],
)
def test_transport_the_node_cannot_carry_is_a_readiness_reason(transport: str, reason: str) -> None:
    lc = LocalFabric(cluster_spec(), transport=transport)
    try:
        lc.start(lc.agent_of("decode-0-tp0"), ready=False)
        name = lc.agent_of("decode-0-tp0")
        status, body = wait_readyz(lc, name)
        assert (status, body["ready"], body["reason"]) == (503, False, reason)
        assert "placement.fallback: TCP" in body["message"]
        # Not ready means closed: the transfer API does not listen at all.
        with pytest.raises(OSError):
            lc.client(name).info()
        assert lc.metric_sum("pdfabric_agent_ready", [name]) == 0
    finally:
        lc.close()


def test_efa_without_an_efa_device_is_refused_at_start_and_falls_back_when_declared() -> None:
    """Backend nixl over efa (NIXL's LIBFABRIC backend): on a node without an EFA device the agent
    is not ready with reason NoEfaDevice, and nothing of the transfer API listens; with the declared
    fallback it runs NIXL over tcp and says why."""
    spec = {**cluster_spec(), "backend": "nixl", "transfer": {"transport": "efa"}}
    lc = LocalFabric(spec)
    try:
        name = lc.agent_of("decode-0-tp0")
        lc.start(name, ready=False)
        status, body = wait_readyz(lc, name)
        assert (status, body["ready"], body["reason"]) == (503, False, "NoEfaDevice"), body
        assert "needs an EFA device" in body["message"]
        with pytest.raises(OSError):
            lc.client(name).info()
    finally:
        lc.close()
    lc = LocalFabric({**spec, "placement": {"fallback": "TCP"}})
    try:
        name = lc.agent_of("decode-0-tp0")
        lc.start(name, ready=False)
        status, body = wait_readyz(lc, name)
        assert (status, body["ready"]) == (200, True), body
        assert "NoEfaDevice" in body["message"] and "fell back to tcp" in body["message"]
        info = lc.client(name).info()
        assert (info.transport, info.backend) == ("tcp", "nixl")
    finally:
        lc.close()


def test_declared_fallback_runs_tcp_and_says_so() -> None:
    lc = LocalFabric(cluster_spec(fallback="TCP"), transport="rdma")
    try:
        lc.start(lc.agent_of("decode-0-tp0"), ready=False)
        name = lc.agent_of("decode-0-tp0")
        status, body = wait_readyz(lc, name)
        assert (status, body["ready"]) == (200, True)
        assert "NoRdmaDevice" in body["message"] and "fell back to tcp" in body["message"]
        assert lc.client(name).info().transport == "tcp"
    finally:
        lc.close()


def listeners(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def own_listeners(agent: AgentProcess) -> tuple[list[str], list[str]]:
    """(the agent's own servers' listen addresses, every listen address of its process)."""
    assert agent.proc is not None
    addrs = listeners(agent.proc.pid)
    ports = (f":{agent.api_port}", f":{agent.peer_port}", f":{agent.metrics_port}")
    return sorted(a for a in addrs if a.endswith(ports)), addrs


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than loopback (what a pod IP is to the agent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_only_the_needed_ports_listen() -> None:
    with LocalFabric(cluster_spec()) as lc:
        for agent in lc.agents.values():
            own, addrs = own_listeners(agent)
            # Engine door on loopback; peer door and metrics on the configured address (the pod IP in a pod).
            want = [f"127.0.0.1:{agent.api_port}", f"127.0.0.1:{agent.peer_port}", f"127.0.0.1:{agent.metrics_port}"]
            assert own == sorted(want)
            # Besides them: the engine's handshake and data listeners, two per rank, nothing else.
            assert len(addrs) - len(own) == 2 * len(lc.entry(agent.name).ranks), addrs


def test_engine_calls_from_the_network_are_impossible() -> None:
    """With the agent bound to a network address (a pod IP), the engine door is on loopback only:
    nothing listens on the engine port of that address, so no engine call can come from there."""
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    lc = LocalFabric(cluster_spec(), env={"PDFABRIC_BIND_ADDRESS": addr})
    try:
        name = lc.agent_of("decode-0-tp0")
        lc.start(name)
        agent = lc.agents[name]
        own, _ = own_listeners(agent)
        assert own == sorted(
            [f"127.0.0.1:{agent.api_port}", f"{addr}:{agent.peer_port}", f"{addr}:{agent.metrics_port}"]
        )
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((addr, agent.api_port), timeout=5).close()
        assert lc.client(name).info().agent == name  # on loopback, with the engine token
    finally:
        lc.close()


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("NODE_NAME", "NODE_NAME is not set"),
        ("PDFABRIC_ENGINE_TOKEN_FILE", "PDFABRIC_ENGINE_TOKEN_FILE is not set"),
        ("PDFABRIC_PEER_TLS_DIR", "PDFABRIC_PEER_TLS_DIR is not set"),
    ],
    ids=["no-node-name", "no-engine-token", "no-peer-certificate"],
)
def test_configuration_errors_exit_2_with_the_variable_named(drop: str, message: str) -> None:
    lc = LocalFabric(cluster_spec())
    try:
        env = {k: v for k, v in lc.agents[lc.agent_of("decode-0-tp0")].env.items() if k != drop}
        proc = subprocess.run(
            [sys.executable, "-m", "pdfabric_agent.process.main"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )
        assert proc.returncode == 2
        assert message in proc.stderr
    finally:
        lc.close()


@pytest.mark.parametrize(
    ("pod_name", "message"),
    [
        (True, "puts agent 'agent-d0-0' on node 'node-d0-0', not 'node-elsewhere'"),
        (False, "has 0 agents on node 'node-elsewhere'"),
    ],
    ids=["its-pod-on-another-node", "no-pod-name-and-no-agent-on-the-node"],
)
def test_agent_on_a_node_the_rank_map_does_not_give_it_exits_2(pod_name: bool, message: str) -> None:
    lc = LocalFabric(cluster_spec())
    try:
        env = {**lc.agents[lc.agent_of("decode-0-tp0")].env, "NODE_NAME": "node-elsewhere"}
        if not pod_name:
            env.pop("POD_NAME")
        proc = subprocess.run(
            [sys.executable, "-m", "pdfabric_agent.process.main"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )
        assert proc.returncode == 2
        assert message in proc.stderr
    finally:
        lc.close()


def test_a_fabric_whose_agent_never_gets_ready_leaves_no_agent_running() -> None:
    """The with-block's start fails (one agent exits at once): the others are stopped, not orphaned."""
    lc = LocalFabric(cluster_spec())
    first, *others = lc.agents.values()
    assert others, "the spec places more than one agent"
    first.argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited 3"), lc:
        pass
    assert not any(a.alive() for a in lc.agents.values())


def test_agents_whose_peers_streamed_to_them_stop_at_once() -> None:
    """After a room, each agent holds its peer's stream open on its peer door; at SIGTERM it closes
    them (1001, going away) instead of waiting on the callers: both stop in well under the 10 s
    a stream close waited for before."""
    spec = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "model": MODEL}
    with LocalFabric(spec) as lc:
        result = transfer_room(lc, 1, pages=2)
        assert all(not errors for errors in result.errors.values()), result.errors
        started = time.monotonic()
        for agent in lc.agents.values():
            agent.terminate()
        for agent in lc.agents.values():
            agent.wait(20)
        took = time.monotonic() - started
    assert took < 5, f"the agents took {took:.1f} s to stop"
