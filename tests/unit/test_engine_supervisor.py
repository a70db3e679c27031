"""The agent's engine supervisor (supervisor.py) with real child processes: the environment an
engine gets, ready on its health answer, restarts with backoff and the agent told before each,
kills for startup and liveness, a missing program, and stop taking the whole process group."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from pdfabric_agent.engines.launch import LaunchError, Timings, engine_argv, engine_env, visible_devices
from pdfabric_agent.engines.supervisor import EngineSupervisor
from pdfabric_agent.http.server import Readiness
from pdfabric_agent.runtime import metrics
from pdfabric_core.engines.launch import EngineLaunch, EnvEntry, hoisted_name
from pdfabric_core.engines.state import EngineState
from pdfabric_core.policy.types import Role
from pdfabric_devcluster.procs import free_port

PY = sys.executable
FAST = Timings(probe_s=0.05, liveness_s=0.3, backoff_s=0.1, backoff_max_s=0.4, grace_s=1.0)

# A health server on argv[1]; /health answers 500 while the file argv[3] exists. It dumps its
# environment and argv to argv[2] first.
HEALTH_SERVER = """
import http.server, json, os, sys
port, dump, sick = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(dump, "w") as fh:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, fh)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(500 if os.path.exists(sick) or self.path != "/health" else 200)
        self.end_headers()
    def log_message(self, *args):
        pass
print("serving on", port, flush=True)
print("a line on stderr", file=sys.stderr, flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
EXIT_3 = "import sys; print('bye', flush=True); sys.exit(3)"
NEVER_HEALTHY = "import time; time.sleep(60)"
# Ignores SIGTERM, starts a worker in its process group and writes the worker's pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(60)
"""


def launch(argv: list[str], *, port: int = 1, startup: int = 30, env: tuple[EnvEntry, ...] = (),
           gpus: tuple[int, ...] = (0,), name: str = "prefill-0") -> EngineLaunch:  # fmt: skip
    return EngineLaunch(
        name=name, role=Role.PREFILL, replica=0, rank_ids=("prefill-0-tp0-cp0",), gpus=gpus, argv=tuple(argv),
        env=env, port=port, bootstrap_port=port + 1, health_path="/health", startup_seconds=startup,
        tp=1, pp=1, cp=1, cp_rank=0,
    )  # fmt: skip


def agent_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath), **extra}


def supervisor(x: EngineLaunch, timings: Timings = FAST, **env: str) -> EngineSupervisor:
    return EngineSupervisor(
        [x], cluster="c", agent_address="127.0.0.1:7400", token_file="/run/token", shm_dir="/dev/shm",
        timings=timings, agent_env=agent_env(**env), stdout=io.StringIO(), stderr=io.StringIO(),
    )  # fmt: skip


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def sample(name: str, engine: str = "prefill-0") -> float | None:
    return metrics.REGISTRY.get_sample_value(name, {"pdcluster": "c", "engine": engine, "role": "prefill"})


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    def write(text: str) -> str:
        path = tmp_path / f"child{len(list(tmp_path.glob('child*')))}.py"
        path.write_text(text)
        return str(path)

    yield write


# ------------------------------------------------------------------ environment
def test_the_engine_environment_drops_agent_variables_and_adds_the_contract() -> None:
    hf = hoisted_name(Role.PREFILL, "HF_TOKEN")
    env = (
        EnvEntry("A", "x-$(HOME)"),
        EnvEntry("B", "$(A)/$(UNDEFINED)/$$(HOME)"),
        EnvEntry("HF_TOKEN", from_container=hf),
        EnvEntry("UNSET", from_container=hoisted_name(Role.PREFILL, "UNSET")),
    )
    x = launch(["python3"], port=30000, env=env, gpus=(1,))
    agent = {
        "HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "2,3", hf: "secret",
        "PDFABRIC_RANKMAP": "/etc/rankmap.json", "PDFABRIC_PEERS": "{}", "PDFABRIC_PEER_TLS_DIR": "/tls",
        "PDFABRIC_ENGINES": "[]", "PDFABRIC_LOG_LEVEL": "DEBUG", "PDFABRIC_ENGINE_PROBE_S": "1",
    }  # fmt: skip
    got = engine_env(x, agent, agent_address="127.0.0.1:7400", token_file="/run/token", shm_dir="/dev/shm")
    assert not {k for k in got if k.startswith(("PDFABRIC_ENV_", "PDFABRIC_RANKMAP", "PDFABRIC_PEER"))}
    assert not {"PDFABRIC_ENGINES", "PDFABRIC_LOG_LEVEL", "PDFABRIC_ENGINE_PROBE_S"} & set(got)
    assert (got["A"], got["B"], got["HF_TOKEN"]) == ("x-/home/u", "x-/home/u/$(UNDEFINED)/$(HOME)", "secret")
    assert "UNSET" not in got and got["HOME"] == "/home/u"
    contract = x.contract_env("127.0.0.1:7400", "/run/token", "/dev/shm")
    assert {k: got[k] for k in contract} == contract
    assert contract["PDFABRIC_PORT"] == "30000" and contract["PDFABRIC_ENGINE_TOKEN_FILE"] == "/run/token"
    assert got["CUDA_VISIBLE_DEVICES"] == "3"  # GPU 1 of the agent's "2,3"


def test_visible_devices_and_argv() -> None:
    assert visible_devices((0, 2), None) == "0,2"
    assert visible_devices((1, 0), "GPU-a, GPU-b") == "GPU-b,GPU-a"
    with pytest.raises(LaunchError, match="GPU 2 is not among"):
        visible_devices((2,), "4,5")
    x = launch(["sh", "--port=$(PDFABRIC_PORT)", "$$(PDFABRIC_PORT)"], port=31000)
    env = {"PATH": os.environ["PATH"], "PDFABRIC_PORT": "31000"}
    assert engine_argv(x, env) == [shutil.which("sh"), "--port=31000", "$(PDFABRIC_PORT)"]
    with pytest.raises(LaunchError, match="command not found: no-such-engine"):
        engine_argv(launch(["no-such-engine"]), env)
    with pytest.raises(LaunchError, match="command not found: /nonexistent/engine"):
        engine_argv(launch(["/nonexistent/engine"]), env)


def test_backoff_doubles_to_its_cap() -> None:
    t = Timings(backoff_s=10, backoff_max_s=300)
    assert [t.backoff(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]


# ------------------------------------------------------------------ lifecycle
def test_an_engine_is_ready_once_healthy_with_its_environment_and_output_relayed(
    tmp_path: Path, script: Callable[[str], str]
) -> None:
    port, dump = free_port(), tmp_path / "dump.json"
    x = launch([PY, script(HEALTH_SERVER), "$(PDFABRIC_PORT)", str(dump), str(tmp_path / "sick")], port=port)
    sup = supervisor(x, PDFABRIC_RANKMAP="/etc/rankmap.json", CUDA_VISIBLE_DEVICES="5")
    readiness = Readiness(ready=True, reason="Ready", engines=sup.states)

    async def go() -> None:
        assert [s.phase for s in sup.states()] == ["Waiting"]
        assert readiness.body()[1] is False
        sup.start()
        await until(lambda: sup.ready)
        state = sup.states()[0]
        assert (state.phase, state.ready, state.restarts) == ("Running", True, 0) and state.pid > 0
        assert sample("pdfabric_serving_engine_ready") == 1
        body, ready = readiness.body()
        assert ready and body["enginesReady"] is True and body["engines"] == [state.to_json()]
        await sup.stop()
        assert gone(state.pid) and sup.states()[0].phase == "Stopped"
        assert sample("pdfabric_serving_engine_ready") == 0

    run(go())
    seen = json.loads(dump.read_text())
    assert seen["argv"][1] == str(port)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5" and seen["env"]["PDFABRIC_PORT"] == str(port)
    assert "PDFABRIC_RANKMAP" not in seen["env"]
    assert f"[prefill-0] serving on {port}\n" in sup._stdout.getvalue()  # type: ignore[union-attr]
    assert "[prefill-0] a line on stderr\n" in sup._stderr.getvalue()  # type: ignore[union-attr]


def test_an_exit_tells_the_agent_first_then_restarts_with_backoff(script: Callable[[str], str]) -> None:
    sup = supervisor(launch([PY, script(EXIT_3)]), Timings(probe_s=0.05, backoff_s=0.2, backoff_max_s=0.4))
    calls: list[tuple[str, str, float, EngineState]] = []

    async def exited(x: EngineLaunch, how: str) -> None:
        calls.append((x.name, how, time.monotonic(), sup.states()[0]))

    async def go() -> None:
        before = sample("pdfabric_serving_engine_restarts_total") or 0
        sup.start(exited)
        await until(lambda: len(calls) >= 3)
        assert sup.states()[0].phase in ("BackOff", "Starting")
        await sup.stop()
        assert (sample("pdfabric_serving_engine_restarts_total") or 0) - before == sup.states()[0].restarts

    run(go())
    assert {(name, how) for name, how, _, _ in calls} == {("prefill-0", "exit code 3")}
    # Told before the restart: the run is counted, its process gone, no new one yet.
    assert [(s.restarts, s.pid, s.last_exit) for *_, s in calls[:3]] == [(n, 0, "exit code 3") for n in (1, 2, 3)]
    # 0.2 s, then doubled to the 0.4 s cap; the wall clock agrees from below (a loaded machine
    # starts the process late, never early).
    assert list(sup._engines[0].delays)[:2] == [0.2, 0.4]
    gaps = [b[2] - a[2] for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4
    assert "[prefill-0] bye\n" in sup._stdout.getvalue()  # type: ignore[union-attr]


def test_a_long_run_resets_the_backoff(script: Callable[[str], str]) -> None:
    child = script("import sys, time; time.sleep(0.25); sys.exit(1)")
    t = Timings(probe_s=0.05, backoff_s=0.1, backoff_max_s=10, reset_after_s=0.2)
    sup = supervisor(launch([PY, child]), t)
    ends: list[float] = []

    async def go() -> None:
        sup.start(lambda x, how: ends.append(time.monotonic()))
        await until(lambda: len(ends) >= 4, timeout=8)
        await sup.stop()

    run(go())
    # Each run >= reset_after_s: the delay stays 0.1 s, never 0.2, 0.4, 0.8.
    assert list(sup._engines[0].delays)[:3] == [0.1, 0.1, 0.1]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    assert min(gaps) >= 0.25 + 0.1  # each run's sleep and its delay


def test_an_engine_not_healthy_within_startup_seconds_is_killed(script: Callable[[str], str]) -> None:
    sup = supervisor(launch([PY, script(NEVER_HEALTHY)], port=free_port(), startup=1))
    hows: list[str] = []

    async def go() -> None:
        sup.start(lambda x, how: hows.append(how))
        await until(lambda: bool(hows), timeout=5)
        await sup.stop()

    run(go())
    assert hows[0] == f"not healthy within 1 s (startupSeconds), killed by signal {int(signal.SIGKILL)}"
    assert sup.states()[0].last_exit == hows[0]


def test_an_engine_failing_its_probes_after_it_was_ready_is_unhealthy_then_killed(
    tmp_path: Path, script: Callable[[str], str]
) -> None:
    port, sick = free_port(), tmp_path / "sick"
    sup = supervisor(launch([PY, script(HEALTH_SERVER), str(port), str(tmp_path / "d"), str(sick)], port=port))
    hows: list[str] = []
    phases: list[str] = []

    async def go() -> None:
        sup.start(lambda x, how: hows.append(how))
        await until(lambda: sup.ready)
        sick.touch()
        await until(lambda: sup.states()[0].phase == "Unhealthy")
        phases.append(sup.states()[0].phase)
        assert not sup.ready and sample("pdfabric_serving_engine_ready") == 0
        await until(lambda: bool(hows))
        sick.unlink()
        await until(lambda: sup.ready)  # restarted and healthy again
        await sup.stop()

    run(go())
    assert hows[0] == f"unhealthy for 0.3 s, killed by signal {int(signal.SIGKILL)}"
    assert sup.states()[0].restarts == 1


def test_a_missing_program_is_an_exit_reason_not_a_crash() -> None:
    sup = supervisor(launch(["no-such-engine-binary", "--flag"]))
    hows: list[str] = []

    async def go() -> None:
        sup.start(lambda x, how: hows.append(how))
        await until(lambda: len(hows) >= 2)
        await sup.stop()

    run(go())
    assert hows[:2] == ["command not found: no-such-engine-binary"] * 2
    assert sup.states()[0].last_exit == "command not found: no-such-engine-binary"


def test_stop_terminates_then_kills_the_whole_process_group(tmp_path: Path, script: Callable[[str], str]) -> None:
    pid_file = tmp_path / "worker.pid"
    sup = supervisor(launch([PY, script(STUBBORN), str(pid_file)]), Timings(probe_s=0.05, grace_s=0.3))
    hows: list[str] = []

    async def go() -> None:
        sup.start(lambda x, how: hows.append(how))
        await until(lambda: pid_file.exists() and pid_file.read_text() != "")
        leader, worker = sup.states()[0].pid, int(pid_file.read_text())
        t0 = time.monotonic()
        await sup.stop()
        assert time.monotonic() - t0 >= 0.3  # SIGTERM ignored: SIGKILL after the grace period
        await until(lambda: gone(leader) and gone(worker), timeout=2)

    run(go())
    assert hows == [] and sup.states()[0].restarts == 0  # a stop is no exit to report, nor restarted


def test_readyz_body_without_engines_is_unchanged() -> None:
    body, ready = Readiness(ready=True, reason="Ready", message="m").body()
    assert (body, ready) == ({"ready": True, "reason": "Ready", "message": "m"}, True)
    waiting = EngineState("decode-0", Role.DECODE, 0, "Running", True)
    sick = EngineState("decode-1", Role.DECODE, 1, "Unhealthy", False, restarts=2)
    body, ready = Readiness(ready=True, engines=lambda: [waiting, sick]).body()
    assert not ready and body["ready"] is True and body["enginesReady"] is False
    assert [EngineState.from_json(e) for e in body["engines"]] == [waiting, sick]
    _, ready = Readiness(ready=False, engines=lambda: [waiting]).body()
    assert not ready
