"""What one reconcile saw, as the status writer reads it: each agent pod (``AgentView``) and the
whole cluster (``Observed``). Pure values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric_core.engines.state import EngineState
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator.placement import Placement, PlacementFailure


@dataclass(frozen=True)
class AgentView:
    """One existing agent pod as the reconcile saw it."""

    name: str
    node: str
    ready: bool
    current: bool  # built for the current placement (same pod hash) and not being deleted
    # What the agent's /readyz says (operator.agentstate): the rank map's transport and the one
    # it carries KV over; they differ after the agent's own fallback. "": not read (yet).
    requested: str = ""
    transport: str = ""
    # With spec.engine: engine name -> its state as the agent's /readyz said it this reconcile
    # (empty: not read; its engines count as not ready). `ready` is then the agent's own word.
    engines: Mapping[str, EngineState] = field(default_factory=dict)
    # Not current, but built for the same ranks and the same agent settings (only the image,
    # resources or pod overrides differ): it serves until the rolling update replaces it.
    serving: bool = False
    # Its /readyz: the digest of the rank map it runs on and why it did not take a newer one
    # ("": not read, or nothing refused); its readiness reason and message.
    rankmap: str = ""
    rankmap_refused: str = ""
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class Observed:
    generation: int
    spec: PDClusterSpec
    outcome: Placement | PlacementFailure | None  # None: the spec itself was unusable
    agents: Sequence[AgentView] = ()
    spec_error: str | None = None
    # Nodes lost under our agents; Degraded while their ranks are not yet Ready elsewhere.
    lost_nodes: Sequence[str] = field(default_factory=tuple)
    namespace: str = ""  # the PDCluster's: the engines' endpoint host names carry it
    router: Mapping[str, Any] | None = None  # spec.router's Deployment as read (its readiness)
    # Agent pods the API server refused to create (admission: Pod Security, quota, a webhook),
    # by name, with its message: Ready is False with reason PodRejected until they are created.
    refused_pods: Mapping[str, str] = field(default_factory=dict)
    # Agent pods the kube-scheduler has not bound, by name, with the node the planner chose and
    # the scheduler's reason: Ready and Placed are False with reason PodUnschedulable meanwhile.
    unschedulable_pods: Mapping[str, str] = field(default_factory=dict)
    rankmap: str = ""  # the digest of the rank map the operator wrote last
