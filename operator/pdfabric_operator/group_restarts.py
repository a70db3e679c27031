"""A replica over several nodes restarts as a whole: its engines form one torch.distributed group
(SGLang's --nnodes), and a group with a dead node rank is dead. Pure: reads which pods each group
has and which run, and the incarnation remembered for it; returns the pods to delete.

The rule: each group's incarnation is the set of its pods' uids once every member runs. When a
member is gone (killed, evicted, its node lost, rolled) or was replaced by a pod of a new uid,
the members left of the old incarnation are deleted too, so every node rank starts again and the
group forms anew at its leader's rendezvous (a surviving leader would hold the old group's
rendezvous, and a surviving follower would wait on a leader that is gone). Their rooms in flight
fail as any agent's do when its pod goes. Remembered per operator run: after an operator restart
the first complete set is the incarnation (a member replaced while no operator ran is left to the
engines' own restarts)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

from pdfabric_core.spec import PDClusterSpec
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


def group_restarts(
    incarnations: MutableMapping[str, frozenset[str]],
    members: Mapping[str, Sequence[str]],
    running: Mapping[str, str],
) -> list[str]:
    """The pods to delete so that groups restart whole. `running`: pod name -> uid of the pods that
    exist and are not being deleted. Updates `incarnations` (unit -> the uids of its members)."""
    for gone in set(incarnations) - set(members):
        del incarnations[gone]
    doomed: list[str] = []
    for unit, names in sorted(members.items()):
        uids = {n: running[n] for n in names if n in running}
        complete = len(uids) == len(names)
        recorded = incarnations.get(unit)
        old = [n for n, uid in uids.items() if recorded is not None and uid in recorded]
        if recorded is not None and old and len(old) < len(names):
            doomed += sorted(old)  # a member is gone or new: the rest of the old group goes too
        elif complete and not old:
            incarnations[unit] = frozenset(uids.values())  # a whole new incarnation (or the first seen)
    return doomed
