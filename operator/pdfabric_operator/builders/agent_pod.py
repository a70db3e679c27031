"""The node pods: one per placement unit, with its ranks' GPUs (and RDMA device), pinned to the
planner's node by required node affinity and bound there by the kube-scheduler; with spec.engine
the same container runs the engines. The pod and config hashes say when a pod must be replaced."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdfabric_core.engines.groups import group_node_rank
from pdfabric_core.policy.transports import transport_traits
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import RANKMAP_KEY
from pdfabric_core.spec import PDClusterSpec
from pdfabric_operator import constants as c
from pdfabric_operator import engines as e
from pdfabric_operator import scheduling as sched
from pdfabric_operator.builders.disruption import budget_of
from pdfabric_operator.builders.names import (
    ClusterRef,
    agent_name,
    dns_label,
    engine_token_secret_name,
    object_meta,
    peer_tls_secret_name,
    rankmap_name,
    service_name,
    short_hash,
)
from pdfabric_operator.builders.pod_spec import (
    apply_pod_overrides,
    pod_metadata,
    pod_security_context,
    unprivileged_container,
)
from pdfabric_operator.builders.rankmap import encode_ranks
from pdfabric_operator.builders.services import group_leaders
from pdfabric_operator.placement import AgentPlacement, Placement


def agent_device_requests(spec: PDClusterSpec, agent: AgentPlacement, transport: Transport) -> dict[str, int]:
    """Extended resources one agent pod holds: its ranks' GPUs, and one RDMA device when the
    transport needs one (its `device_resource` trait)."""
    requests = {spec.placement.gpu_resource: agent.gpus}
    if transport_traits(transport).device_resource:
        requests[spec.placement.rdma_resource] = 1
    return requests


def _resources(spec: PDClusterSpec, agent: AgentPlacement, transport: Transport) -> dict[str, Any]:
    if spec.engine is None:
        user = spec.agent.resources or {}
        requests = dict(user.get("requests") or {})
        limits = dict(user.get("limits") or {})
    else:
        # One container runs the agent and every engine of the node: their resources, added up.
        summed = e.container_resources(spec, agent)
        requests, limits = summed["requests"], summed["limits"]
    # Every GPU of the node's ranks, engines or not (the agent hands each engine its own); and
    # extended resources cannot overcommit: request == limit, both set.
    devices = agent_device_requests(spec, agent, transport)
    extended = {k: str(v) for k, v in devices.items()}
    requests.update(extended)
    limits.update(extended)
    return {"requests": requests, "limits": limits}


def agent_config_hash(spec: PDClusterSpec, placement: Placement) -> str:
    """What an agent sets itself up from at start (spec.agent_setup, and the transport): a change
    restarts it.

    Placement settings and replica counts are not in it: they move ranks, which the ranks
    annotation already tracks, or only tell running agents of their peers (the rank map).
    """
    config = {**spec.agent_setup(), "transport": placement.transport.value}
    return short_hash(json.dumps(config, sort_keys=True, default=str), 16)


def build_agent_pod(
    ref: ClusterRef,
    spec: PDClusterSpec,
    placement: Placement,
    agent: AgentPlacement,
    leaders: Mapping[tuple[Role, int], str] | None = None,
) -> dict[str, Any]:
    """The agent of one node, with its ranks' GPUs: pinned to the planner's node by required node
    affinity (scheduling.py), bound there by the kube-scheduler, never by spec.nodeName.
    `leaders`: group_leaders' rendezvous addresses, for engines of a replica over several nodes."""
    name = agent_name(ref.name, agent.unit, agent.node)
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.agent_image,
        "command": [c.AGENT_COMMAND],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            # The agent binds and advertises its engine on the pod address.
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Peers by DNS under the headless Service, spelled with the name this builder gave it
            # (it differs from "<cluster>-agents" when a long or dotted cluster name was shortened).
            {"name": "PDFABRIC_PEER_HOST_TEMPLATE", "value": "{name}." + service_name(ref.name) + ".{namespace}.svc"},
            {"name": "PDFABRIC_RANKMAP", "value": c.RANKMAP_PATH},
            {"name": "PDFABRIC_ENGINE_TOKEN_FILE", "value": c.ENGINE_TOKEN_PATH},
            {"name": "PDFABRIC_PEER_TLS_DIR", "value": c.PEER_TLS_DIR},
            {"name": "PDFABRIC_METRICS_PORT", "value": str(spec.agent.metrics_port)},
            # The engine door binds 127.0.0.1 in the pod: no containerPort, nothing outside reaches it.
            {"name": "PDFABRIC_API_PORT", "value": str(spec.agent.api_port)},
            {"name": "PDFABRIC_PEER_PORT", "value": str(spec.agent.peer_port)},
        ],
        "ports": [
            {"name": "peer", "containerPort": spec.agent.peer_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": spec.agent.metrics_port, "protocol": "TCP"},
        ],
        "resources": _resources(spec, agent, placement.transport),
        "readinessProbe": {
            "httpGet": {"path": c.READINESS_PATH, "port": "metrics"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        # The agent's liveness endpoint answers while the process serves; restart it when it stops.
        "livenessProbe": {
            "httpGet": {"path": c.LIVENESS_PATH, "port": "metrics"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "rankmap", "mountPath": c.RANKMAP_DIR, "readOnly": True},
            {"name": "engine-token", "mountPath": c.ENGINE_TOKEN_DIR, "readOnly": True},
            {"name": "peer-tls", "mountPath": c.PEER_TLS_DIR, "readOnly": True},
            {"name": "home", "mountPath": c.HOME_DIR},
        ],
        # Nothing the agent or an engine does needs a capability or a privilege gain (Landlock, the
        # engines' sandbox, needs neither); dropping CAP_SYS_PTRACE is what keeps a sandboxed engine
        # from tracing the agent.
        "securityContext": unprivileged_container(),
    }
    container["env"].append({"name": "HOME", "value": c.HOME_DIR})  # the pod's user may have no home of its own
    volumes: list[dict[str, Any]] = []
    if spec.engine is not None:
        # One container: the engine image runs the agent, and the agent runs the node's engines
        # (PDFABRIC_ENGINES) with their ranks' GPUs; the pod serves on each engine's ports.
        container["image"] = spec.engine.image
        container["env"] += e.engine_env(spec, agent, leaders)
        container["ports"] += e.engine_ports(spec, agent)
        # The agent maps the engines' CPU buffers from the same shared-memory files.
        container["volumeMounts"].append(e.shm_mount())
        volumes.append(e.shm_volume(spec.engine))
    pod_spec: dict[str, Any] = {
        # The scheduler binds it (taints, cordons, fit, priority and quotas apply); the affinity
        # allows only the node the planner chose, so placement stays the planner's.
        "affinity": sched.node_affinity(
            agent.node, sched.placement_labels(spec, agent.domain), spec.agent.pod.affinity
        ),
        "hostname": name,
        "subdomain": service_name(ref.name),
        "restartPolicy": "Always",
        # The agent talks to nothing in the API; it needs no token of its own.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 15,
        # The planner filters nodes with these same tolerations (planner.usable_nodes).
        "tolerations": sched.node_pod_tolerations(spec),
        "securityContext": pod_security_context(spec.agent.run_as_user),
        "containers": [container],
        "volumes": [
            {
                "name": "rankmap",
                "configMap": {"name": rankmap_name(ref.name), "items": [{"key": RANKMAP_KEY, "path": RANKMAP_KEY}]},
            },
            # Readable by the pod's user and group (fsGroup), nobody else.
            {
                "name": "engine-token",
                "secret": {"secretName": engine_token_secret_name(ref.name), "defaultMode": 0o440},
            },
            # This pod's own certificate and key (issued when the pod is created), and the CA.
            {"name": "peer-tls", "secret": {"secretName": peer_tls_secret_name(name), "defaultMode": 0o440}},
            {"name": "home", "emptyDir": {}},
            *volumes,
        ],
    }
    if spec.engine is not None:
        # Engines load models for minutes and drain requests on SIGTERM: give them longer.
        pod_spec["terminationGracePeriodSeconds"] = e.TERMINATION_GRACE_S
    apply_pod_overrides(pod_spec, container, spec.agent.pod)
    # A pod serves a role when it runs one of its engines' HTTP front: node rank 0 of a replica
    # over several nodes (the others answer only health checks).
    serving = [g for g in e.groups(agent) if not group_node_rank(spec, g)] if spec.engine is not None else []
    roles = {g.role for g in serving}
    role_labels = {c.LABEL_SERVES[r.value]: "true" for r in sorted(roles)}
    meta = object_meta(
        ref,
        name,
        **{c.LABEL_COMPONENT: c.COMPONENT_AGENT, c.LABEL_NODE: dns_label(agent.node, 63)},
        **role_labels,
    )
    meta["labels"] = pod_metadata(meta["labels"], {}, spec.agent.pod)["labels"]
    ranks = encode_ranks(agent.ranks)
    config = agent_config_hash(spec, placement)
    # The hash covers everything the pod was built from, including the settings the agent reads
    # from the rank map at start; a differing hash means "replace the pod" (pod specs are mostly
    # immutable, so drift is fixed by delete + create, never by patch).
    # The affinity is left out: it only pins the pod to its node (its name says which) and the
    # labels it was chosen for, and is read only when the pod is scheduled; a nodeSelector edit
    # that leaves the ranks where they are must not restart the agents.
    # The user's part of it (spec.agent.pod.affinity) is in, with the user's annotations.
    hashed = {k: v for k, v in pod_spec.items() if k != "affinity"}
    user = [spec.agent.pod.affinity, spec.agent.pod.annotations]
    pod_hash = short_hash(json.dumps([hashed, meta["labels"], ranks, config, *user], sort_keys=True), 16)
    meta["annotations"] = pod_metadata(
        {},
        {
            c.ANN_RANKS: ranks,
            c.ANN_POD_HASH: pod_hash,
            c.ANN_CONFIG_HASH: config,
            # The node the planner chose, readable before the scheduler binds the pod (spec.nodeName).
            c.ANN_NODE: agent.node,
        },
        spec.agent.pod,
    )["annotations"]
    # Out of the hash: the operator labels a running pod in place (children.ensure_budget_labels),
    # so a new budget reaches the pods of an upgraded operator without restarting them.
    meta["labels"][c.LABEL_DISRUPTION_BUDGET] = budget_of(agent)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_agent_pods(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> list[dict[str, Any]]:
    leaders = group_leaders(ref, spec, placement)
    return [build_agent_pod(ref, spec, placement, a, leaders) for a in placement.agents]
