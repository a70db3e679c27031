"""The serving engines of a node pod (spec.engine): which engines run where, how each is launched,
and how it is doing. The one place for these facts; the operator builds pods and Services from
them, the agent supervises processes by them, and both read the same status message.

The pod shape (docs/engines.md says why): one container per node pod holds every GPU of the
node's ranks (the device plugin's grant), runs the agent, and the agent runs one engine process
per group of ranks (one replica of one role placed on the node) with CUDA_VISIBLE_DEVICES naming
that group's GPUs. The operator hands the agent its engines as ``EngineLaunch`` messages in the
container's ``PDFABRIC_ENGINES`` variable; the agent answers with ``EngineState`` in /readyz.

The k-th engine of a role in the pod serves on ``port + k`` (prefill's bootstrap server on
``bootstrapPort + k``): engines of one pod share its network namespace.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdfabric_core.policy.types import Role
from pdfabric_core.rankmap import Rank

if TYPE_CHECKING:
    from pdfabric_core.spec import EngineSpec, PDClusterSpec

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


@dataclass(frozen=True)
class EngineGroup:
    """One engine: the ranks of one replica of one role on one node."""

    role: Role
    replica: int
    index: int  # the k-th engine of its role in this pod: its ports are base + k
    ranks: tuple[Rank, ...]

    @property
    def name(self) -> str:
        """Unique in the pod: prefill-0, decode-3."""
        return f"{self.role.value}-{self.replica}"

    @property
    def port_name(self) -> str:
        """Serving port's name (<= 15 characters): p-http-0, d-http-2 (k = index)."""
        return f"{self.role.value[0]}-http-{self.index}"

    @property
    def bootstrap_port_name(self) -> str:
        return f"p-boot-{self.index}"


def engine_groups(ranks: Sequence[Rank]) -> list[EngineGroup]:
    """The engine groups of one node's ranks, in rank order (prefill first, then by replica)."""
    by_key: dict[tuple[Role, int], list[Rank]] = {}
    for r in ranks:
        by_key.setdefault((Role(r.role), r.replica), []).append(r)
    out: list[EngineGroup] = []
    seen: dict[Role, int] = {}
    for (role, replica), group in by_key.items():
        k = seen.get(role, 0)
        seen[role] = k + 1
        out.append(EngineGroup(role, replica, k, tuple(group)))
    return out


def serving_port(engine: EngineSpec, group: EngineGroup) -> int:
    return engine.role(group.role.value).port + group.index


def bootstrap_port(engine: EngineSpec, group: EngineGroup) -> int | None:
    """Prefill engines' bootstrap port; None for decode."""
    return engine.prefill.bootstrap_port + group.index if group.role is Role.PREFILL else None


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
        )


def _launch_env(engine: EngineSpec, role: Role) -> tuple[EnvEntry, ...]:
    out = []
    for var in engine.role(role.value).env:
        name = str(var["name"])
        if "valueFrom" in var:
            out.append(EnvEntry(name, from_container=hoisted_name(role, name)))
        else:
            out.append(EnvEntry(name, value=str(var.get("value", ""))))
    return tuple(out)


def engine_launch(spec: PDClusterSpec, group: EngineGroup) -> EngineLaunch:
    assert spec.engine is not None
    engine = spec.engine
    role = engine.role(group.role.value)
    par = spec.prefill if group.role is Role.PREFILL else spec.decode
    cp_ranks = {r.cp_rank for r in group.ranks}
    return EngineLaunch(
        name=group.name,
        role=group.role,
        replica=group.replica,
        rank_ids=tuple(r.rank_id for r in group.ranks),
        gpus=tuple(r.gpu for r in group.ranks),
        argv=(*role.command, *role.args),
        env=_launch_env(engine, group.role),
        port=serving_port(engine, group),
        bootstrap_port=bootstrap_port(engine, group),
        health_path=role.health_path,
        startup_seconds=role.startup_seconds,
        tp=par.tp,
        pp=par.pp,
        cp=spec.prefill.cp if group.role is Role.PREFILL else 1,
        cp_rank=next(iter(cp_ranks)) if len(cp_ranks) == 1 else None,
    )


def engine_launches(spec: PDClusterSpec, ranks: Sequence[Rank]) -> list[EngineLaunch]:
    """The engines of one node's ranks; [] without spec.engine (fabric-only)."""
    if spec.engine is None:
        return []
    return [engine_launch(spec, g) for g in engine_groups(ranks)]


def hoisted_env(spec: PDClusterSpec, roles: Iterable[Role] = tuple(Role)) -> list[dict[str, Any]]:
    """The container variables the kubelet resolves for the engines of `roles` (valueFrom:
    Secrets, ConfigMaps, fields), one per role and name (so prefill and decode may differ). A pod
    gets only its own engines' roles: a decode pod never holds what only prefill reads."""
    if spec.engine is None:
        return []
    out = []
    for role in sorted(set(roles), key=list(Role).index):
        for var in spec.engine.role(role.value).env:
            if "valueFrom" in var:
                out.append({"name": hoisted_name(role, str(var["name"])), "valueFrom": dict(var["valueFrom"])})
    return out


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


def sglang_router_args(endpoints: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """SGLang's PD router's worker arguments from a PDCluster's ``status.endpoints``: each prefill
    engine by its own URL with its bootstrap port (decode asks *that* prefill which request it
    sent, so no load-balanced address will do), each decode engine by its URL. What docs/engines.md's
    shell recipe builds with kubectl; a role without endpoints is an error, since the router cannot
    pair a request without both."""
    prefill, decode = endpoints.get("prefill") or [], endpoints.get("decode") or []
    if not prefill or not decode:
        raise ValueError("the router needs at least one prefill and one decode endpoint (status.endpoints)")
    args = ["--pd-disaggregation"]
    for e in prefill:
        boot = e.get("bootstrapPort")
        args += ["--prefill", str(e["url"]), "none" if boot is None else str(int(boot))]
    for e in decode:
        args += ["--decode", str(e["url"])]
    return args
