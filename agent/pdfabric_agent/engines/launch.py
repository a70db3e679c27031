"""How an engine of this node pod is started: its environment (the pod's own, less what is the
agent's), the GPUs it sees, its argv (through the sandbox launcher, by spec.engine.sandbox), and
the supervisor's timings. Pure: ``supervisor`` runs and watches what these build."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdfabric_agent.engines import sandbox
from pdfabric_agent.runtime.config import SETTINGS, AgentConfig
from pdfabric_core.engines.launch import ENGINES_ENV, HOISTED_PREFIX, EngineLaunch, expand
from pdfabric_core.spec import EngineSandbox

CVD = "CUDA_VISIBLE_DEVICES"
RESET_AFTER_S = 600.0  # a run this long resets the restart backoff (the kubelet's rule)


class LaunchError(Exception):
    """The engine cannot be started (a missing program, a GPU the agent does not see): its run
    ends with this message as the exit reason, and it is retried like any exit."""


def agent_only(name: str) -> bool:
    """A variable of the agent's environment that its engines do not inherit: every PDFABRIC_*
    the agent reads (its settings, the rank map, peers, TLS, the engine list) and the hoisted
    valueFrom variables (handed to their engines under their own names)."""
    return name == ENGINES_ENV or name.startswith(HOISTED_PREFIX) or (name.startswith("PDFABRIC_") and name in SETTINGS)


def visible_devices(gpus: Sequence[int], agent_cvd: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine of these GPUs (device indices as the agent sees them):
    through the agent's own CUDA_VISIBLE_DEVICES when set ("2,3" and (1,) -> "3")."""
    if agent_cvd is None:
        return ",".join(str(g) for g in gpus)
    visible = [d.strip() for d in agent_cvd.split(",") if d.strip()]
    missing = [g for g in gpus if g >= len(visible)]
    if missing:
        raise LaunchError(f"GPU {missing[0]} is not among the agent's {CVD}={agent_cvd!r}")
    return ",".join(visible[g] for g in gpus)


def engine_env(
    launch: EngineLaunch, agent_env: Mapping[str, str], *, agent_address: str, token_file: str, shm_dir: str
) -> dict[str, str]:
    """The engine's environment, built as the module docstring says."""
    env = {k: v for k, v in agent_env.items() if not agent_only(k)}
    for entry in launch.env:
        if entry.from_container:
            if entry.from_container in agent_env:
                env[entry.name] = agent_env[entry.from_container]
        else:
            env[entry.name] = expand(entry.value, env)
    env.update(launch.contract_env(agent_address, token_file, shm_dir))
    env[CVD] = visible_devices(launch.gpus, agent_env.get(CVD))
    return env


def engine_argv(launch: EngineLaunch, env: Mapping[str, str]) -> list[str]:
    """argv expanded against the engine's environment, the program resolved on its PATH."""
    argv = [expand(a, env) for a in launch.argv]
    program = argv[0]
    if os.sep in program:
        found = program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise LaunchError(f"command not found: {program}")
    return [found, *argv[1:]]


def sandboxed_argv(python: str, hidden: Sequence[str], mode: EngineSandbox, argv: Sequence[str]) -> list[str]:
    """`argv` started through sandbox.py's launcher, run by path in isolated mode (Disabled, or
    nothing to hide: `argv` itself). Always --required: the supervisor wraps only where it found
    Landlock, so a launcher that cannot apply it there fails the run (and says why) rather than
    start an engine the agent reports sandboxed."""
    if mode is EngineSandbox.DISABLED or not hidden:
        return list(argv)
    flags = [f for h in hidden for f in ("--hide", h)]
    return [python, "-I", os.path.abspath(sandbox.__file__), *flags, "--required", "--", *argv]


@dataclass(frozen=True)
class Timings:
    probe_s: float = 2.0
    liveness_s: float = 60.0
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    grace_s: float = 30.0
    reset_after_s: float = RESET_AFTER_S

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> Timings:
        return cls(
            probe_s=cfg.engine_probe_s,
            liveness_s=cfg.engine_liveness_s,
            backoff_s=cfg.engine_backoff_s,
            backoff_max_s=cfg.engine_backoff_max_s,
            grace_s=cfg.engine_grace_s,
        )

    def backoff(self, exponent: int) -> float:
        return min(self.backoff_s * float(2 ** min(exponent, 30)), self.backoff_max_s)
