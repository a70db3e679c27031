"""Local processes run from this repository's sources: free loopback ports, the console scripts of
pyproject.toml run without an install, the PYTHONPATH that finds the packages.

No control-plane dependencies here: the agent harness (agents.py, fabric.py) runs on GPU machines too.
"""

from __future__ import annotations

import functools
import json
import os
import random
import socket
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("core", "operator", "agent")
# How much of each process's log a failed test's report carries (tests/conftest.py): the last
# lines of every server and agent of the test, enough for the error and what led to it.
FAILURE_LOG_CHARS = 3000


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()
_RNG = random.Random()
# "k/n": this process picks from the k-th of n equal slices of the range. Test sessions run in
# parallel (pytest-xdist workers) each take a slice: a port one worker picked is not bound until
# its process starts (an SGLang server binds 30 s later), and the other worker must not pick it then.
PORT_SLICE_ENV = "PDFABRIC_PORT_SLICE"


def _port_span(low: int) -> range:
    span = range(20000, low) if low - 20000 >= 2000 else range(0)
    k, _, n = os.environ.get(PORT_SLICE_ENV, "0/1").partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)) or not span:
        return span
    width = len(span) // int(n)
    return range(span.start + int(k) * width, span.start + (int(k) + 1) * width)


def free_port() -> int:
    """A loopback port nothing listens on, for a process started later. Chosen below the kernel's
    ephemeral range: a port the kernel hands out (bind to 0, or the source port of any outgoing
    connection, several per second on a busy machine) could be taken between this check and the
    listener's bind; above 20000, clear of the ports Mooncake picks for its listeners (12001 and
    random ones below 17000 in its logs here); within this process's slice (``PORT_SLICE_ENV``).
    Never the same port twice in this process."""
    span = _port_span(_ephemeral_low())
    for _ in range(256 if span else 0):
        port = _RNG.choice(span)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def source_pythonpath(env: Mapping[str, str]) -> str:
    """The repository's packages first, then whatever ``env`` already had (a carried engine)."""
    own = [str(REPO_ROOT / p) for p in SOURCE_PACKAGES]
    return os.pathsep.join([*own, *filter(None, [env.get("PYTHONPATH")])])


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: container commands and the entry points they name."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["project"]["scripts"])


def console_argv(command: list[str]) -> list[str]:
    """argv running one of this project's console scripts from the repository sources, as the
    script pip generates would (the container's entry point, without an install)."""
    scripts = console_scripts()
    if not command or command[0] not in scripts:
        raise ValueError(f"command {command[:1]} is not one of this project's scripts {sorted(scripts)}")
    module, func = scripts[command[0]].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *command[1:]]


def file_tail(path: str | Path, chars: int) -> str:
    """The last ``chars`` characters of a process's log ("" when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-chars:]
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used so far, from /proc (FileNotFoundError
    once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answers_200(url: str, timeout_s: float) -> bool:
    """GET ``url`` answers 200 within ``timeout_s`` (no answer, or another status: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST a JSON body: the status and JSON answer (0 and the error when none came)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"error": raw.decode(errors="replace")}
    except (OSError, ValueError) as exc:
        return 0, {"error": f"{type(exc).__name__}: {exc}"}
