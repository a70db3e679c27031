"""SGLang's real server (``python -m sglang.launch_server``) on this CPU machine, as tests and the demo
start it: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) on a small Llama with seeded weights
(``model.write_model_dir``), as a single server or as a PD prefill or decode server over any
transfer backend (pdfabric, or SGLang's own Mooncake and NIXL backends as the controls).

What keeps SGLang's CPU path off CUDA (../shared/docs/SGLANG.md has the reasons):
``--disaggregation-decode-retraction-backup cpu_tensor`` on decode (its default backup host-registers
memory), ``--disable-overlap-schedule`` on prefill (it records a CUDA event for a repeated prompt),
and, for SGLang's own backends, the changes of ``hack/controls_cpu/sitecustomize.py`` (Mooncake's
host-tensor-indices path off; NIXL's KV registered as host memory). The ``sgl_kernel`` stand-in (``standin/``) is on every server's
PYTHONPATH: test code, documented there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from pdfabric_devcluster.procs import FAILURE_LOG_CHARS, answers_200, file_tail, post_json
from pdfabric_devcluster.timings import record, timed

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "standin"  # the sgl_kernel stand-in
CONTROLS_CPU = HERE.parent / "controls_cpu"  # a sitecustomize for the engines' own backends on CPU
CONTROLS = ("mooncake", "nixl")  # SGLang's own transfer backends, the controls of pdfabric's

PAGE_SIZE = 16
START_TIMEOUT_S = 420.0  # 72-123 s on 2 idle cores; CI's machine is busier
# A server's processes hold about 1.5 GB here once loaded. Two test workers start servers side by
# side (make test), so a start first waits, up to MEMORY_WAIT_S, until this much memory is free.
SERVER_MEMORY_GIB = 3.0
MEMORY_WAIT_S = 600.0

CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens", "4096",
    "--mem-fraction-static", "0.05",
    "--random-seed", "0",
    "--log-level", "warning",
    "--sleep-on-idle",  # SGLang's schedulers spin when idle otherwise: a core each, for the session
    # Pages of 16 tokens (prompts end in partial pages) and prefill in chunks of 128 tokens (a
    # 700-token prompt is 6 chunks), as SGLang runs on GPUs; the same in every server.
    "--page-size", str(PAGE_SIZE),
    "--chunked-prefill-size", "128",
)  # fmt: skip


def server_args(
    model_dir: Path,
    port: int | str,
    *,
    mode: str | None = None,
    backend: str = "",
    bootstrap_port: int | str = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The flags of one CPU server: single (``mode`` None), prefill or decode. Ports may be given as
    ``$(PDFABRIC_PORT)`` and ``$(PDFABRIC_BOOTSTRAP_PORT)`` for a PDCluster's ``spec.engine``."""
    args = ["--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS]
    if mode is not None:
        args += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port), "--disable-overlap-schedule"]
    if mode == "decode":
        args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        # Decode keeps prompts in its radix cache; a later prompt with a cached prefix asks prefill
        # for the pages after it only (SGLang's decode_prefix_len).
        args += ["--disaggregation-decode-enable-radix-cache"]
    return [*args, *extra]


def server_argv(
    model_dir: Path,
    port: int,
    *,
    mode: str | None = None,
    backend: str = "",
    bootstrap_port: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of one CPU server (``server_args`` after SGLang's module)."""
    flags = server_args(model_dir, port, mode=mode, backend=backend, bootstrap_port=bootstrap_port, extra=extra)
    return [sys.executable, "-m", "sglang.launch_server", *flags]


# What a CPU server's process needs besides its flags (``server_env`` adds the PYTHONPATH parts).
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}


@functools.cache
def other_model_modules() -> str:
    """SGLang's model modules other than Llama's, comma-separated, for ``SGLANG_DISABLED_MODEL_ARCHS``:
    SGLang imports every module of ``sglang.srt.models`` when a scheduler starts (about 250; 2-4 s of
    CPU per scheduler process here, each failing import logged), and these servers load one Llama."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return ""
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return ",".join(sorted(p.stem for p in models.glob("*.py") if p.stem not in ("llama", "registry", "__init__")))


def parallel_flags(tp: int = 1, pp: int = 1) -> list[str]:
    """SGLang's flags for a server of ``tp`` x ``pp`` scheduler ranks (none for one rank)."""
    return [*(["--tp-size", str(tp)] if tp > 1 else []), *(["--pp-size", str(pp)] if pp > 1 else [])]


def parallel_env(ranks: int) -> dict[str, str]:
    """What SGLang's CPU engine needs to run ``ranks`` scheduler ranks in one server here: each
    rank's OpenMP cores (SGLang asks for them when ranks outnumber NUMA nodes; ranks share this
    machine's cores in turn), and no NCCL. This venv's torch is a CUDA build whose NCCL library
    SGLang would load for its groups and then ask for a GPU; with a CPU build of torch (what
    SGLang's CPU users install) it finds none, which ``SGLANG_NCCL_SO_PATH`` says here. SGLang's
    groups then all-reduce over gloo, its CPU fallback."""
    if ranks <= 1:
        return {}
    cores = os.cpu_count() or 1
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(ranks)),
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
    }


def server_env(
    base: Mapping[str, str], pythonpath: Sequence[str] = (), *, control: bool = False, ranks: int = 1
) -> dict[str, str]:
    """``base`` plus what SGLang's CPU engine needs here: the CPU engine, loopback transfers, the
    stand-in (and, for SGLang's own backends, their CPU sitecustomize) on PYTHONPATH, and for a server
    of several ranks their cores (``parallel_env``)."""
    paths = [str(STANDIN), *([str(CONTROLS_CPU)] if control else []), *pythonpath]
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    return {
        **base,
        **CPU_ENV,
        **parallel_env(ranks),
        "PYTHONPATH": os.pathsep.join(paths),
        # No GPU here: keep torch from looking for one in every helper process.
        "CUDA_VISIBLE_DEVICES": "",
        "SGLANG_DISABLED_MODEL_ARCHS": other_model_modules(),
    }


def patch_control(module: ModuleType) -> None:
    """``controls_cpu``'s change to one of SGLang's backend modules, applied in this process (for a
    harness that runs SGLang's classes here rather than in a server)."""
    spec = importlib.util.spec_from_file_location("pdfabric_controls_cpu", CONTROLS_CPU / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    controls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(controls)
    controls.apply(module)


@dataclass
class SGLangServer:
    """One running server: its URL, process and log. (vLLM's servers in the tests are the same
    processes with their own start and request: ``pdfabric_vllmserver.servers.VllmServer``.)"""

    LABEL: ClassVar[str] = "sglang server"  # what the suite's timings call its starts and stops
    ENGINE: ClassVar[str] = "SGLang"

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]
    bootstrap_port: int = 0
    started_at: float | None = field(default_factory=time.monotonic)  # until first healthy
    # A reference server's 200 answers by request: greedy answers of one server are the same for
    # the same request, so the answer every PD backend must equal is computed once (None: off).
    memo: dict[str, tuple[int, dict[str, Any]]] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        return answers_200(self.url + "/health", 5)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.ENGINE} server {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.ENGINE} server {self.name} not healthy within {timeout_s:g} s:\n{self.tail()}"
                )
            time.sleep(1.0)
        if self.started_at is not None:  # the first time only: later waits follow a restart's own
            record(f"{self.LABEL} start (to healthy)", time.monotonic() - self.started_at)
            self.started_at = None

    def tail(self, n: int = 4000) -> str:
        return file_tail(self.log, n)

    def failure_logs(self) -> dict[str, str]:
        """Its log's tail, for a failed test's report (tests/conftest.py)."""
        return {f"{self.ENGINE} server {self.name}": self.tail(FAILURE_LOG_CHARS)}

    def generate(self, body: Mapping[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
        key = json.dumps(body, sort_keys=True) if self.memo is not None else ""
        if self.memo is not None and key in self.memo:
            return copy.deepcopy(self.memo[key])
        answer = post_json(self.url + "/generate", body, timeout_s)
        if self.memo is not None and answer[0] == 200:
            self.memo[key] = copy.deepcopy(answer)
        return answer

    def stop(self) -> None:
        """SIGTERM the server's process group (its scheduler and detokenizer with it), then kill."""
        with timed(f"{self.LABEL} stop"):
            self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(ProcessLookupError, PermissionError):  # helpers left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash or an OOM kill ends a server (``stop``
        lets SGLang drain its requests first)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def restart(self) -> None:
        """Stop and start the same command (same ports): a crashed or killed server coming back."""
        self.stop()
        fresh = start_server(self.name, self.argv, self.env, self.log, self.port, self.bootstrap_port)
        self.proc = fresh.proc


def available_gib() -> float:
    """MemAvailable of /proc/meminfo in GiB (infinite where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


def wait_for_memory(need_gib: float = SERVER_MEMORY_GIB, timeout_s: float = MEMORY_WAIT_S) -> None:
    """Until ``need_gib`` is available, or ``timeout_s`` passed (then start anyway: the OOM killer,
    if it comes, says more than a refusal would)."""
    started = time.monotonic()
    while available_gib() < need_gib and time.monotonic() - started < timeout_s:
        time.sleep(2.0)
    if time.monotonic() - started >= 1.0:
        record("sglang server start: waited for memory", time.monotonic() - started)


def start_server(
    name: str, argv: list[str], env: dict[str, str], log: Path, port: int, bootstrap_port: int = 0
) -> SGLangServer:
    """Start a server in its own process group (so one signal reaches all of SGLang's processes), in
    its log's folder: ``python -m`` puts the working directory on sys.path, and a checkout's
    ``*.egg-info`` there would announce plugins the server cannot import. First waits for the memory
    a server needs (``wait_for_memory``)."""
    wait_for_memory()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return SGLangServer(name, port, proc, log, argv, env, bootstrap_port)


@contextlib.contextmanager
def reference_server(name: str, model_dir: Path, logs: Path, *, tp: int = 1) -> Iterator[SGLangServer]:
    """One SGLang server serving the model alone, of ``tp`` scheduler ranks: the answers PD must
    equal, memoised (``SGLangServer.memo``: computed once per server), stopped when the block ends."""
    from pdfabric_devcluster.procs import free_port

    port = free_port()
    argv = server_argv(model_dir, port, extra=parallel_flags(tp=tp))
    server = start_server(name, argv, server_env(dict(os.environ), ranks=tp), logs / f"{name}.log", port)
    server.memo = {}
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def greedy(prompt_ids: Sequence[int], new_tokens: int, **extra: Any) -> dict[str, Any]:
    """A /generate body for greedy decoding of exactly ``new_tokens`` tokens."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": list(prompt_ids), "sampling_params": params, **extra}
