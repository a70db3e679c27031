"""What the agents themselves say, read from their /readyz: the transport they carry KV over and,
with spec.engine, their own readiness and each engine they run.

The operator places agents for the rank map's transport; an agent re-checks its node's hardware
and, when the spec declares placement.fallback TCP, may carry KV over tcp instead (labels lied:
no RDMA device, no peer access). Only the agent knows. Its /readyz (the metrics port, the one the
kubelet probes) says ``transport`` and ``requested`` once chosen; the operator reads it once per
agent pod (the choice is fixed for the process's life), with no Kubernetes API permission beyond
what it has: it is an HTTP GET to the pod's address. The agents' NetworkPolicy lets the operator's
namespace reach the metrics port (``builders.services.build_network_policy``).

With spec.engine the same body lists the agent's engines (``engines``: pdfabric_core.engines'
EngineState, ``enginesReady``) and says the agent's own readiness (``ready``), apart from the
pod's Ready (which also waits for the engines). Engines come and go (restarts, health), so the
operator reads every pod of such a cluster on every reconcile, concurrently, 1 s each. A read
that times out leaves the agent's last word standing for SILENT_READS_TOLERATED reads in a row (a
kubelet's readiness probe likewise fails a pod only at its third failure): on a busy node one
slow answer would otherwise list every engine of that pod as not ready, for a reconcile, to the PD
routers that follow the status. After that, or when nobody answers at all (refused), it is no word
(its engines count as not ready); a pod that fails or goes is not asked any more.

``PDFABRIC_AGENT_ADDRESSES`` (operator setting) names a JSON file {pod name: "host:port"} that
replaces pod IP and metrics port, for agents run as local processes (hack/pdfabric_devcluster).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdfabric_core.engines.launch import MAX_LAUNCHES
from pdfabric_core.engines.state import EngineState

log = logging.getLogger("pdfabric.operator.agents")

READ_TIMEOUT_S = 1.0
SILENT_READS_TOLERATED = 2  # the third unanswered read in a row is no word (failureThreshold 3)
MAX_BODY = 64 * 1024  # a /readyz body is a few hundred bytes


@dataclass(frozen=True)
class AgentTransport:
    """One agent's word on its transport: in use, and asked for by the rank map."""

    requested: str
    transport: str
    message: str = ""

    @property
    def fell_back(self) -> bool:
        return bool(self.requested) and self.transport != self.requested


@dataclass(frozen=True)
class AgentAddress:
    uid: str  # the pod's: a replaced pod is a new agent, read again
    name: str
    ip: str


def parse_readyz(body: object) -> AgentTransport | None:
    """The transport fields of a /readyz body; None when it has none (not chosen yet, an old agent)."""
    if not isinstance(body, dict):
        return None
    transport, requested = body.get("transport"), body.get("requested")
    if not isinstance(transport, str) or not isinstance(requested, str) or not transport:
        return None
    message = body.get("message")
    return AgentTransport(requested[:64], transport[:64], message[:512] if isinstance(message, str) else "")


@dataclass(frozen=True)
class AgentReport:
    """One agent's /readyz: its own readiness (None: the body does not say), its transport (None:
    not chosen yet), its engines by name (None: the body lists none, e.g. fabric-only)."""

    ready: bool | None = None
    transport: AgentTransport | None = None
    engines: Mapping[str, EngineState] | None = None
    rankmap: str = ""  # the digest of the rank map it runs on ("": it does not say)
    rankmap_refused: str = ""  # why it did not take the newest map it read
    reason: str = ""  # its readiness reason and message, as it says them
    message: str = ""


def parse_engines(body: object) -> dict[str, EngineState] | None:
    """The engines of a /readyz body by name; None when it lists none. Malformed entries are
    left out (the operator does not crash on another process's word)."""
    if not isinstance(body, dict) or not isinstance(body.get("engines"), list):
        return None
    out: dict[str, EngineState] = {}
    for raw in body["engines"][:MAX_LAUNCHES]:
        state = EngineState.from_json(raw)
        if state is not None:
            out[state.name] = state
    return out


def parse_report(body: object) -> AgentReport | None:
    """A /readyz body as the operator reads it; None when it is no object."""
    if not isinstance(body, dict):
        return None
    ready = body.get("ready")

    def text(key: str, cap: int) -> str:
        value = body.get(key)
        return value[:cap] if isinstance(value, str) else ""

    return AgentReport(
        ready if isinstance(ready, bool) else None,
        parse_readyz(body),
        parse_engines(body),
        rankmap=text("rankmap", 64),
        rankmap_refused=text("rankmapRefused", 512),
        reason=text("reason", 64),
        message=text("message", 512),
    )


def overrides(path: str) -> dict[str, str]:
    """The PDFABRIC_AGENT_ADDRESSES file, re-read each time (a local runner rewrites it)."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


# What _read gives for an agent that did not answer in READ_TIMEOUT_S (busy, not gone): an object
# of its own, so that no JSON body an agent sends can pass for it.
SLOW = object()


async def _read(session: aiohttp.ClientSession, url: str) -> Any:
    """The JSON body /readyz answers with, whatever its status (503 while not ready); SLOW if it
    did not come in time; None if none (refused, reset, not JSON)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)) as resp:
            raw = await resp.content.read(MAX_BODY)
        return json.loads(raw)
    except TimeoutError:  # aiohttp's timeouts are TimeoutErrors too
        return SLOW
    except (aiohttp.ClientError, OSError, ValueError):
        return None


def _urls(pods: Iterable[AgentAddress], metrics_port: int, overrides_path: str) -> dict[str, str]:
    addresses = overrides(overrides_path)
    todo: dict[str, str] = {}
    for pod in pods:
        address = addresses.get(pod.name) or (f"{pod.ip}:{metrics_port}" if pod.ip else "")
        if address:
            todo[pod.uid] = f"http://{address}/readyz"
    return todo


async def _read_all(urls: Mapping[str, str]) -> dict[str, Any]:
    if not urls:
        return {}
    async with aiohttp.ClientSession() as session:
        bodies = await asyncio.gather(*(_read(session, url) for url in urls.values()))
    return dict(zip(urls, bodies, strict=True))


async def read_transports(
    pods: Iterable[AgentAddress], metrics_port: int, known: Mapping[str, AgentTransport], overrides_path: str = ""
) -> dict[str, AgentTransport]:
    """The transports of ``pods`` not in ``known`` (by pod uid), read concurrently; an agent that
    does not answer (yet) is left out and read again next time."""
    bodies = await _read_all(_urls((p for p in pods if p.uid not in known), metrics_port, overrides_path))
    parsed = {uid: parse_readyz(body) for uid, body in bodies.items()}
    return {uid: r for uid, r in parsed.items() if r is not None}


@dataclass(frozen=True)
class AgentReads:
    """One round of /readyz reads: the pods that answered (by uid) and those too slow to."""

    reports: dict[str, AgentReport]
    slow: frozenset[str]


async def read_agents(pods: Iterable[AgentAddress], metrics_port: int, overrides_path: str = "") -> AgentReads:
    """Every pod's /readyz now, read concurrently; a pod that does not answer (or has no address
    yet) has no report, and is among ``slow`` when its read timed out."""
    bodies = await _read_all(_urls(pods, metrics_port, overrides_path))
    parsed = {uid: parse_report(body) for uid, body in bodies.items()}
    return AgentReads(
        {uid: r for uid, r in parsed.items() if r is not None},
        frozenset(uid for uid, body in bodies.items() if body is SLOW),
    )


async def read_reports(
    pods: Iterable[AgentAddress], metrics_port: int, overrides_path: str = ""
) -> dict[str, AgentReport]:
    """Every pod's /readyz now (by pod uid), read concurrently; a pod that does not answer (or
    has no address yet) is left out."""
    return (await read_agents(pods, metrics_port, overrides_path)).reports


def heard(
    asked: Iterable[str], reads: AgentReads, last: Mapping[str, AgentReport], silent: dict[str, int]
) -> dict[str, AgentReport]:
    """The word to act on for each pod ``asked`` (by uid): its answer this time; else, when its
    read timed out, its ``last`` word while it has been slow for at most SILENT_READS_TOLERATED
    reads in a row; else none (refused: nobody listens). ``silent`` counts each pod's slow reads
    in a row and forgets pods no longer asked."""
    asked = list(asked)
    out: dict[str, AgentReport] = {}
    for uid in asked:
        if uid in reads.reports:
            silent.pop(uid, None)
            out[uid] = reads.reports[uid]
        elif uid in reads.slow:
            silent[uid] = silent.get(uid, 0) + 1
            if silent[uid] <= SILENT_READS_TOLERATED and uid in last:
                out[uid] = last[uid]
        else:
            silent.pop(uid, None)
    for gone in set(silent) - set(asked):
        del silent[gone]
    return out
