"""The operator's reading of what an agent says about its transport (its /readyz): parsed from
the body the agent's server writes, read once per pod, addresses from the pod or the override file."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdfabric_agent.http.server import Readiness, build_metrics_app
from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role
from pdfabric_operator import agentstate
from pdfabric_operator.agentstate import (
    AgentAddress,
    AgentReads,
    AgentReport,
    AgentTransport,
    heard,
    parse_engines,
    parse_readyz,
    parse_report,
    read_agents,
    read_reports,
    read_transports,
)


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


def _engine(name: str, **kw: object) -> dict[str, object]:
    role, replica = name.split("-")
    body: dict[str, object] = {"name": name, "role": role, "replica": int(replica), "phase": "Running", "ready": True}
    body.update(kw)
    return body


def test_parse_report_reads_the_agents_own_readiness_and_its_engines() -> None:
    body = {
        "ready": True,
        "enginesReady": False,
        "transport": "tcp",
        "requested": "tcp",
        "engines": [
            _engine("prefill-0", restarts=2, pid=11, lastExit="exit code 1"),
            _engine("decode-0", ready=False, phase="BackOff"),
            {"name": "broken"},  # malformed: left out
        ],
    }
    report = parse_report(body)
    assert report is not None and report.ready is True and report.transport == AgentTransport("tcp", "tcp")
    assert report.engines is not None and set(report.engines) == {"prefill-0", "decode-0"}
    p0 = report.engines["prefill-0"]
    assert (p0.role, p0.ready, p0.restarts, p0.last_exit) == (Role.PREFILL, True, 2, "exit code 1")
    assert report.engines["decode-0"] == EngineState("decode-0", Role.DECODE, 0, "BackOff", False)
    assert parse_report({"ready": "yes"}) == AgentReport(None, None, None)  # says nothing usable
    assert parse_report([1]) is None
    assert parse_engines({"engines": "prefill-0"}) is None


@contextlib.asynccontextmanager
async def readyz_server(
    readyz: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[TestServer]:
    """A loopback HTTP server answering GET /readyz with ``readyz``."""
    app = web.Application()
    app.router.add_get("/readyz", readyz)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def test_reads_every_pods_report_each_time_whatever_the_status_code(tmp_path: Path) -> None:
    body = {"ready": True, "enginesReady": False, "engines": [_engine("decode-0", ready=False, phase="Starting")]}
    hits: list[str] = []

    async def readyz(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response(body, status=503)  # not ready: the kubelet's answer, still a body

    async def run() -> None:
        async with readyz_server(readyz) as server:
            overrides = tmp_path / "addresses.json"
            overrides.write_text(json.dumps({"agent-a": f"127.0.0.1:{server.port}"}))
            pods = [
                AgentAddress("uid-a", "agent-a", "10.0.0.1"),
                AgentAddress("uid-b", "agent-b", ""),  # no address: left out
                AgentAddress("uid-c", "agent-c", "127.0.0.1"),  # nobody answers on port 1: left out
            ]
            for _ in range(2):
                got = await read_reports(pods, 1, str(overrides))
                assert set(got) == {"uid-a"}
                engines = got["uid-a"].engines
                assert engines is not None and engines["decode-0"].phase == "Starting"
            assert hits == ["/readyz", "/readyz"]  # read again every time, not once per pod

    asyncio.run(run())


def test_a_slow_agent_keeps_its_last_word_for_two_reads_a_refused_one_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /readyz read that times out is told apart from one nobody answers; the operator acts on
    a slow agent's last word for SILENT_READS_TOLERATED reads in a row (a kubelet's failureThreshold
    of 3), then on none."""
    monkeypatch.setattr(agentstate, "READ_TIMEOUT_S", 0.2)
    slow = asyncio.Event()

    async def readyz(request: web.Request) -> web.Response:
        if slow.is_set():
            await asyncio.sleep(2)
        return web.json_response({"ready": True, "engines": [_engine("decode-0")]})

    async def run() -> None:
        async with readyz_server(readyz) as server:
            pods = [AgentAddress("uid-a", "agent-a", "127.0.0.1"), AgentAddress("uid-b", "agent-b", "127.0.0.2")]
            # uid-b: a loopback address where nobody listens on this port (refused at once).
            last: dict[str, AgentReport] = {}
            silent: dict[str, int] = {}
            reads = await read_agents(pods, server.port)
            assert set(reads.reports) == {"uid-a"} and reads.slow == frozenset()
            last = heard(["uid-a", "uid-b"], reads, last, silent)
            assert set(last) == {"uid-a"} and silent == {}
            slow.set()
            kept = []
            for _ in range(3):
                reads = await read_agents(pods, server.port)
                assert reads.reports == {} and reads.slow == {"uid-a"}
                last = heard(["uid-a", "uid-b"], reads, last, silent)
                kept.append(set(last))
            assert kept == [{"uid-a"}, {"uid-a"}, set()]  # the third slow read in a row is no word

    asyncio.run(run())


def test_heard_acts_on_answers_and_forgets_pods_no_longer_asked() -> None:
    word = AgentReport(True, None, {})
    newer = AgentReport(False, None, {})
    silent: dict[str, int] = {"gone": 1}
    slow_a = AgentReads({}, frozenset({"a"}))
    assert heard(["a"], slow_a, {"a": word}, silent) == {"a": word} and silent == {"a": 1}  # "gone" forgotten
    assert heard(["a"], AgentReads({"a": newer}, frozenset()), {"a": word}, silent) == {"a": newer}
    assert silent == {}  # an answer ends the run of slow reads
    assert heard(["a"], slow_a, {}, silent) == {}  # slow with no word before: none to keep
    assert heard(["a"], AgentReads({}, frozenset()), {"a": word}, silent) == {} and silent == {}  # refused
    assert agentstate.SILENT_READS_TOLERATED == 2
