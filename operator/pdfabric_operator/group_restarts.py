"""A replica over several nodes restarts as a whole: its engines form one torch.distributed group
(SGLang's --nnodes), and a group with a dead node rank is dead. Pure: reads which pods each group
has, what each says of its incarnation and how often its engines and containers restarted;
returns the pods to delete and the incarnations to write.

The rule. A group's incarnation is the set of its members' pod uids, with each member's engine
and container restart counts, once every member runs (an engine restart counts from the pod's
start). It is written on every member (the ANN_GROUP_INCARNATION annotation), so an operator that
restarts reads it back instead of forgetting it. A member whose incarnation no longer holds is deleted:
- a member of it is gone (killed, evicted, its node lost, rolled) or replaced by a pod of a new uid;
- an engine of a member restarted (its agent's restart count grew), or a member's container did:
  the other node ranks' engines still hold the dead group's collectives.
So every node rank starts again and the group forms anew at its leader's rendezvous (a surviving
leader would hold the old group's rendezvous, and a surviving follower would wait on a leader that
is gone). Their rooms in flight fail as any agent's do when its pod goes.

A group the kube-scheduler cannot bind whole is released: when a member has stayed unschedulable
for the bind timeout (PDFABRIC_GROUP_BIND_TIMEOUT), every pod of the group is deleted, so the bound
ones do not hold GPUs for a group that cannot run, and the group's pods are created again after a
hold that doubles with each release in a row (from the timeout, at most MAX_HOLD_S), as Kueue's
waitForPodsReady requeues a workload. The planner keeps the group where it was (its capacity said
it fits); what the scheduler saw and the planner did not (CPU or memory requests, another
scheduler's pods) may have changed by then."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.agentstate import AgentReport
from pdfabric_operator.builders.names import agent_name
from pdfabric_operator.placement import Placement


def group_members(cluster: str, spec: PDClusterSpec, placement: Placement) -> dict[str, list[str]]:
    """Unit (prefill-0, decode-3) -> the pod names of each replica over several nodes whose engines
    the pods run (fabric-only: the engines are someone else's, and the agents need no restart)."""
    if spec.engine is None or (spec.prefill.nodes_per_replica == 1 and spec.decode.nodes_per_replica == 1):
        return {}
    out: dict[str, list[str]] = {}
    for a in placement.agents:
        if spec.role(a.ranks[0].role).nodes_per_replica > 1:
            out.setdefault(a.unit, []).append(agent_name(cluster, a.unit, a.node))
    return out


@dataclass(frozen=True)
class MemberPod:
    """A running member of a group (not being deleted, not failed), as the reconcile sees it."""

    uid: str
    incarnation: str = ""  # its ANN_GROUP_INCARNATION ("" until written)
    engine_restarts: int | None = None  # summed over its engines, as its agent said; None: no word
    container_restarts: int = 0  # summed over its containers (the kubelet's restartCount)


def summed_engine_restarts(report: AgentReport | None) -> int | None:
    """How often the engines of a pod restarted, as its agent said (None: it said nothing)."""
    if report is None or report.engines is None:
        return None
    return sum(state.restarts for state in report.engines.values())


@dataclass(frozen=True)
class Counts:
    engine: int
    container: int


def incarnation_word(members: Mapping[str, Counts]) -> str:
    """uid -> counts as the annotation holds it: `uid=engine/container` sorted, comma-separated."""
    return ",".join(f"{uid}={n.engine}/{n.container}" for uid, n in sorted(members.items()))


def parse_incarnation(word: str) -> dict[str, Counts] | None:
    """The annotation read back; None when it is not one (written over: treated as absent)."""
    out: dict[str, Counts] = {}
    for item in word.split(","):
        uid, sep, counts = item.partition("=")
        engine, slash, container = counts.partition("/")
        if not (uid and sep and slash and engine.isdigit() and container.isdigit()):
            return None
        out[uid] = Counts(int(engine), int(container))
    return out or None


@dataclass
class GroupActions:
    delete: dict[str, str] = field(default_factory=dict)  # pod name -> why (the Event's words)
    record: dict[str, str] = field(default_factory=dict)  # pod name -> the incarnation to write


def group_restarts(members: Mapping[str, Sequence[str]], running: Mapping[str, MemberPod]) -> GroupActions:
    """What keeps each group whole. `members`: unit -> its pod names (group_members); `running`: pod
    name -> MemberPod of the pods that exist and are not going away."""
    out = GroupActions()
    for unit, names in sorted(members.items()):
        here = {n: running[n] for n in names if n in running}
        uids = {p.uid for p in here.values()}
        recorded: dict[str, Counts] | None = None
        for name, pod in sorted(here.items()):
            theirs = parse_incarnation(pod.incarnation) if pod.incarnation else None
            if theirs is None:
                continue
            why = _broken(unit, theirs, uids, here)
            if why:
                out.delete[name] = why
            else:
                recorded = theirs
        if out.delete.keys() & here.keys() or len(here) < len(names):
            continue
        if recorded is None:  # complete and unrecorded: a new incarnation (an agent not heard from: 0)
            recorded = {p.uid: Counts(p.engine_restarts or 0, p.container_restarts) for p in here.values()}
        word = incarnation_word(recorded)
        out.record.update({n: word for n, p in sorted(here.items()) if p.incarnation != word})
    return out


def _broken(unit: str, recorded: Mapping[str, Counts], uids: set[str], here: Mapping[str, MemberPod]) -> str:
    """Why the recorded incarnation no longer holds ("" while it does)."""
    if set(recorded) != uids:
        return f"{unit}: a node rank's pod is gone or new; the group restarts whole"
    for name, pod in sorted(here.items()):
        was = recorded[pod.uid]
        if pod.engine_restarts is not None and pod.engine_restarts > was.engine:
            return f"{unit}: the engine in pod {name} restarted; the group restarts whole"
        if pod.container_restarts > was.container:
            return f"{unit}: a container of pod {name} restarted; the group restarts whole"
    return ""


MAX_HOLD_S = 3600.0


@dataclass(frozen=True)
class Unbound:
    """A member pod the scheduler has not bound: since when it says so, and its words."""

    since: datetime
    message: str


@dataclass
class GroupHolds:
    """Released groups, kept between reconciles: unit -> (until when its pods are not created, the
    cause); unit -> releases in a row (reset once the group is bound whole). Lost with the operator:
    a new one tries the group again at once."""

    until: dict[str, tuple[datetime, str]] = field(default_factory=dict)
    releases: dict[str, int] = field(default_factory=dict)


def release_stalled(
    holds: GroupHolds,
    members: Mapping[str, Sequence[str]],
    present: Sequence[str],
    unbound: Mapping[str, Unbound],
    now: datetime,
    timeout_s: float,
) -> dict[str, str]:
    """Groups to release now: unit -> why (the Event's words). Updates `holds`: holds that ended are
    dropped, each released group gets one. `present`: the names of the pods that exist."""
    for unit in [u for u, (until, _) in holds.until.items() if until <= now or u not in members]:
        del holds.until[unit]
    for unit in set(holds.releases) - set(members):
        del holds.releases[unit]
    released: dict[str, str] = {}
    for unit, names in sorted(members.items()):
        if unit in holds.until:
            continue
        stalled = sorted(n for n in names if n in unbound and now - unbound[n].since >= timedelta(seconds=timeout_s))
        if not stalled:
            if all(n in present and n not in unbound for n in names):
                holds.releases.pop(unit, None)  # bound whole: the next release starts from the timeout
            continue
        count = holds.releases.get(unit, 0) + 1
        hold = min(timeout_s * 2 ** (count - 1), MAX_HOLD_S)
        cause = f"pod {stalled[0]} not scheduled for {timeout_s:.0f} s: {unbound[stalled[0]].message}"
        holds.releases[unit] = count
        holds.until[unit] = (now + timedelta(seconds=hold), cause)
        released[unit] = f"{unit} released ({cause}); its pods are deleted and created again in {hold:.0f} s"
    return released


def held_pods(holds: GroupHolds, members: Mapping[str, Sequence[str]], now: datetime) -> dict[str, str]:
    """Pod name -> why it is not created now, for the pods of released groups still held."""
    out: dict[str, str] = {}
    for unit, (until, cause) in sorted(holds.until.items()):
        left = (until - now).total_seconds()
        if left <= 0:
            continue
        for name in members.get(unit, ()):
            out[name] = f"group {unit} released ({cause}); created again in {left:.0f} s"
    return out
