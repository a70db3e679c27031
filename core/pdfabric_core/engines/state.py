"""How one engine is doing, as its supervisor (the agent) sees it: /readyz lists ``EngineState``s,
the operator reads them into the PDCluster's status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdfabric_core.policy.types import Role


@dataclass(frozen=True)
class EngineState:
    """One engine as its supervisor (the agent) sees it; /readyz lists them, the operator reads them."""

    name: str
    role: Role
    replica: int
    # Waiting (the agent is not Ready yet), Starting (not yet healthy), Running (healthy), Unhealthy,
    # BackOff (waiting to restart), Stopped (the agent is stopping)
    phase: str
    ready: bool
    restarts: int = 0
    pid: int = 0  # 0 while not running
    last_exit: str = ""  # how the last run ended ("exit code 1", "signal 9", "startup timeout ...")
    sandboxed: bool = False  # started in the sandbox that hides the peer key (spec.engine.sandbox)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role.value,
            "replica": self.replica,
            "phase": self.phase,
            "ready": self.ready,
            "restarts": self.restarts,
            "pid": self.pid,
            "lastExit": self.last_exit,
            "sandboxed": self.sandboxed,
        }

    @classmethod
    def from_json(cls, d: Any) -> EngineState | None:
        """None for anything malformed (a reader of another process's word does not crash on it)."""
        if not isinstance(d, dict):
            return None
        try:
            role = Role(str(d.get("role")))
        except ValueError:
            return None
        name, phase, last = d.get("name"), d.get("phase"), d.get("lastExit", "")
        replica, restarts, pid = d.get("replica"), d.get("restarts", 0), d.get("pid", 0)
        if not (isinstance(name, str) and isinstance(phase, str) and isinstance(last, str)):
            return None
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (replica, restarts, pid)):
            return None
        assert isinstance(replica, int) and isinstance(restarts, int) and isinstance(pid, int)
        return cls(
            name[:64], role, replica, phase[:32], d.get("ready") is True, restarts, pid, last[:256],
            d.get("sandboxed") is True,
        )  # fmt: skip
