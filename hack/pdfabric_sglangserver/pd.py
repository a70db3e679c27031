"""A PD deployment of SGLang's real servers as the tests run it: a prefill and a decode server of a
given parallel shape (``Shape``), over one of SGLang's own backends (Mooncake, NIXL: the controls) or
over pdfabric with real agents (moving the bytes with Mooncake or NIXL, ``FABRIC_MOVERS``), started
here or by the PDCluster's agents (``spec.engine``), SGLang's router in front.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfabric_agent.client.shm import remove_orphans
from pdfabric_devcluster.agents import LocalEngine
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.procs import free_port, post_json
from pdfabric_devcluster.sglang_router import SGLangRouter, sglang_router
from pdfabric_sglangserver.model import DEFAULT, Variant, spec_model_for_servers
from pdfabric_sglangserver.servers import (
    CONTROLS,
    CPU_ENV,
    PAGE_SIZE,
    STANDIN,
    START_TIMEOUT_S,
    SGLangServer,
    parallel_env,
    parallel_flags,
    server_args,
    server_argv,
    server_env,
    start_server,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SOURCES = ("core", "agent", "integrations/sglang")  # what a server started here imports
# The pdfabric backends of these tests by the library the agents move the bytes with (the
# PDCluster's ``backend``); the servers run SGLang's ``pdfabric`` backend under each.
FABRIC_MOVERS = {"pdfabric": "mooncake", "pdfabric-nixl": "nixl"}
# SGLang's NIXL control on loopback: UCX's tcp transport on ``lo``, without UCX's InfiniBand
# modules (whose libnl destructor crashed every process that made a UCX backend, at its exit).
NIXL_CONTROL_ENV = {"UCX_TLS": "tcp", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


def sglang_backend(backend: str) -> str:
    """The ``--disaggregation-transfer-backend`` a test backend's servers run."""
    return "pdfabric" if backend in FABRIC_MOVERS else backend


@dataclass(frozen=True)
class Shape:
    """The parallel shape of one PD pair: each server's TP and PP ranks, and the model variant."""

    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    model: Variant = DEFAULT

    @property
    def name(self) -> str:
        pp = f"pp{self.prefill_pp}" if self.prefill_pp > 1 else ""
        return f"p-tp{self.prefill_tp}{pp}-d-tp{self.decode_tp}-{self.model.name}"

    def ranks(self, role: str) -> int:
        return self.prefill_tp * self.prefill_pp if role == "prefill" else self.decode_tp

    def flags(self, role: str) -> list[str]:
        ranks = (
            parallel_flags(self.prefill_tp, self.prefill_pp) if role == "prefill" else parallel_flags(self.decode_tp)
        )
        return [*ranks, *self.model.server_flags]

    def fabric_spec(self, mover: str = "mooncake", **extra: Any) -> dict[str, Any]:
        """The PDCluster of this shape over tcp, its bytes moved by ``mover``."""
        return {
            "backend": mover,
            "prefill": {"tp": self.prefill_tp, "pp": self.prefill_pp},
            "decode": {"tp": self.decode_tp},
            "transfer": {"transport": "tcp", "timeoutSeconds": 20},
            "model": spec_model_for_servers(PAGE_SIZE, self.model),
            **extra,
        }


ONE_RANK = Shape()


@dataclass
class Server:
    """One PD server as the tests see it, however it runs: started by the test, or by its node's
    agent as the PDCluster's ``spec.engine``."""

    url: str
    healthy: Callable[[], bool]
    pid: Callable[[], int]  # the server's process now (0: none): a restart changes it
    tail: Callable[[], str]
    kill: Callable[[], object]  # ends it as a crash would
    recover: Callable[[], None]  # returns once it serves again (restarted by the test or its agent)


def started_here(server: SGLangServer) -> Server:
    def recover() -> None:
        server.restart()
        server.wait_healthy()

    def pid() -> int:
        return server.proc.pid if server.proc.poll() is None else 0

    return Server(server.url, server.healthy, pid, server.tail, server.kill, recover)


def started_by_agent(lc: LocalFabric, engine: LocalEngine) -> Server:
    def recover() -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the agent restarts it after its backoff; ready once it answers /health
            st = engine.state()
            if st is not None and st.ready and st.restarts >= 1 and engine.healthy():
                return
            assert time.monotonic() < deadline, f"the agent did not restart {engine.name}: {st}"
            time.sleep(1.0)

    def pid() -> int:
        st = engine.state()
        return st.pid if st is not None and st.pid else 0

    return Server(engine.url, engine.healthy, pid, lambda: lc.log(engine.agent.name)[-4000:], engine.kill, recover)


Endpoints = dict[str, list[dict[str, Any]]]
PairParts = tuple[Endpoints, Server, Server, "LocalFabric | None"]


@dataclass
class PD:
    backend: str
    prefill: Server
    decode: Server
    router: SGLangRouter
    fabric: LocalFabric | None  # pdfabric's agents (None for SGLang's own backends)
    bootstrap_port: int  # the prefill server's

    def generate(self, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
        return self.router.generate(body, timeout_s)

    def failure_logs(self) -> dict[str, str]:
        """Both servers' and the agents' log tails, for a failed test's report (tests/conftest.py)."""
        logs = {"prefill server": self.prefill.tail(), "decode server": self.decode.tail()}
        return {**logs, **(self.fabric.failure_logs() if self.fabric is not None else {})}

    def generate_direct(
        self, body: dict[str, Any], timeout_s: float = 120.0
    ) -> tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]]]:
        """One request posted to both servers as SGLang's router posts it (the bootstrap fields
        added), without the router's retries: the prefill server's answer and the decode server's."""
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port}
        body = {**body, **boot, "bootstrap_room": secrets.randbits(63)}
        with ThreadPoolExecutor(2) as pool:
            prefill = pool.submit(post_json, self.prefill.url + "/generate", body, timeout_s)
            decode = pool.submit(post_json, self.decode.url + "/generate", body, timeout_s)
            return prefill.result(), decode.result()


@contextlib.contextmanager
def pair_started_here(
    backend: str, model_dir: Path, installed_site: Path, logs: Path, shape: Shape = ONE_RANK
) -> Iterator[PairParts]:
    """Prefill and decode servers started here, over one of SGLang's own backends or over pdfabric
    with agents started here (an engine deployed by something else attached to its node's agent).
    A server of several ranks is one server: SGLang starts a scheduler process per rank, and each
    rank registers with the agent of its node."""
    fabric = None
    extra_path: list[str] = []
    envs: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    servers: dict[str, SGLangServer] = {}
    try:
        if backend == "nixl":
            envs = {role: dict(NIXL_CONTROL_ENV) for role in envs}
        if backend in FABRIC_MOVERS:
            fabric = LocalFabric(shape.fabric_spec(FABRIC_MOVERS[backend])).__enter__()
            token = logs / "engine-token"
            token.write_text(fabric.token)
            extra_path = [str(installed_site), *(str(ROOT / p) for p in ENGINE_SOURCES)]
            for role, rank_id in (("prefill", "prefill-0-tp0-cp0"), ("decode", "decode-0-tp0")):
                envs[role] = {
                    "PDFABRIC_ENGINE_TOKEN_FILE": str(token),
                    "PDFABRIC_AGENT_ADDRESS": fabric.agents[fabric.agent_of(rank_id)].address,
                    "PDFABRIC_REPLICA": "0",
                    "PDFABRIC_SHM_DIR": fabric.shm_dir,
                    "SGLANG_PLUGINS": "pdfabric",
                }
        for role in ("prefill", "decode"):
            port, boot = free_port(), free_port() if role == "prefill" else 0
            argv = server_argv(
                model_dir,
                port,
                mode=role,
                backend=sglang_backend(backend),
                bootstrap_port=boot,
                extra=shape.flags(role),
            )
            base = {**os.environ, **envs[role]}
            env = server_env(base, extra_path, control=backend in CONTROLS, ranks=shape.ranks(role))
            servers[role] = start_server(f"{backend}-{role}", argv, env, logs / f"{role}.log", port, boot)
        for server in servers.values():
            server.wait_healthy()
        endpoints = {
            "prefill": [{"url": servers["prefill"].url, "bootstrapPort": servers["prefill"].bootstrap_port}],
            "decode": [{"url": servers["decode"].url}],
        }
        yield endpoints, started_here(servers["prefill"]), started_here(servers["decode"]), fabric
    finally:
        for server in servers.values():
            server.stop()
        if fabric is not None:
            remove_orphans(fabric.shm_dir)  # the servers' pools (SGLang ends its scheduler with SIGKILL)
            fabric.keep_logs(logs)  # beside the servers' logs
            fabric.close()


@contextlib.contextmanager
def pair_started_by_agents(model_dir: Path, installed_site: Path, shape: Shape = ONE_RANK) -> Iterator[PairParts]:
    """The PDCluster runs SGLang's servers itself (``spec.engine``): each node pod's agent starts
    its role's server with the PDCluster's command, restarts it when it dies, and the server
    registers its memory through the agent's engine door."""
    command = ["python", "-m", "sglang.launch_server"]
    roles = {}
    for role in ("prefill", "decode"):
        env_vars = {**CPU_ENV, **parallel_env(shape.ranks(role)), "SGLANG_PLUGINS": "pdfabric"}
        env = [{"name": k, "value": v} for k, v in env_vars.items()]
        args = server_args(model_dir, "$(PDFABRIC_PORT)", mode=role, backend="pdfabric",
                           bootstrap_port="$(PDFABRIC_BOOTSTRAP_PORT)", extra=shape.flags(role))  # fmt: skip
        roles[role] = {"command": command, "args": args, "env": env}
    spec = shape.fabric_spec(engine={"image": "sglang-pdfabric:local", **roles})
    agent_env = {"PDFABRIC_ENGINE_BACKOFF_S": "1", "PDFABRIC_ENGINE_BACKOFF_MAX_S": "2"}
    lc = LocalFabric(spec, env=agent_env, engine_pythonpath=[str(installed_site), str(STANDIN)])
    try:
        lc.start(wait_s=START_TIMEOUT_S)  # Ready: the agents and their servers
        (pe,) = [e for (_, name), e in lc.engines.items() if name == "prefill-0"]
        (de,) = [e for (_, name), e in lc.engines.items() if name == "decode-0"]
        endpoints = {"prefill": [{"url": pe.url, "bootstrapPort": pe.bootstrap_port}], "decode": [{"url": de.url}]}
        yield endpoints, started_by_agent(lc, pe), started_by_agent(lc, de), lc
    finally:
        lc.close()
        remove_orphans(lc.shm_dir)


@contextlib.contextmanager
def behind_router(backend: str, pair: contextlib.AbstractContextManager[PairParts], logs: Path) -> Iterator[PD]:
    """``pair``'s servers with SGLang's router in front, once it routes."""
    with pair as (endpoints, prefill, decode, fabric):
        # Health checks every 5 s (60 s by default): a restarted worker is taken back sooner. No
        # retries: a request answers with the failure its servers gave, at once. SGLang's router
        # retries a PD request whose decode server died, and that retry is held until the client
        # gives up (seen with both backends), which cost each kill case a minute per backend.
        flags = ("--health-check-interval-secs", "5", "--disable-retries")
        with sglang_router(endpoints, logs / "router.log", extra=flags, wait_s=120) as router:
            router.wait_healthy(120, ready=True)
            yield PD(backend, prefill, decode, router, fabric, endpoints["prefill"][0]["bootstrapPort"])


EXAMPLE = ROOT / "examples" / "sglang" / "pdcluster-sglang-cpu.yaml"


def example_pdcluster(model_dir: Path) -> dict[str, Any]:
    """examples/sglang's PDCluster with this machine's two values filled in: the model directory,
    and the test stand-in for SGLang's CPU kernels on the servers' PYTHONPATH ($(PYTHONPATH) there
    is the image's own, expanded by the agent)."""
    import yaml

    text = EXAMPLE.read_text().replace("${MODEL_DIR}", str(model_dir))
    doc: dict[str, Any] = yaml.safe_load(text.replace("${SGL_KERNEL_STANDIN}", str(STANDIN)))
    return doc


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer.get("output_ids") or [])
