"""The network around the node pods: the agents' headless Service (the peers' DNS names), the
engines' per-role Services and endpoints (what a PD router needs), and the NetworkPolicy."""

from __future__ import annotations

from typing import Any

from pdfabric_core.engines.groups import (
    EngineGroup,
    bootstrap_port,
    dist_init_port,
    group_node_rank,
    is_group_leader,
    serving_port,
)
from pdfabric_core.policy.types import Role
from pdfabric_core.spec import ENGINE_PORT_SPAN, PDClusterSpec
from pdfabric_operator import constants as c
from pdfabric_operator import engines as e
from pdfabric_operator.builders.names import (
    ClusterRef,
    agent_name,
    engine_service_name,
    network_policy_name,
    object_meta,
    service_name,
)
from pdfabric_operator.placement import Placement


def build_headless_service(ref: ClusterRef, spec: PDClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(ref, service_name(ref.name)),
        "spec": {
            "clusterIP": "None",
            # Peers must find each other before they are Ready: readiness waits on the peers.
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_AGENT},
            # The peer door and metrics; the engine door is on each pod's loopback, not on the network.
            "ports": [
                {"name": "peer", "port": spec.agent.peer_port, "targetPort": "peer", "protocol": "TCP"},
                {"name": "metrics", "port": spec.agent.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def build_engine_service(
    ref: ClusterRef, spec: PDClusterSpec, placement: Placement, role: Role
) -> dict[str, Any] | None:
    """The headless Service of `role`'s engines, None without spec.engine. It selects the node
    pods that run an engine of the role; its ports are named after the engines' (the k-th engine
    of the role in a pod: http-k, and boot-k for prefill's bootstrap server), so each port's
    endpoints are exactly the pods that have a k-th engine, and only Ready ones (a router's view)."""
    if spec.engine is None:
        return None
    most = max((sum(1 for g in e.groups(a) if g.role is role) for a in placement.agents), default=0)
    ports: list[dict[str, Any]] = []
    for k in range(max(1, most)):
        group = EngineGroup(role, 0, k, ())
        ports.append({"name": f"http-{k}", "port": serving_port(spec.engine, group), "targetPort": group.port_name})
        boot = bootstrap_port(spec.engine, group)
        if boot is not None:
            ports.append({"name": f"boot-{k}", "port": boot, "targetPort": group.bootstrap_port_name})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            ref, engine_service_name(ref.name, role.value), **{c.LABEL_COMPONENT: f"{role.value}-engines"}
        ),
        "spec": {
            "clusterIP": "None",
            "selector": {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_SERVES[role.value]: "true"},
            "ports": [dict(p, protocol="TCP") for p in ports],
        },
    }


def engine_endpoints(
    cluster: str, namespace: str, spec: PDClusterSpec, placement: Placement
) -> dict[str, list[dict[str, Any]]]:
    """Where each engine serves, per role, by replica: its pod's stable name under the agents'
    headless Service (it resolves before the pod is Ready and stays with the node), its serving
    URL and, for prefill, its bootstrap address. What the status lists for a PD router and what
    the operator's router is started with."""
    assert spec.engine is not None
    endpoints: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for a, g in e.groups_of(placement.agents):
        if group_node_rank(spec, g):
            continue  # a replica over several nodes serves from its leader; the others run its ranks
        pod = agent_name(cluster, a.unit, a.node)
        host = f"{pod}.{service_name(cluster)}.{namespace}.svc"
        entry: dict[str, Any] = {
            "replica": g.replica,
            "node": a.node,
            "pod": pod,
            "engine": g.name,
            "url": f"http://{host}:{serving_port(spec.engine, g)}",
        }
        boot = bootstrap_port(spec.engine, g)
        if boot is not None:
            entry["bootstrap"] = f"{host}:{boot}"
            entry["bootstrapPort"] = boot
        endpoints[g.role.value].append(entry)
    for entries in endpoints.values():
        entries.sort(key=lambda x: x["replica"])
    return endpoints


def build_network_policy(
    ref: ClusterRef, spec: PDClusterSpec, monitoring_namespace: str = "", operator_namespace: str = ""
) -> dict[str, Any]:
    """Ingress to the agent pods: everything from this cluster's agents (the peer door, and
    Mooncake's handshake and data listeners, whose ports the engine picks at random and which
    accept writes into registered memory from anyone who reaches them), and the metrics port
    from pods in `monitoring_namespace` (Prometheus) and `operator_namespace` (the operator reads
    each agent's /readyz there: the transport it really carries, agentstate.py), from anywhere
    when the first is empty. The
    node's own traffic (kubelet probes) is always allowed by NetworkPolicy. The engine door is
    on the pod's loopback and needs no rule. Enforced only where the cluster's network plugin
    enforces NetworkPolicy; the operator's settings turn it off (config.py)."""
    agents = {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_AGENT}
    metrics: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": spec.agent.metrics_port}]}
    if monitoring_namespace:
        names = [
            monitoring_namespace,
            *([operator_namespace] if operator_namespace not in ("", monitoring_namespace) else []),
        ]
        # kubernetes.io/metadata.name is set by the API server on every namespace
        sources = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": n}}} for n in names]
        metrics = {"from": sources, **metrics}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(ref, network_policy_name(ref.name)),
        "spec": {
            "podSelector": {"matchLabels": agents},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": agents}}]},
                metrics,
                *_engine_ingress(spec),
            ],
        },
    }


def _engine_ingress(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """With spec.engine: the engines' serving ports from anywhere (the router and its clients);
    prefill's bootstrap ports are asked by decode engines only, which the agents' rule admits."""
    if spec.engine is None:
        return []
    span = ENGINE_PORT_SPAN - 1
    ports = [
        {"protocol": "TCP", "port": base, "endPort": base + span}
        for base in (spec.engine.prefill.port, spec.engine.decode.port)
    ]
    return [{"ports": ports}]


def group_leaders(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> dict[tuple[Role, int], str]:
    """(role, replica) -> the rendezvous host:port of each replica over several nodes: its node
    rank 0 pod under the headless Service (it resolves before the pod is Ready), the port of that
    pod's engine. {} when every replica fits one node (fabric-only: no engines to tell)."""
    if spec.engine is None or (spec.prefill.nodes_per_replica == 1 and spec.decode.nodes_per_replica == 1):
        return {}
    leaders = {}
    for a, g in e.groups_of(placement.agents):
        if is_group_leader(spec, g):
            host = f"{agent_name(ref.name, a.unit, a.node)}.{service_name(ref.name)}.{ref.namespace}.svc"
            leaders[(g.role, g.replica)] = f"{host}:{dist_init_port(spec.engine, g)}"
    return leaders
