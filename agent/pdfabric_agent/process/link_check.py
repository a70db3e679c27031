"""The pre-flight link check as the agent's start runs it: probe.py's probes, and what /readyz says
until they pass."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdfabric_agent.http.server import Readiness
from pdfabric_agent.node import probe
from pdfabric_agent.protocol.peer_wire import PROBE_PATH
from pdfabric_agent.service.agent import Agent

log = logging.getLogger("pdfabric.agent")


async def link_check(readiness: Readiness, check: probe.LinkCheck, agent: Agent, stop: asyncio.Event) -> None:
    """The pre-flight link check (probe.py) before Ready; below spec.transfer.minProbeGBps, not
    Ready with the slow peer named, probing again every RETRY_S until fast enough or stopped."""

    async def fetch(peer: str) -> dict[str, object]:
        return await agent.peers.get_json(peer, PROBE_PATH)

    said: list[str] = []

    def waiting(message: str) -> None:  # said on /readyz (the operator shows it), logged once per change
        readiness.message = message
        if not said or said[-1].split(";")[0] != message.split(";")[0]:
            log.warning("%s", message)
        said.append(message)

    readiness.reason, readiness.message = "Probing", f"link check of {check.measured_pairs} peer ranks"
    await check.run(fetch, agent.ctx.workers, waiting=waiting)
    while check.refused and not stop.is_set():
        # Peers whose rank map does not list this agent yet: not Ready (engines would be sent
        # requests whose KV those peers refuse); they adopt the operator's new map in seconds.
        readiness.reason = probe.REASON_PEERS_BEHIND
        waiting(check.refusals())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        if not stop.is_set():
            await check.run(fetch, agent.ctx.workers, discover_s=0, only=set(check.refused))
    while check.slow() and not stop.is_set():
        readiness.reason, readiness.message = probe.REASON_SLOW, check.verdict()
        log.warning("%s", readiness.message)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), probe.RETRY_S)
        if not stop.is_set():
            await check.run(fetch, agent.ctx.workers, discover_s=0)
    log.info("%s", check.summary())
