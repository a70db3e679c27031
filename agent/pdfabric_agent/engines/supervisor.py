"""The serving engines of this node pod, run and watched by the agent (spec.engine).

The pod has one container: it holds every GPU of the node's ranks and runs the agent, and the
agent runs one engine process per engine group (``EngineLaunch``, from PDFABRIC_ENGINES) with
CUDA_VISIBLE_DEVICES naming that group's GPUs, so engines and agent share the devices (CUDA IPC)
and /dev/shm. The supervisor does for these processes what the kubelet did for engine
containers:

- environment: the agent's own minus what only the agent reads (``agent_only``), then the
  launch's env in order ($(VAR) expanded as the kubelet does; ``fromContainer`` entries take the
  variable the kubelet resolved a valueFrom into), then the engine contract (``contract_env``),
  then CUDA_VISIBLE_DEVICES; argv is expanded against that environment and its program looked up
  on its PATH (a missing one ends the run like an exit);
- output: each line of the engine's stdout and stderr goes to the agent's, prefixed ``[name] ``;
- health: GET health_path every probe period; Running (ready) on 200, Unhealthy (not ready) on a
  failure; killed when not healthy within startupSeconds, or failing for the liveness period after
  it was healthy;
- exit: ``on_exit(launch, how)`` first (the agent fails the engine's open rooms), then a restart
  after the kubelet's backoff (doubling to a cap, reset after a run of 10 minutes);
- stop: SIGTERM to every engine's process group, SIGKILL after the grace period;
- sandbox (spec.engine.sandbox): each engine starts through sandbox.py's launcher, which hides
  the peer TLS directory from it and everything it starts (``sandboxed_argv``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import aiohttp

from pdfabric_agent.engines import sandbox
from pdfabric_agent.engines.launch import (
    CVD,
    LaunchError,
    Timings,
    engine_argv,
    engine_env,
    sandboxed_argv,
)
from pdfabric_agent.runtime import metrics
from pdfabric_agent.runtime.config import AgentConfig
from pdfabric_core.engines.launch import EngineLaunch
from pdfabric_core.engines.state import EngineState
from pdfabric_core.spec import EngineSandbox

log = logging.getLogger("pdfabric.supervisor")

PROBE_TIMEOUT_S = 2.0  # a health answer slower than this is a failed probe
RELAY_DRAIN_S = 1.0  # after an exit, what is left in the pipes is relayed for at most this long
LINE_LIMIT = 1 << 20  # longer lines are relayed in pieces of this size

OnExit = Callable[[EngineLaunch, str], Awaitable[None] | None]


@dataclass
class _Engine:
    launch: EngineLaunch
    state: EngineState
    proc: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None
    exponent: int = 0  # backoff doublings so far
    delays: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))  # the last waits
    relays: list[asyncio.Task[None]] = field(default_factory=list)

    def set(self, **changes: Any) -> None:
        self.state = replace(self.state, **changes)


def _how(returncode: int) -> str:
    return f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """``sig`` to the engine's process group (it leads its own session): its workers too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class EngineSupervisor:
    """One engine process per launch: created with the agent (states "Waiting"), ``start`` once
    the agent is Ready (the engine door is open), ``stop`` before the agent closes."""

    def __init__(
        self,
        launches: Sequence[EngineLaunch],
        *,
        cluster: str,
        agent_address: str,
        token_file: str,
        shm_dir: str,
        timings: Timings | None = None,
        agent_env: Mapping[str, str] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        sandbox_mode: EngineSandbox = EngineSandbox.DISABLED,
        hidden: Sequence[str] = (),
    ) -> None:
        self.cluster = cluster
        self.sandbox_mode = sandbox_mode
        self.hidden = tuple(hidden)
        abi, self.sandbox_unavailable = (0, "") if sandbox_mode is EngineSandbox.DISABLED else sandbox.landlock_abi()
        # Whether the engines run sandboxed: what pdfabric_serving_engine_sandboxed says.
        self.sandboxed = abi >= 1 and bool(self.hidden)
        self.agent_address = agent_address
        self.token_file = token_file
        self.shm_dir = shm_dir
        self.timings = timings or Timings()
        self._agent_env = agent_env  # None: the agent's environment when start() runs
        self._stdout, self._stderr = stdout, stderr
        self._engines = [
            _Engine(x, EngineState(x.name, x.role, x.replica, phase="Waiting", ready=False, sandboxed=self.sandboxed))
            for x in launches
        ]
        self._on_exit: OnExit | None = None
        self._stopping = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        for x in launches:
            metrics.serving_engine_ready.labels(cluster, x.name, x.role.value).set(0)
            metrics.serving_engine_restarts.labels(cluster, x.name, x.role.value)
        if launches:
            metrics.serving_engine_sandboxed.labels(cluster).set(1 if self.sandboxed else 0)

    @classmethod
    def from_config(
        cls, cfg: AgentConfig, *, cluster: str, api_port: int, sandbox_mode: EngineSandbox
    ) -> EngineSupervisor:
        return cls(
            cfg.engines,
            cluster=cluster,
            agent_address=f"127.0.0.1:{api_port}",
            token_file=cfg.token_file,
            shm_dir=cfg.shm_dir,
            timings=Timings.from_config(cfg),
            sandbox_mode=sandbox_mode,
            hidden=[cfg.peer_tls_dir] if cfg.peer_tls_dir else [],
        )

    # ---------------------------------------------------------------- views
    def states(self) -> list[EngineState]:
        return [e.state for e in self._engines]

    @property
    def ready(self) -> bool:
        """Every engine serves (vacuously true without engines)."""
        return all(e.state.ready for e in self._engines)

    # ---------------------------------------------------------------- lifecycle
    def start(self, on_exit: OnExit | None = None) -> None:
        """Run every engine; ``on_exit(launch, how)`` is called after each exit, before the restart."""
        if self._session is not None:
            raise RuntimeError("the engine supervisor is already started")
        self._on_exit = on_exit
        if self._agent_env is None:
            self._agent_env = dict(os.environ)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._probe_timeout()))
        if self._engines and self.sandbox_mode is not EngineSandbox.DISABLED and not self.sandboxed:
            log.warning(
                "engine sandbox %s: %s; %s",
                self.sandbox_mode,
                self.sandbox_unavailable or "no peer TLS directory to hide",
                "the engines are not started"
                if self.sandbox_mode is EngineSandbox.REQUIRED
                else "engines run without it",
            )
        elif self.sandboxed:
            log.info("engines run in a Landlock sandbox without access to %s", ", ".join(self.hidden))
        for e in self._engines:
            e.task = asyncio.create_task(self._supervise(e), name=f"engine-{e.launch.name}")

    async def stop(self) -> None:
        """SIGTERM to every engine's process group, SIGKILL to those still there after the grace
        period; no restarts after this."""
        self._stopping.set()
        procs = [e.proc for e in self._engines if e.proc is not None and e.proc.returncode is None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        if procs:
            waits = asyncio.gather(*(p.wait() for p in procs))
            try:
                await asyncio.wait_for(asyncio.shield(waits), self.timings.grace_s)
            except TimeoutError:
                late = [p for p in procs if p.returncode is None]
                log.warning("engines %s still running after %g s: SIGKILL", [p.pid for p in late], self.timings.grace_s)
                for p in late:
                    _signal_group(p, signal.SIGKILL)
                await waits
        # Each engine's task now ends by itself (its process is gone, no restart follows); one
        # that does not (an exit handler stuck) is cancelled.
        tasks = [e.task for e in self._engines if e.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=RELAY_DRAIN_S + 1.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for e in self._engines:
            if e.proc is not None:
                _signal_group(e.proc, signal.SIGKILL)  # stragglers of a group whose leader is gone
            await self._drain(e)
            e.set(phase="Stopped", ready=False, pid=0)
            self._set_ready_metric(e)
        if self._session is not None:
            await self._session.close()

    # ---------------------------------------------------------------- one engine
    def _probe_timeout(self) -> float:
        return min(PROBE_TIMEOUT_S, self.timings.probe_s)

    def _set_ready_metric(self, e: _Engine) -> None:
        metrics.serving_engine_ready.labels(self.cluster, e.launch.name, e.launch.role.value).set(
            1 if e.state.ready else 0
        )

    async def _supervise(self, e: _Engine) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            e.set(phase="Starting", ready=False, pid=0)
            started = loop.time()
            try:
                how = await self._run_once(e)
            except LaunchError as exc:
                how = str(exc)
            except OSError as exc:  # exec itself failed (permissions, a bad interpreter line)
                how = f"cannot start {e.launch.argv[0]}: {exc.strerror or exc}"
            ran = loop.time() - started
            e.proc = None
            if self._stopping.is_set():
                return
            launch = e.launch
            e.set(ready=False, pid=0, restarts=e.state.restarts + 1, last_exit=how)
            self._set_ready_metric(e)
            metrics.serving_engine_restarts.labels(self.cluster, launch.name, launch.role.value).inc()
            log.warning("engine %s ended: %s (restart %d)", launch.name, how, e.state.restarts)
            await self._exited(launch, how)
            if ran >= self.timings.reset_after_s:
                e.exponent = 0
            delay = self.timings.backoff(e.exponent)
            e.delays.append(delay)
            e.exponent += 1
            e.set(phase="BackOff")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _exited(self, launch: EngineLaunch, how: str) -> None:
        if self._on_exit is None:
            return
        try:
            result = self._on_exit(launch, how)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("engine %s: the exit handler failed", launch.name)

    async def _run_once(self, e: _Engine) -> str:
        """One run: start, watch, and how it ended."""
        assert self._agent_env is not None
        launch = e.launch
        env = engine_env(
            launch, self._agent_env, agent_address=self.agent_address, token_file=self.token_file, shm_dir=self.shm_dir
        )
        argv = engine_argv(launch, env)
        if self.sandbox_mode is EngineSandbox.REQUIRED and not self.sandboxed:
            raise LaunchError(
                f"spec.engine.sandbox is Required, but {self.sandbox_unavailable or 'there is no peer TLS directory'}"
            )
        if self.sandboxed:
            argv = sandboxed_argv(sys.executable, self.hidden, self.sandbox_mode, argv)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=LINE_LIMIT,
        )
        e.proc = proc
        e.set(pid=proc.pid)
        log.info("engine %s started: pid %d, GPUs %s", launch.name, proc.pid, env[CVD])
        assert proc.stdout is not None and proc.stderr is not None
        prefix = f"[{launch.name}] "
        e.relays = [
            asyncio.create_task(self._relay(proc.stdout, prefix, self._stdout or sys.stdout)),
            asyncio.create_task(self._relay(proc.stderr, prefix, self._stderr or sys.stderr)),
        ]
        try:
            killed_for = await self._watch(e, proc)
        except asyncio.CancelledError:
            _signal_group(proc, signal.SIGKILL)
            raise
        returncode = await proc.wait()
        _signal_group(proc, signal.SIGKILL)  # what the engine left behind in its group goes with it
        await self._drain(e)
        how = _how(returncode)
        return f"{killed_for}, {how}" if killed_for else how

    async def _watch(self, e: _Engine, proc: asyncio.subprocess.Process) -> str:
        """Probe until the process exits (""), or kill it and say why."""
        loop = asyncio.get_running_loop()
        t = self.timings
        started = loop.time()
        failing_since: float | None = None
        was_ready = False
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=t.probe_s)
                if done or self._stopping.is_set():
                    return ""
                healthy = await self._probe(e.launch)
                if proc.returncode is not None or self._stopping.is_set():
                    return ""
                now = loop.time()
                if healthy:
                    failing_since, was_ready = None, True
                    if not e.state.ready:
                        e.set(phase="Running", ready=True)
                        self._set_ready_metric(e)
                        log.info("engine %s is healthy", e.launch.name)
                    continue
                if was_ready:
                    if e.state.ready:
                        e.set(phase="Unhealthy", ready=False)
                        self._set_ready_metric(e)
                        log.warning("engine %s failed its health probe", e.launch.name)
                    failing_since = now if failing_since is None else failing_since
                    if now - failing_since >= t.liveness_s:
                        why = f"unhealthy for {t.liveness_s:g} s"
                        break
                elif now - started >= e.launch.startup_seconds:
                    why = f"not healthy within {e.launch.startup_seconds} s (startupSeconds)"
                    break
        finally:
            if not exited.done():
                exited.cancel()
        log.warning("engine %s: %s, SIGKILL", e.launch.name, why)
        _signal_group(proc, signal.SIGKILL)
        return why

    async def _probe(self, launch: EngineLaunch) -> bool:
        assert self._session is not None
        url = f"http://127.0.0.1:{launch.port}{launch.health_path}"
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    @staticmethod
    async def _relay(stream: asyncio.StreamReader, prefix: str, out: TextIO) -> None:
        """Each line of the engine's stream to the agent's, prefixed; a line past the limit in
        pieces. Reads never block the loop; a write is one short call on the container's log."""
        while True:
            try:
                chunk = await stream.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                chunk = exc.partial  # the end: what is left, without a newline
            except asyncio.LimitOverrunError as exc:
                chunk = await stream.read(max(exc.consumed, 1))
            if not chunk:
                return
            text = chunk.decode("utf-8", errors="replace")
            with contextlib.suppress(OSError, ValueError):
                out.write(prefix + (text if text.endswith("\n") else text + "\n"))
                out.flush()

    async def _drain(self, e: _Engine) -> None:
        """The relays of the last run, to their end (bounded: a stray holding the pipe is killed)."""
        relays, e.relays = e.relays, []
        if not relays:
            return
        _, pending = await asyncio.wait(relays, timeout=RELAY_DRAIN_S)
        for r in pending:
            r.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
