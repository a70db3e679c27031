"""SGLang's own PD router (the ``sglang-router`` distribution) as a local process, pointed at a
PDCluster's engine endpoints the way docs/engines.md tells users to (``sglang_router_args``): the
tests send it plain ``/generate`` requests and it pairs each with a prefill and a decode engine,
adding the bootstrap fields itself."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdfabric_core.engines.router import sglang_router_args
from pdfabric_devcluster.procs import answers_200, free_port, post_json


class SGLangRouter:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path, metrics_url: str = "") -> None:
        self.url = url
        self.proc = proc
        self.log = log
        self.metrics_url = metrics_url  # its --prometheus-port, where set

    def _ok(self, path: str) -> bool:
        return answers_200(self.url + path, 2)

    def healthy(self) -> bool:
        """The process serves (its /health; 200 with no worker at all)."""
        return self._ok("/health")

    def ready(self) -> bool:
        """It can route: /readiness is 200 once it holds a healthy prefill and decode worker (the
        operator's readiness probe)."""
        return self._ok("/readiness")

    def wait_healthy(self, wait_s: float = 60, *, ready: bool = False) -> None:
        deadline = time.monotonic() + wait_s
        what = "ready" if ready else "healthy"
        while not (self.ready() if ready else self.healthy()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited {self.proc.returncode}; its log: {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router not {what} within {wait_s:g} s; its log: {self.log}")
            time.sleep(0.25)

    def metric_samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The router's own Prometheus samples of `name`, by their labels."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {
            tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def generate(self, body: Mapping[str, Any], timeout_s: float = 60.0) -> tuple[int, dict[str, Any]]:
        """POST /generate through the router: its status and JSON answer (0 when none came)."""
        return post_json(self.url + "/generate", body, timeout_s)


@contextlib.contextmanager
def sglang_router(
    endpoints: Mapping[str, Sequence[Mapping[str, Any]]], log: Path, *, extra: Sequence[str] = (), wait_s: float = 60
) -> Iterator[SGLangRouter]:
    """The router on a free loopback port, Ready (its /health answers 200) before this yields."""
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", *sglang_router_args(endpoints)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    router = SGLangRouter(f"http://127.0.0.1:{port}", proc, log, f"http://127.0.0.1:{metrics}")
    try:
        router.wait_healthy(wait_s)
        yield router
    finally:
        router.stop()
