"""What the agents themselves say about the transport they carry KV over, read from their /readyz.

The operator places agents for the rank map's transport; an agent re-checks its node's hardware
and, when the spec declares placement.fallback TCP, may carry KV over tcp instead (labels lied:
no RDMA device, no peer access). Only the agent knows. Its /readyz (the metrics port, the one the
kubelet probes) says ``transport`` and ``requested`` once chosen; the operator reads it once per
agent pod (the choice is fixed for the process's life), with no Kubernetes API permission beyond
what it has: it is an HTTP GET to the pod's address. The agents' NetworkPolicy lets the operator's
namespace reach the metrics port (``builders.build_network_policy``).

``PDFABRIC_AGENT_ADDRESSES`` (operator setting) names a JSON file {pod name: "host:port"} that
replaces pod IP and metrics port, for agents run as local processes (hack/pdfabric_devcluster).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("pdfabric.operator.agents")

READ_TIMEOUT_S = 1.0
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


async def _read(session: aiohttp.ClientSession, url: str) -> AgentTransport | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)) as resp:
            raw = await resp.content.read(MAX_BODY)
        return parse_readyz(json.loads(raw))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


async def read_transports(
    pods: Iterable[AgentAddress], metrics_port: int, known: Mapping[str, AgentTransport], overrides_path: str = ""
) -> dict[str, AgentTransport]:
    """The transports of ``pods`` not in ``known`` (by pod uid), read concurrently; an agent that
    does not answer (yet) is left out and read again next time."""
    addresses = overrides(overrides_path)
    todo: dict[str, str] = {}
    for pod in pods:
        if pod.uid in known:
            continue
        address = addresses.get(pod.name) or (f"{pod.ip}:{metrics_port}" if pod.ip else "")
        if address:
            todo[pod.uid] = f"http://{address}/readyz"
    if not todo:
        return {}
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(_read(session, url) for url in todo.values()))
    return {uid: r for uid, r in zip(todo, results, strict=True) if r is not None}
