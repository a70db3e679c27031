"""vLLM's real server (``python -m vllm.entrypoints.openai.api_server``) as the tests start it, from
its own environment (``hack/vllm/venv.sh``: vLLM and SGLang pin different torch releases), on a small
Llama with seeded weights (``pdfabric_sglangserver.model``, head_dim 32: vLLM's CPU attention takes
no smaller), float32, eager, a KV cache of ``NUM_BLOCKS`` pages of ``BLOCK_SIZE`` tokens.

As a PD server, ``--kv-transfer-config`` names pdfabric's connector (``pdfabric_vllm.connector``,
on the server's PYTHONPATH with the engine-side client) or vLLM's NixlConnector (the control:
``kv_buffer_device: cpu``, UCX over tcp/cma/shared memory, a side-channel port per server)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pdfabric_devcluster.procs import free_port, post_json
from pdfabric_sglangserver.model import Variant
from pdfabric_sglangserver.servers import SGLangServer, wait_for_memory

ROOT = Path(__file__).resolve().parents[2]
VENV_SCRIPT = ROOT / "hack" / "vllm" / "venv.sh"
MODEL = Variant(dtype="float32", head_dim=32)  # vLLM's CPU attention refuses head_dim 16
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
NUM_BLOCKS = 256  # 8,192 tokens of KV per server: far more than the tests use, 8 MiB per layer
MAX_MODEL_LEN = 1024
ENGINE_SOURCES = ("core", "agent", "integrations/vllm")  # what a pdfabric server imports from here
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # One OpenMP thread per server, unbound: vLLM binds its worker's threads to every core it finds,
    # and with three servers on two cores one took 48 s to start, 34 s unbound.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}
# A PD server logs vLLM's stats every 2 s while it works, its connector's among them ("KV Transfer
# metrics: ..."), at INFO.
PD_ENV = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOG_STATS_INTERVAL": "2"}
# NIXL's UCX: tcp, cross-memory attach and shared memory; its InfiniBand module unloaded (libnl's
# destructor crashes the process at exit without RDMA devices).
# NIXL's servers spun while up (NIXL's progress thread polls without a pause by default): a TP 1
# pair used 1.99 of two cores with no request. With the thread waiting for UCX's events (the
# controls' sitecustomize, ``pdfabric_sglangserver.servers.CONTROLS_CPU``, on the control's
# PYTHONPATH) an idle pair took 1.7 s of CPU in 10 s, 15.8 s without. At a lower CPU priority its
# servers missed vLLM's 5 s handshake deadline (hard-coded) on a busy machine; they run at the
# suite's priority, and the control runs one pair (docs/vllm.md).
NIXL_ENV = {"UCX_TLS": "tcp,cma,self,sm", "UCX_MODULES": "^ib*"}


def vllm_python() -> str:
    """The vLLM environment's python, made (once, cached outside the repo) when missing."""
    out = subprocess.run(["bash", str(VENV_SCRIPT)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def pdfabric_kv_config(role: str) -> dict[str, Any]:
    return {
        "kv_connector": "PdfabricConnector",
        "kv_connector_module_path": "pdfabric_vllm.connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }


def nixl_kv_config(role: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }


def server_argv(
    python: str, model_dir: Path, port: int, kv_config: Mapping[str, Any] | None = None, tp: int = 1
) -> list[str]:
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "model",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--max-num-seqs", "32", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if tp > 1:  # a worker process per rank, as on GPUs
        argv += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_config))]
    else:
        argv += ["--disable-log-stats"]
    return argv


@dataclass
class VllmServer(SGLangServer):
    """One running vLLM server: the test harness's server process (health, log, stop, kill), with
    vLLM's start and its OpenAI completions endpoint."""

    LABEL: ClassVar[str] = "vllm server"
    ENGINE: ClassVar[str] = "vLLM"

    def complete(self, body: Mapping[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
        return post_json(self.url + "/v1/completions", dict(body), timeout_s)

    def restart(self) -> None:
        """Stop and start the same command (same port): a crashed or killed server coming back."""
        self.stop()
        wait_for_memory()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.log.parent, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip


def start_server(
    name: str, python: str, model_dir: Path, log: Path, *, kv_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None, pythonpath: Sequence[str] = (), tp: int = 1,
) -> VllmServer:  # fmt: skip
    """Start a server in its own process group, in its log's folder, once the memory it needs is free."""
    wait_for_memory()
    port = free_port()
    full_env = {**os.environ, **CPU_ENV, **(env or {})}
    full_env.pop("PYTHONPATH", None)
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    argv = server_argv(python, model_dir, port, kv_config, tp)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, env=full_env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return VllmServer(name, port, proc, log, argv, full_env)


def completion(prompt: Sequence[int], new_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body of exactly ``new_tokens`` tokens that returns its token ids."""
    return {
        "model": "model", "prompt": list(prompt), "max_tokens": new_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def token_ids(answer: Mapping[str, Any]) -> list[int]:
    choices = answer.get("choices") or [{}]
    return list(choices[0].get("token_ids") or [])
