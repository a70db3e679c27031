"""The real control plane's binaries (built from Go modules by hack/controlplane/build.sh and cached
outside the repository), and the error and deadline helper of everything that drives them."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdfabric_devcluster.procs import REPO_ROOT

CONTROLPLANE_DIR = REPO_ROOT / "hack" / "controlplane"


class ClusterError(RuntimeError):
    pass


def ensure_binaries(*, quiet: bool = False) -> Path:
    """Build (or find cached) control-plane binaries; returns their directory."""
    env_dir = os.environ.get("PDFABRIC_BIN_DIR")
    if env_dir:
        return Path(env_dir)
    # One build at a time (parallel test workers on a machine without the binaries): the others
    # wait for it, then find them cached.
    cache = Path(
        os.environ.get("PDFABRIC_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdfabric"
    )
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".controlplane.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(
            ["bash", str(CONTROLPLANE_DIR / "build.sh")],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if quiet else None,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        raise ClusterError(
            f"building the control plane failed (exit {proc.returncode}); run hack/controlplane/build.sh"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def wait_for(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str) -> Any:
    """Poll until `predicate()` is truthy; raise with `what` when the deadline passes."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # the thing polled may not exist yet
            last_error = exc
        time.sleep(interval)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error}" if last_error else ""))
