"""EngineRestarted Events: an engine whose restart count grew since the agent's last report.
Pure: reads the reports and the cluster's memory, returns the Events."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.bookkeeping import ClusterMemory
from pdfabric_operator.snapshot import OwnPod


def engine_restarts(
    memory: ClusterMemory, spec: PDClusterSpec, own: Sequence[OwnPod], reports: Mapping[str, AgentReport]
) -> list[tuple[str, str]]:
    """EngineRestarted Events for engines whose restart count grew since the last reading (a
    pod first read that ran before this operator's memory of the cluster began is a baseline; a
    pod that started since counts from 0)."""
    if spec.engine is None:
        memory.engine_restarts.clear()
        memory.restart_baseline = None
        return []
    if memory.restart_baseline is None:
        memory.restart_baseline = {p.uid for p in own}
    pods = {p.uid: p for p in own}
    for uid in set(memory.engine_restarts) - set(pods):
        del memory.engine_restarts[uid]
    memory.restart_baseline &= set(pods)
    events: list[tuple[str, str]] = []
    for uid, report in sorted(reports.items()):
        pod = pods.get(uid)
        if pod is None or report.engines is None:
            continue
        seen = memory.engine_restarts.get(uid)
        baseline = seen is None and uid in memory.restart_baseline
        now: dict[str, int] = {}
        for name, state in sorted(report.engines.items()):
            before = (seen or {}).get(name, state.restarts if baseline else 0)
            if state.restarts > before:
                last = f"; last exit: {state.last_exit}" if state.last_exit else ""
                events.append(
                    (
                        "EngineRestarted",
                        f"engine {name} in pod {pod.name} restarted ({state.restarts} restarts{last})",
                    )
                )
            now[name] = state.restarts
        memory.engine_restarts[uid] = now
    return events
