"""Agent settings from the environment, each documented and checked at start.

The operator sets NODE_NAME, POD_NAME, PDFABRIC_RANKMAP, PDFABRIC_ENGINE_TOKEN_FILE and
PDFABRIC_PEER_TLS_DIR; everything else has a default that suits a Kubernetes pod. Tests and the local demo override ports and peer
addresses because several agents share one loopback interface there.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdfabric_agent.protocol import tls
from pdfabric_core.engines.launch import ENGINES_ENV, EngineLaunch, decode_launches


class ConfigError(ValueError):
    """A setting the agent cannot start with; the message names the variable."""


# name -> (default, description); docs/agent.md lists the same table.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "NODE_NAME": (None, "Node this agent runs on; selects its entry in the rank map (required)."),
    "POD_NAME": ("", "Agent pod name, for logs."),
    "PDFABRIC_RANKMAP": (None, "Path of rankmap.json from the operator's ConfigMap (required)."),
    "PDFABRIC_ENGINE_TOKEN_FILE": (
        None,
        "Path of the engine token (the `<cluster>-engine-token` Secret); engine API requests must carry it (required).",
    ),
    "PDFABRIC_PEER_TLS_DIR": (
        None,
        "Directory of this agent's peer certificate (`tls.crt`, `tls.key`) and the cluster CA (`ca.crt`), "
        "the `<agent>-peer-tls` Secret (required).",
    ),
    "PDFABRIC_BIND_ADDRESS": (
        "",
        "Address the peer door and metrics servers bind; default POD_IP, else the address the pod's "
        "hostname resolves to, else 0.0.0.0. Peers and the kubelet need the pod address, nothing else.",
    ),
    "PDFABRIC_API_PORT": ("", "Engine door port, on 127.0.0.1 only; default spec.agent.apiPort (7400)."),
    "PDFABRIC_PEER_PORT": ("", "Peer door port (mutual TLS, on the bind address); default spec.agent.peerPort (7401)."),
    "PDFABRIC_METRICS_PORT": ("", "Metrics and probe port; default spec.agent.metricsPort (9400)."),
    "PDFABRIC_ENGINE_HOST": (
        "",
        "Host the transfer engines advertise to peers; default POD_IP, else the hostname's address, else 127.0.0.1.",
    ),
    "PDFABRIC_PEERS": (
        "",
        'JSON {"agent-name": "host:port"} overriding peer door addresses (local runs); the peer '
        "certificate is still verified against the host name of the template below.",
    ),
    "PDFABRIC_PEERS_FILE": (
        "",
        "A file of the same JSON, read again when a peer is not in it (local runs, where agents of "
        "new replicas come up after this one started).",
    ),
    "PDFABRIC_PEER_HOST_TEMPLATE": (
        "{name}.{cluster}-agents.{namespace}.svc",
        "Peer door host from the rank map's agent name (pod DNS name under the headless Service); "
        "the peer's certificate must carry it.",
    ),
    "PDFABRIC_KV_PAGES": ("256", "KV pages per pool (per rank, per layer, K and V each)."),
    "PDFABRIC_STATE_SLOTS": ("64", "State slots per rank (one request's state each)."),
    "PDFABRIC_AUX_SLOTS": ("64", "Aux (metadata) rows per rank."),
    "PDFABRIC_SHM_DIR": ("/dev/shm", "Where CPU pools live as files, so serving engines can map them."),
    "PDFABRIC_COALESCE": ("1", "Coalesce consecutive pages into one block (0 only for benchmarks)."),
    "PDFABRIC_BOOTSTRAP_TIMEOUT_S": ("300", "Deadline for a room's peer information to arrive (upstream 300 s)."),
    "PDFABRIC_PROBE_BACKOFF_S": ("30", "First re-probe delay of a blacklisted peer (upstream 30 s)."),
    "PDFABRIC_PROBE_BACKOFF_MAX_S": ("300", "Longest re-probe delay (upstream 300 s)."),
    "PDFABRIC_HEARTBEAT_S": (
        "5",
        "Decode pings the prefill agents of its waiting rooms this often; 2 misses fail the rooms (upstream 5 s).",
    ),
    "PDFABRIC_ROOM_TTL_S": ("600", "Finished rooms are forgotten after this long."),
    "PDFABRIC_PROBE_PEERS_MAX": (
        "16",
        "Most peer agents the link check before Ready writes to; every peer agent is still asked for its "
        "regions (it must answer and admit this agent), and the agents' choices are spread to reach every peer.",
    ),
    "PDFABRIC_PEER_SERIES_MAX": (
        "256",
        "Most (local rank, peer agent) pairs with per-peer series; up to it every pair the rank map implies has "
        "them from the start, past it the most recently active pairs do (docs/agent.md, Per-peer metrics); 0: none.",
    ),
    "PDFABRIC_WORKERS": ("8", "Threads issuing blocking engine calls."),
    # Read by guard.Limits on every listener; listed here so they are documented with the rest.
    "PDFABRIC_HEADER_TIMEOUT_S": (
        "10",
        "A request head (and a peer's TLS handshake) must arrive within this; else 408.",
    ),
    "PDFABRIC_BODY_TIMEOUT_S": ("30", "A request body must arrive within this once its head did; else 408."),
    "PDFABRIC_IDLE_TIMEOUT_S": ("60", "An idle keep-alive connection is closed after this."),
    "PDFABRIC_MAX_CONNECTIONS": ("256", "Connections per listener; past it the slowest make room, else 429."),
    "PDFABRIC_MAX_HANDSHAKES": (
        "64",
        "TLS handshakes in progress on the peer door; past it a new connection replaces the oldest of the address holding the most, else the oldest whose client has not sent its ClientHello, else the oldest slow one (0.5 s); else it is reset.",
    ),
    "PDFABRIC_LOG_LEVEL": ("INFO", "Python log level."),
    # The serving engines the agent runs (spec.engine; supervisor.py). None of these variables,
    # nor any other the agent reads, reaches an engine's environment.
    "PDFABRIC_ENGINES": (
        "",
        "JSON list of the serving engines this agent runs and supervises, one per engine group (the operator's "
        "`EngineLaunch` messages, pdfabric_core.engines); empty: none (fabric-only). Variables the kubelet "
        "resolved from the API for them arrive as `PDFABRIC_ENV_<ROLE>_<NAME>`.",
    ),
    "PDFABRIC_ENGINE_PROBE_S": (
        "2",
        "Each engine's health path is probed this often (and given as long to answer, 2 s at most).",
    ),
    "PDFABRIC_ENGINE_LIVENESS_S": (
        "60",
        "An engine that was healthy and then fails every probe for this long is killed (SIGKILL to its "
        "process group) and restarted.",
    ),
    "PDFABRIC_ENGINE_BACKOFF_S": (
        "10",
        "First restart delay of an engine that exited; doubles per restart, reset after a run of 600 s "
        "(the kubelet's rule).",
    ),
    "PDFABRIC_ENGINE_BACKOFF_MAX_S": ("300", "Longest restart delay of an engine."),
    "PDFABRIC_ENGINE_GRACE_S": (
        "30",
        "On SIGTERM the agent stops its engines first: SIGTERM to each process group, SIGKILL after this long.",
    ),
}


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    pod_name: str
    rankmap_path: str
    token: str  # the engine token: the engine door admits only requests carrying it
    bind_address: str
    api_port: int | None
    metrics_port: int | None
    engine_host: str
    peers: Mapping[str, str] = field(default_factory=dict)
    peers_file: str = ""  # PDFABRIC_PEERS_FILE
    peer_host_template: str = SETTINGS["PDFABRIC_PEER_HOST_TEMPLATE"][0] or ""
    kv_pages: int = 256
    state_slots: int = 64
    aux_slots: int = 64
    shm_dir: str = "/dev/shm"
    coalesce: bool = True
    bootstrap_timeout_s: float = 300.0
    probe_backoff_s: float = 30.0
    probe_backoff_max_s: float = 300.0
    heartbeat_s: float = 5.0
    peer_series_max: int = 256
    probe_peers_max: int = 16
    room_ttl_s: float = 600.0
    workers: int = 8
    peer_port: int | None = None
    peer_tls_dir: str = ""  # tls.crt, tls.key, ca.crt (see tls.py)
    token_file: str = ""  # PDFABRIC_ENGINE_TOKEN_FILE: the engines read the token there too
    engines: tuple[EngineLaunch, ...] = ()  # PDFABRIC_ENGINES: the serving engines to supervise
    engine_probe_s: float = 2.0
    engine_liveness_s: float = 60.0
    engine_backoff_s: float = 10.0
    engine_backoff_max_s: float = 300.0
    engine_grace_s: float = 30.0


def _int(env: Mapping[str, str], name: str, minimum: int = 1) -> int:
    raw = env.get(name) or SETTINGS[name][0] or ""
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def _float(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name) or SETTINGS[name][0] or ""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def _port(env: Mapping[str, str], name: str) -> int | None:
    if not env.get(name):
        return None
    port = _int(env, name, minimum=0)
    if port > 65535:
        raise ConfigError(f"{name} must be a TCP port, got {port}")
    return port


def own_address() -> str | None:
    """The pod's address as its hostname resolves (Kubernetes writes it to /etc/hosts); None when
    that is a loopback address or does not resolve, as on many developer machines."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(addr).is_loopback else addr


def load_config(env: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    for required in ("NODE_NAME", "PDFABRIC_RANKMAP", "PDFABRIC_ENGINE_TOKEN_FILE"):
        if not env.get(required):
            raise ConfigError(f"{required} is not set: {SETTINGS[required][1]}")
    token_file = env["PDFABRIC_ENGINE_TOKEN_FILE"]
    try:
        with open(token_file, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"PDFABRIC_ENGINE_TOKEN_FILE {token_file!r} cannot be read: {exc}") from None
    if len(token) < 16:
        raise ConfigError("the engine token in PDFABRIC_ENGINE_TOKEN_FILE is shorter than 16 characters")
    tls_dir = env.get("PDFABRIC_PEER_TLS_DIR", "")
    if tls_dir:  # required to serve (require_peer_tls); in-process tests of the agent run without
        try:  # both contexts, so a bad certificate, key or CA is a start-up error naming the variable
            tls.server_context(tls_dir)
            tls.client_context(tls_dir)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"PDFABRIC_PEER_TLS_DIR {tls_dir!r}: cannot load the peer certificate, key or CA: {exc}"
            ) from None
    peers_raw = env.get("PDFABRIC_PEERS") or "{}"
    try:
        peers = json.loads(peers_raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"PDFABRIC_PEERS is not JSON: {exc}") from None
    if not isinstance(peers, dict) or not all(isinstance(v, str) and ":" in v for v in peers.values()):
        raise ConfigError('PDFABRIC_PEERS must map agent names to "host:port" strings')
    pod_ip = env.get("POD_IP", "") or own_address() or ""
    shm_dir = env.get("PDFABRIC_SHM_DIR") or "/dev/shm"
    if not os.path.isdir(shm_dir):
        raise ConfigError(f"PDFABRIC_SHM_DIR {shm_dir!r} is not a directory")
    coalesce_raw = env.get("PDFABRIC_COALESCE", "1")
    if coalesce_raw not in ("0", "1"):
        raise ConfigError(f"PDFABRIC_COALESCE must be 0 or 1, got {coalesce_raw!r}")
    try:
        engines = tuple(decode_launches(env[ENGINES_ENV])) if env.get(ENGINES_ENV) else ()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = AgentConfig(
        node_name=env["NODE_NAME"],
        pod_name=env.get("POD_NAME", ""),
        rankmap_path=env["PDFABRIC_RANKMAP"],
        token=token,
        bind_address=env.get("PDFABRIC_BIND_ADDRESS") or pod_ip or "0.0.0.0",  # 0.0.0.0: no address known
        api_port=_port(env, "PDFABRIC_API_PORT"),
        metrics_port=_port(env, "PDFABRIC_METRICS_PORT"),
        engine_host=env.get("PDFABRIC_ENGINE_HOST") or pod_ip or "127.0.0.1",
        peers=peers,
        peers_file=env.get("PDFABRIC_PEERS_FILE", ""),
        peer_host_template=env.get("PDFABRIC_PEER_HOST_TEMPLATE") or SETTINGS["PDFABRIC_PEER_HOST_TEMPLATE"][0] or "",
        kv_pages=_int(env, "PDFABRIC_KV_PAGES"),
        state_slots=_int(env, "PDFABRIC_STATE_SLOTS"),
        aux_slots=_int(env, "PDFABRIC_AUX_SLOTS"),
        shm_dir=shm_dir,
        coalesce=coalesce_raw == "1",
        bootstrap_timeout_s=_float(env, "PDFABRIC_BOOTSTRAP_TIMEOUT_S"),
        probe_backoff_s=_float(env, "PDFABRIC_PROBE_BACKOFF_S"),
        probe_backoff_max_s=_float(env, "PDFABRIC_PROBE_BACKOFF_MAX_S"),
        heartbeat_s=_float(env, "PDFABRIC_HEARTBEAT_S"),
        peer_series_max=_int(env, "PDFABRIC_PEER_SERIES_MAX", minimum=0),
        probe_peers_max=_int(env, "PDFABRIC_PROBE_PEERS_MAX"),
        room_ttl_s=_float(env, "PDFABRIC_ROOM_TTL_S"),
        workers=_int(env, "PDFABRIC_WORKERS"),
        peer_port=_port(env, "PDFABRIC_PEER_PORT"),
        peer_tls_dir=tls_dir,
        token_file=token_file,
        engines=engines,
        engine_probe_s=_float(env, "PDFABRIC_ENGINE_PROBE_S"),
        engine_liveness_s=_float(env, "PDFABRIC_ENGINE_LIVENESS_S"),
        engine_backoff_s=_float(env, "PDFABRIC_ENGINE_BACKOFF_S"),
        engine_backoff_max_s=_float(env, "PDFABRIC_ENGINE_BACKOFF_MAX_S"),
        engine_grace_s=_float(env, "PDFABRIC_ENGINE_GRACE_S"),
    )
    if cfg.probe_backoff_max_s < cfg.probe_backoff_s:
        raise ConfigError("PDFABRIC_PROBE_BACKOFF_MAX_S must be at least PDFABRIC_PROBE_BACKOFF_S")
    if cfg.engine_backoff_max_s < cfg.engine_backoff_s:
        raise ConfigError("PDFABRIC_ENGINE_BACKOFF_MAX_S must be at least PDFABRIC_ENGINE_BACKOFF_S")
    return cfg


def require_peer_tls(cfg: AgentConfig) -> None:
    """The agent process serves its peer door only with its certificate: no TLS directory, no start."""
    if not cfg.peer_tls_dir:
        raise ConfigError(f"PDFABRIC_PEER_TLS_DIR is not set: {SETTINGS['PDFABRIC_PEER_TLS_DIR'][1]}")


def settings_markdown() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, (default, text) in SETTINGS.items():
        rows.append(
            f"| `{name}` | {'(required)' if default is None else f'`{default}`' if default else '-'} | {text} |"
        )
    return "\n".join(rows) + "\n"
