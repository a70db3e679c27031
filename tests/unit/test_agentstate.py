"""The operator's reading of what an agent says about its transport (its /readyz): parsed from
the body the agent's server writes, read once per pod, addresses from the pod or the override file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp.test_utils import TestServer

from pdfabric_agent.server import Readiness, build_metrics_app
from pdfabric_operator.agentstate import AgentAddress, AgentTransport, parse_readyz, read_transports


def test_parse_readyz() -> None:
    body = {"ready": True, "reason": "Ready", "message": "2 ranks on tcp", "transport": "tcp", "requested": "rdma"}
    got = parse_readyz(body)
    assert got == AgentTransport("rdma", "tcp", "2 ranks on tcp") and got.fell_back
    assert parse_readyz({"ready": False, "reason": "Starting"}) is None  # not chosen yet
    assert parse_readyz(["tcp"]) is None
    assert parse_readyz({"transport": 1, "requested": "tcp"}) is None
    assert not AgentTransport("tcp", "tcp").fell_back


def test_reads_the_agents_readyz_once_per_pod(tmp_path: Path) -> None:
    async def run() -> None:
        readiness = Readiness(True, "Ready", "ok", transport="tcp", requested="rdma")
        server = TestServer(build_metrics_app(readiness), host="127.0.0.1")
        await server.start_server()
        try:
            overrides = tmp_path / "addresses.json"
            overrides.write_text(json.dumps({"agent-a": f"127.0.0.1:{server.port}"}))
            pods = [AgentAddress("uid-a", "agent-a", "10.0.0.1"), AgentAddress("uid-b", "agent-b", "")]
            got = await read_transports(pods, 9400, {}, str(overrides))
            assert got == {"uid-a": AgentTransport("rdma", "tcp", "ok")}  # agent-b: no address, left out
            assert await read_transports(pods, 9400, got, str(overrides)) == {}  # known: not read again
            # The pod IP and the spec's metrics port when no override names the pod.
            got = await read_transports([AgentAddress("uid-c", "agent-c", "127.0.0.1")], server.port, {})
            assert got["uid-c"].transport == "tcp"
            # Not answering: left out, read again next time.
            silent = [AgentAddress("uid-d", "agent-d", "127.0.0.1")]
            assert await read_transports(silent, 1, {}) == {}
        finally:
            await server.close()

    asyncio.run(run())
