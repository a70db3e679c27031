"""Who an engine rank is in its PDCluster and where its agent is, read from the environment the
PDCluster's pod (or the engine's own deployment) sets; shared by every engine integration (SGLang's
plugin, vLLM's connector, the reference engine)."""

from __future__ import annotations

import os
import secrets
import socket

from pdfabric_core.engines.launch import EngineEnv

ENV_AGENT = EngineEnv.AGENT_ADDRESS.value
ENV_TOKEN_FILE = EngineEnv.TOKEN_FILE.value
ENV_REPLICA = EngineEnv.REPLICA.value
ENV_CP_RANK = EngineEnv.CP_RANK.value
ENV_RANK = EngineEnv.RANK.value
ENV_BOOTSTRAP_TIMEOUT = EngineEnv.BOOTSTRAP_TIMEOUT_S.value


class FabricConfig:
    """Where the engine finds its agent, and who it is in the PDCluster (from the environment the
    PDCluster's pod, or the engine's own deployment, sets)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.address = env.get(ENV_AGENT, "127.0.0.1:7400")
        token_file = env.get(ENV_TOKEN_FILE)
        if not token_file:
            raise RuntimeError(f"pdfabric: set {ENV_TOKEN_FILE} to the file holding the agent's engine token")
        with open(token_file, encoding="utf-8") as fh:
            self.token = fh.read().strip()
        self.replica = int(env.get(ENV_REPLICA, "0"))
        self.cp_rank = int(env.get(ENV_CP_RANK, "0"))
        self.rank = env.get(ENV_RANK) or None
        self.bootstrap_timeout_s = float(env.get(ENV_BOOTSTRAP_TIMEOUT, "300"))


def engine_instance() -> str:
    """An id of this engine process, unique across restarts: its registrations and room feed carry
    it, so the agent tells a restarted engine from a second live one (agent service/registrants.py)."""
    return f"{socket.gethostname()[:64]}/{os.getpid()}/{secrets.token_hex(6)}"
