"""What the process holds scales with its rank map: the peer door's connection bound follows the
map's agents, and the descriptor limit is raised to hold them."""

from __future__ import annotations

import contextlib
import resource

from pdfabric_agent.http.guard import Guard, peer_door_bound
from pdfabric_agent.service.agent import Agent

DESCRIPTOR_CEILING = 1 << 20  # the soft descriptor limit where the hard one is unlimited


def size_peer_door(door: Guard | None, agent: Agent) -> None:
    """The peer door's connection bound for the rank map in use (guard.peer_door_bound)."""
    if door is not None:
        door.max_connections = peer_door_bound(len(agent.rankmap.agents), door.limits)


def raise_descriptor_limit() -> tuple[int, int]:
    """The soft descriptor limit up to the hard one: the peer door's bound grows with the rank map
    (3 connections a peer agent), past a container's usual soft limit of 1,024 for a map of a few
    hundred agents. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = DESCRIPTOR_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
