"""A PD deployment of vLLM's real servers as the tests run it: a prefill and a decode server over
pdfabric (real agents on loopback tcp, ``pdfabric_devcluster.fabric.LocalFabric``) or over vLLM's
own NixlConnector (the control), vLLM's router (``vllm-router --vllm-pd-disaggregation``) in
front. The router speaks vLLM's P/D protocol (prefill with ``do_remote_decode`` and one token,
its ``kv_transfer_params`` to decode), which carries pdfabric's room as it carries NIXL's blocks."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfabric_agent.client.shm import remove_orphans
from pdfabric_devcluster.agents import LocalImage
from pdfabric_devcluster.fabric import LocalFabric
from pdfabric_devcluster.procs import FAILURE_LOG_CHARS, answers_200, file_tail, free_port, post_json
from pdfabric_sglangserver.model import spec_model
from pdfabric_sglangserver.servers import CONTROLS_CPU
from pdfabric_vllmserver.servers import (
    BLOCK_SIZE,
    ENGINE_SOURCES,
    MODEL,
    NIXL_ENV,
    PD_ENV,
    ROOT,
    VllmServer,
    completion,
    nixl_kv_config,
    pdfabric_kv_config,
    start_server,
)

CONNECTORS = ("pdfabric", "nixl")
ROUTER_START_S = 60.0


@dataclass(frozen=True)
class Shape:
    """Each server's TP size (a worker process per rank)."""

    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def name(self) -> str:
        return f"p-tp{self.prefill_tp}-d-tp{self.decode_tp}"

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def fabric_spec(self) -> dict[str, Any]:
        """The PDCluster of one prefill and one decode replica of the test model, over tcp."""
        return {
            "prefill": {"tp": self.prefill_tp},
            "decode": {"tp": self.decode_tp},
            "transfer": {"transport": "tcp", "timeoutSeconds": 20},
            "model": spec_model(BLOCK_SIZE, MODEL),
        }


ONE_RANK = Shape()


@dataclass
class VllmPD:
    connector: str
    prefill: VllmServer
    decode: VllmServer
    router_url: str
    fabric: LocalFabric | None  # pdfabric's agents (None for NIXL)
    router_log: Path | None = None

    def complete(self, body: Mapping[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
        return post_json(self.router_url + "/v1/completions", dict(body), timeout_s)

    def failure_logs(self) -> dict[str, str]:
        """Both servers', the router's and the agents' log tails, for a failed test's report."""
        logs = {**self.prefill.failure_logs(), **self.decode.failure_logs()}
        if self.router_log is not None:
            logs["vllm-router"] = file_tail(self.router_log, FAILURE_LOG_CHARS)
        return {**logs, **(self.fabric.failure_logs() if self.fabric is not None else {})}


@contextlib.contextmanager
def pair(
    connector: str, python: str, model_dir: Path, logs: Path, shape: Shape = ONE_RANK
) -> Iterator[tuple[VllmServer, VllmServer, LocalFabric | None]]:
    """Prefill and decode servers over ``connector``, healthy; the agents too for pdfabric. A server
    of several TP ranks is one server whose workers each register with their replica's agent."""
    fabric: LocalFabric | None = None
    servers: dict[str, VllmServer] = {}
    try:
        envs: dict[str, dict[str, str]] = {}
        pythonpath: list[str] = []
        if connector == "pdfabric":
            fabric = LocalFabric(shape.fabric_spec()).__enter__()
            token = logs / "engine-token"
            token.write_text(fabric.token)
            pythonpath = [str(ROOT / p) for p in ENGINE_SOURCES]
            for role, rank in (("prefill", "prefill-0-tp0-cp0"), ("decode", "decode-0-tp0")):
                envs[role] = {
                    "PDFABRIC_ENGINE_TOKEN_FILE": str(token),
                    "PDFABRIC_AGENT_ADDRESS": fabric.agents[fabric.agent_of(rank)].address,
                    "PDFABRIC_REPLICA": "0",
                    "PDFABRIC_SHM_DIR": fabric.shm_dir,
                }
        else:
            envs = {
                role: {**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} for role in ("prefill", "decode")
            }
            pythonpath = [str(CONTROLS_CPU)]  # NIXL's progress thread waiting for events
        for role in ("prefill", "decode"):
            config = pdfabric_kv_config(role) if connector == "pdfabric" else nixl_kv_config(role)
            servers[role] = start_server(
                f"{connector}-{role}", python, model_dir, logs / f"{role}.log",
                kv_config=config, env={**PD_ENV, **envs[role]}, pythonpath=pythonpath, tp=shape.tp(role),
            )  # fmt: skip
        for server in servers.values():
            server.wait_healthy()
        yield servers["prefill"], servers["decode"], fabric
    finally:
        for server in servers.values():
            server.stop()
        if fabric is not None:
            remove_orphans(fabric.shm_dir)  # the servers' KV files, if a server was killed
            fabric.keep_logs(logs)  # beside the servers' logs
            fabric.close()


@contextlib.contextmanager
def router(python: str, prefill: VllmServer, decode: VllmServer, log: Path) -> Iterator[str]:
    """vllm-router in P/D mode before the pair; yields its URL once it answers /health."""
    port = free_port()
    argv = [
        str(Path(python).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
        "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
        "--kv-connector", "nixl", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_S
        while not answers_200(url + "/health", 2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


# How many tries the pair's first request gets before the pair is ready. vLLM's NixlConnector gives
# its first handshake with a peer 5 s (a ZMQ receive timeout in nixl/base_worker.py
# _nixl_handshake): in run 16, on two cores its own polling threads keep busy, it timed out and the
# request failed 500 (decode's log: "NIXL transfer failure: handshake_setup_failed"); its next
# request handshakes again. pdfabric's pair must answer its first request.
FIRST_REQUEST_TRIES = {"pdfabric": 1, "nixl": 3}


def warm(pd: VllmPD) -> None:
    """The pair answers one request through the router before a test uses it (its P/D handshake
    made), within ``FIRST_REQUEST_TRIES``; raises with every answer otherwise."""
    answers = []
    for _ in range(FIRST_REQUEST_TRIES[pd.connector]):
        status, body = pd.complete(completion(list(range(1, 9)), 2))
        if status == 200:
            return
        answers.append((status, body))
    raise RuntimeError(f"the {pd.connector} pair answered no first request: {answers}")


@contextlib.contextmanager
def behind_router(
    connector: str, python: str, model_dir: Path, logs: Path, shape: Shape = ONE_RANK
) -> Iterator[VllmPD]:
    router_log = logs / "router.log"
    with (
        pair(connector, python, model_dir, logs, shape) as (prefill, decode, fabric),
        router(python, prefill, decode, router_log) as url,
    ):
        pd = VllmPD(connector, prefill, decode, url, fabric, router_log)
        warm(pd)
        yield pd


EXAMPLE = ROOT / "examples" / "vllm" / "pdcluster-vllm-cpu.yaml"


def example_pdcluster(model_dir: Path) -> dict[str, Any]:
    """examples/vllm's PDCluster with this machine's model directory filled in."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text().replace("${MODEL_DIR}", str(model_dir)))
    return doc


def example_images(doc: Mapping[str, Any], python: str) -> dict[str, LocalImage]:
    """What PodRunner runs the example's engine and router images as on this machine: vLLM's own
    environment (vLLM and this project pin different torch releases)."""
    vllm = LocalImage(python=python)
    return {doc["spec"]["engine"]["image"]: vllm, doc["spec"]["router"]["image"]: vllm}
