"""Live membership: a running agent moves to a newer rank map without a restart.

The operator rewrites the rank map when a role is scaled: agents are added (new replicas) and
dropped (replicas scaled away); the agents whose own ranks did not move keep their pods, engines
and rooms. Each one re-reads the mounted map (``process/rankmap_file.py``) and adopts it here:

- A map it cannot run on is refused, and the agent goes on with the one it has: another cluster's;
  one without this agent (its pod is being deleted) or with its ranks moved (its pod is being
  replaced); one whose spec changed what the agent set itself up from (``agent_setup``: the pod is
  being replaced too). The refusal is counted and said on /readyz.
- An added agent is a peer at once: the peer door admits its certificate, rooms may name its ranks.
- A dropped agent stays a peer for ``leave_grace_s`` (the longest a room may take), so the rooms it
  has open drain while its pod stops (its engines finish their requests on SIGTERM), and new rooms
  may still name its ranks (a router that has not heard of the scale-down). Rooms that
  still involve it then fail with a reason that says it left, and it is forgotten: its health,
  its metric series.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric_core.rankmap import RankMap
from pdfabric_core.spec import PDClusterSpec, SpecError, parse_spec


class MembershipRefused(Exception):
    """A newer rank map this agent cannot run on; the message says why."""


@dataclass(frozen=True)
class Adopted:
    digest: str
    added: tuple[str, ...]
    dropped: tuple[str, ...]

    def summary(self) -> str:
        parts = [f"rank map {self.digest}"]
        if self.added:
            parts.append(f"added {', '.join(self.added)}")
        if self.dropped:
            parts.append(f"dropped {', '.join(self.dropped)}")
        return "; ".join(parts)


def check_adoptable(current: RankMap, spec: PDClusterSpec, new: RankMap, own_agent: str) -> PDClusterSpec:
    """The spec of `new` when this agent (`own_agent`) can run on it, else MembershipRefused."""
    if new.cluster_uid != current.cluster_uid:
        raise MembershipRefused(f"the rank map is cluster {new.cluster_uid}'s, this agent serves {current.cluster_uid}")
    mine = current.agent_named(own_agent)
    try:
        theirs = new.agent_named(own_agent)
    except LookupError:
        raise MembershipRefused(
            f"the rank map no longer lists {own_agent} (its replica was scaled away: its pod is being deleted)"
        ) from None
    if theirs.ranks != mine.ranks or theirs.node != mine.node:
        raise MembershipRefused(f"the rank map moved {own_agent}'s ranks (its pod is being replaced)")
    if new.transport != current.transport:
        raise MembershipRefused(
            f"the rank map's transport is {new.transport}, this agent runs {current.transport} (its pod is being replaced)"
        )
    try:
        new_spec = parse_spec(new.spec)
    except SpecError as exc:
        raise MembershipRefused(f"the rank map's spec is invalid: {exc}") from None
    if new_spec.agent_setup() != spec.agent_setup():
        raise MembershipRefused(
            "the rank map's spec changed what this agent set itself up from (backend, transfer, model or "
            "ports): its pod is being replaced"
        )
    return new_spec
