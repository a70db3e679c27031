"""The launch message the operator hands the agent per engine (``EngineLaunch``, in the container's
``PDFABRIC_ENGINES``), the variables every engine gets by their one spelling (``EngineEnv``), and the
kubelet's $(VAR) rules the message follows. Parsed field by field: a refusal names the field."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdfabric_core.policy.types import Role

ENGINES_ENV = "PDFABRIC_ENGINES"  # the container variable holding the node's EngineLaunch list


class EngineEnv(enum.StrEnum):
    """The variables every engine the agent starts gets (``EngineLaunch.contract_env``), by their
    one spelling: the SGLang plugin and the reference engine read them by these names."""

    TOKEN_FILE = "PDFABRIC_ENGINE_TOKEN_FILE"  # the engine door's token, in a file
    AGENT_ADDRESS = "PDFABRIC_AGENT_ADDRESS"  # the node agent's engine door, host:port
    REPLICA = "PDFABRIC_REPLICA"  # this engine's replica of its role
    SHM_DIR = "PDFABRIC_SHM_DIR"  # where CPU buffers the agent may map are files
    ROLE = "PDFABRIC_ROLE"
    ENGINE_NAME = "PDFABRIC_ENGINE_NAME"
    PORT = "PDFABRIC_PORT"  # the engine's HTTP port
    GPUS = "PDFABRIC_GPUS"  # how many GPUs it sees
    TP = "PDFABRIC_TP"
    PP = "PDFABRIC_PP"
    CP = "PDFABRIC_CP"  # prefill
    BOOTSTRAP_PORT = "PDFABRIC_BOOTSTRAP_PORT"  # prefill
    CP_RANK = "PDFABRIC_CP_RANK"  # prefill, when every rank of the engine has the same CP rank
    RANK = "PDFABRIC_RANK"  # the rank id outright, for an engine of one rank
    BOOTSTRAP_TIMEOUT_S = "PDFABRIC_BOOTSTRAP_TIMEOUT_S"  # read by the plugin when set
    # A replica over several nodes (nodesPerReplica > 1) only: SGLang's --nnodes, --node-rank and
    # --dist-init-addr (the leader's torch.distributed rendezvous, host:port under the headless Service).
    NNODES = "PDFABRIC_NNODES"
    NODE_RANK = "PDFABRIC_NODE_RANK"
    DIST_INIT_ADDR = "PDFABRIC_DIST_INIT_ADDR"


# Variables of the user's env that come from the API (valueFrom: a Secret, a ConfigMap) are
# resolved by the kubelet into the container under a prefixed name, one per role, and handed to
# that role's engines under their own name; plain values travel in the launch message.
HOISTED_PREFIX = "PDFABRIC_ENV_"
MAX_LAUNCHES = 64  # one engine per GPU at most (the CRD's most GPUs per node)
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable is replaced, an undefined one kept,
    $$ is a literal $."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)


def kubelet_literal(text: str) -> str:
    """``text`` as an env value the kubelet passes through unchanged ($ doubled: no expansion)."""
    return text.replace("$", "$$")


def hoisted_name(role: Role, name: str) -> str:
    """The container variable a role's valueFrom variable is resolved into (PDFABRIC_ENV_PREFILL_HF_TOKEN)."""
    return f"{HOISTED_PREFIX}{role.value.upper()}_{name}"


@dataclass(frozen=True)
class EnvEntry:
    """One variable of an engine's environment: a value ($(VAR) expanded by the agent, as the
    kubelet would), or the container variable the kubelet resolved a valueFrom into."""

    name: str
    value: str = ""
    from_container: str = ""

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "fromContainer": self.from_container} if self.from_container else {
            "name": self.name, "value": self.value,
        }  # fmt: skip


@dataclass(frozen=True)
class EngineLaunch:
    """How the agent runs one engine (the operator's word, in PDFABRIC_ENGINES)."""

    name: str
    role: Role
    replica: int
    rank_ids: tuple[str, ...]
    gpus: tuple[int, ...]  # the ranks' device indices as the agent sees them, in rank order
    argv: tuple[str, ...]  # command + args, $(VAR) unexpanded
    env: tuple[EnvEntry, ...]
    port: int
    bootstrap_port: int | None
    health_path: str
    startup_seconds: int
    tp: int
    pp: int
    cp: int
    cp_rank: int | None  # when every rank of the group has the same CP rank
    nnodes: int = 1  # nodes the replica spans; this engine runs its node block `node_rank`
    node_rank: int = 0
    dist_init_addr: str = ""  # the leader's rendezvous host:port, with nnodes > 1

    def contract_env(self, agent_address: str, token_file: str, shm_dir: str) -> dict[str, str]:
        """The variables every engine gets (docs/engines.md, docs/sglang.md): the door, the token,
        who it is, what it serves on and with. The user's env may not name PDFABRIC_*."""
        env = {
            EngineEnv.TOKEN_FILE: token_file,
            EngineEnv.AGENT_ADDRESS: agent_address,
            EngineEnv.REPLICA: str(self.replica),
            EngineEnv.SHM_DIR: shm_dir,
            EngineEnv.ROLE: self.role.value,
            EngineEnv.ENGINE_NAME: self.name,
            EngineEnv.PORT: str(self.port),
            EngineEnv.GPUS: str(len(self.gpus)),
            EngineEnv.TP: str(self.tp),
            EngineEnv.PP: str(self.pp),
        }
        if self.bootstrap_port is not None:
            env[EngineEnv.BOOTSTRAP_PORT] = str(self.bootstrap_port)
            env[EngineEnv.CP] = str(self.cp)
        if self.cp_rank is not None:
            # A CP > 1 server's scheduler processes each know their own CP rank; one variable cannot.
            env[EngineEnv.CP_RANK] = str(self.cp_rank)
        if len(self.rank_ids) == 1:
            env[EngineEnv.RANK] = self.rank_ids[0]
        if self.nnodes > 1:
            env[EngineEnv.NNODES] = str(self.nnodes)
            env[EngineEnv.NODE_RANK] = str(self.node_rank)
            env[EngineEnv.DIST_INIT_ADDR] = self.dist_init_addr
        return {str(k): v for k, v in env.items()}

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "role": self.role.value,
            "replica": self.replica,
            "ranks": list(self.rank_ids),
            "gpus": list(self.gpus),
            "argv": list(self.argv),
            "env": [e.to_json() for e in self.env],
            "port": self.port,
            "healthPath": self.health_path,
            "startupSeconds": self.startup_seconds,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
        }
        if self.bootstrap_port is not None:
            body["bootstrapPort"] = self.bootstrap_port
        if self.cp_rank is not None:
            body["cpRank"] = self.cp_rank
        if self.nnodes > 1:
            body.update(nnodes=self.nnodes, nodeRank=self.node_rank, distInitAddr=self.dist_init_addr)
        return body

    @classmethod
    def from_json(cls, d: Any, where: str = "engine") -> EngineLaunch:
        """Checked field by field; a ValueError names the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object")

        def text(key: str) -> str:
            v = d.get(key)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{where}.{key} must be a non-empty string")
            return v

        def integer(key: str, lo: int = 0, hi: int = 65535, required: bool = True) -> int | None:
            v = d.get(key)
            if v is None and not required:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{where}.{key} must be an integer in [{lo}, {hi}]")
            return v

        def strings(key: str, *, nonempty: bool) -> tuple[str, ...]:
            v = d.get(key)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or (nonempty and not v):
                raise ValueError(f"{where}.{key} must be a {'non-empty ' if nonempty else ''}list of strings")
            return tuple(v)

        try:
            role = Role(str(d.get("role")))
        except ValueError:
            raise ValueError(f"{where}.role must be prefill or decode") from None
        gpus = d.get("gpus")
        if (
            not isinstance(gpus, list)
            or not gpus
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
        ):
            raise ValueError(f"{where}.gpus must be a non-empty list of device indices")
        raw_env = d.get("env", [])
        if not isinstance(raw_env, list):
            raise ValueError(f"{where}.env must be a list")
        env: list[EnvEntry] = []
        for i, e in enumerate(raw_env):
            if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
                raise ValueError(f"{where}.env[{i}] needs a name")
            if isinstance(e.get("fromContainer"), str) and e["fromContainer"]:
                env.append(EnvEntry(e["name"], from_container=e["fromContainer"]))
            elif isinstance(e.get("value"), str):
                env.append(EnvEntry(e["name"], value=e["value"]))
            else:
                raise ValueError(f"{where}.env[{i}] needs a value or fromContainer")
        health = text("healthPath")
        if not health.startswith("/"):
            raise ValueError(f"{where}.healthPath must start with /")
        return cls(
            name=text("name"),
            role=role,
            replica=integer("replica", hi=2**31) or 0,
            rank_ids=strings("ranks", nonempty=True),
            gpus=tuple(gpus),
            argv=strings("argv", nonempty=True),
            env=tuple(env),
            port=integer("port", lo=1) or 0,
            bootstrap_port=integer("bootstrapPort", lo=1, required=False),
            health_path=health,
            startup_seconds=integer("startupSeconds", lo=1, hi=2**31) or 0,
            tp=integer("tp", lo=1, hi=1024) or 1,
            pp=integer("pp", lo=1, hi=1024) or 1,
            cp=integer("cp", lo=1, hi=1024) or 1,
            cp_rank=integer("cpRank", hi=1024, required=False),
            **_group_fields(d, where),
        )


def _group_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """nnodes, nodeRank and distInitAddr of an engine of a replica over several nodes ({} for one)."""
    nnodes = d.get("nnodes", 1)
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or not 1 <= nnodes <= 64:
        raise ValueError(f"{where}.nnodes must be an integer in [1, 64]")
    if nnodes == 1:
        return {}
    node = d.get("nodeRank")
    if not isinstance(node, int) or isinstance(node, bool) or not 0 <= node < nnodes:
        raise ValueError(f"{where}.nodeRank must be an integer in [0, {nnodes - 1}]")
    addr = d.get("distInitAddr")
    host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}.distInitAddr must be host:port, the leader's rendezvous")
    return {"nnodes": nnodes, "node_rank": node, "dist_init_addr": addr}


def encode_launches(launches: Sequence[EngineLaunch]) -> str:
    """PDFABRIC_ENGINES' value as the pod spec carries it (kubelet-escaped: the agent expands
    $(VAR) itself, per engine, as the kubelet would in a container of its own)."""
    return kubelet_literal(json.dumps([x.to_json() for x in launches], separators=(",", ":"), sort_keys=True))


def decode_launches(text: str) -> list[EngineLaunch]:
    """PDFABRIC_ENGINES as the process sees it (the kubelet unescaped it); ValueError names the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENGINES_ENV} is not JSON: {exc}") from None
    if not isinstance(raw, list) or len(raw) > MAX_LAUNCHES:
        raise ValueError(f"{ENGINES_ENV} must be a list of at most {MAX_LAUNCHES} engines")
    launches = [EngineLaunch.from_json(x, f"{ENGINES_ENV}[{i}]") for i, x in enumerate(raw)]
    names = [x.name for x in launches]
    if len(set(names)) != len(names):
        raise ValueError(f"{ENGINES_ENV}: engine names must be unique, got {names}")
    return launches
