"""Local processes run from this repository's sources: free loopback ports, the console scripts of
pyproject.toml run without an install, the PYTHONPATH that finds the packages.

No control-plane dependencies here: the agent harness (fabric.py) runs on GPU machines too.
"""

from __future__ import annotations

import os
import socket
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("core", "operator", "agent")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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
