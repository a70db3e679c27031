"""A real Prometheus server scraping local targets (file-based service discovery)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pdfabric_devcluster.binaries import CONTROLPLANE_DIR, ClusterError, wait_for
from pdfabric_devcluster.procs import free_port
from pdfabric_devcluster.timings import record

SCRAPE_INTERVAL_S = 1


def ensure_prometheus() -> Path:
    """Directory with Debian's prometheus and promtool (fetched and unpacked once per machine)."""
    out = subprocess.run(
        ["bash", str(CONTROLPLANE_DIR.parent / "prometheus.sh")], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise ClusterError(f"could not fetch Debian's prometheus package: {out.stderr.strip()}")
    return Path(out.stdout.strip().splitlines()[-1])


class Prometheus:
    def __init__(self, workdir: Path, bin_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.bin_dir = bin_dir or ensure_prometheus()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = workdir / "targets.json"
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.targets: frozenset[str] = frozenset()  # the addresses last set

    def start(self) -> Prometheus:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.set_targets([])
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {
                    "job_name": "pdfabric-agent",
                    "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}],
                }
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config))  # JSON is YAML
        check = subprocess.run(
            [str(self.bin_dir / "promtool"), "check", "config", str(config_path)], capture_output=True, text=True
        )
        if check.returncode != 0:
            raise ClusterError(f"promtool rejected the config: {check.stdout}{check.stderr}")
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [
                    str(self.bin_dir / "prometheus"),
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_for(self._ready, timeout=30, interval=0.2, what="prometheus /-/ready")
        record("prometheus start", time.monotonic() - started)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ClusterError(f"prometheus exited: {self.log.read_text(errors='replace')[-2000:]}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
            return resp.status == 200

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def set_targets(self, targets: Iterable[tuple[str, Mapping[str, str]]]) -> None:
        """Replace the scrape targets: (host:port, extra labels) pairs. Written atomically."""
        pairs = list(targets)
        self.targets = frozenset(t for t, _ in pairs)
        groups = [{"targets": [t], "labels": dict(labels)} for t, labels in pairs]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise ClusterError(f"prometheus {path} failed: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; returns the result vector (raises on a PromQL error)."""
        return self.api("query", query=expr, time=f"{time.time():.3f}")["result"]

    def wait_targets_up(self, timeout: float = 30) -> None:
        """Until Prometheus scrapes exactly the targets last set, each up and scraped once: the
        targets of an earlier set stay active until its next file read, and would pass a count."""

        def up() -> bool:
            active = self.api("targets", state="active")["activeTargets"]
            return {t["scrapeUrl"].split("/")[2] for t in active} == self.targets and all(
                t["health"] == "up" for t in active
            )

        wait_for(up, timeout=timeout, interval=0.5, what=f"scrape targets {sorted(self.targets)} up")
