"""Child objects of a PDCluster, as plain dicts: pure functions of (cluster, spec, placement).

Every child carries the same labels and a controller ownerReference to its PDCluster, so the
garbage collector removes whatever the finalizer's cleanup misses, and names are deterministic
(a function of cluster and node), so a reconcile interrupted half-way and run again converges
instead of duplicating.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdfabric_core.engines.groups import EngineGroup, bootstrap_port, serving_port
from pdfabric_core.engines.router import sglang_router_args
from pdfabric_core.policy.transports import transport_traits
from pdfabric_core.policy.types import Role, Transport
from pdfabric_core.rankmap import RANKMAP_KEY, AgentEntry, Rank, RankMap
from pdfabric_core.spec import ENGINE_PORT_SPAN, PDClusterSpec, PodOverrides
from pdfabric_operator import constants as c
from pdfabric_operator import engines as e
from pdfabric_operator import pki
from pdfabric_operator import scheduling as sched
from pdfabric_operator.placement import AgentPlacement, Placement


@dataclass(frozen=True)
class ClusterRef:
    """Identity of the owning PDCluster."""

    namespace: str
    name: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def _short_hash(text: str, n: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _dns_label(text: str, limit: int) -> str:
    text = re.sub(r"[^a-z0-9-]", "-", text.lower())[:limit]
    return text.strip("-") or "x"


def agent_name(cluster: str, unit: str, node: str) -> str:
    """Pod name and hostname of the agent of placement unit `unit` (prefill-0, decode-2, group-1)
    of `cluster` on `node`: a DNS label (<= 63), unique per (unit, node), which a replica spread
    over several nodes needs.

    The hash keeps names distinct when truncation would make two units collide, and gives a unit
    moved to another node a new name (its old pod may still be terminating).
    """
    return f"{_dns_label(f'{cluster}-{unit}', 55)}-{_short_hash(f'{unit}@{node}')}"


def rankmap_name(cluster: str) -> str:
    return f"{cluster}-rankmap"


def engine_token_secret_name(cluster: str) -> str:
    """The engine door's token: mounted into the agent pods (the agent hands its path to the engines it runs)."""
    return f"{cluster}-engine-token"


def ca_secret_name(cluster: str) -> str:
    """The cluster's peer CA with its key: mounted nowhere, read only by the operator."""
    return f"{cluster}-peer-ca"


def peer_tls_secret_name(agent: str) -> str:
    """One agent pod's peer certificate and key (and the CA certificate): mounted into that pod only."""
    return f"{agent}-peer-tls"


def service_name(cluster: str) -> str:
    """Headless service; also the pods' subdomain, so it must be a DNS label."""
    return _dns_label(f"{cluster}-agents", 63)


def network_policy_name(cluster: str) -> str:
    return f"{cluster}-agents"


def engine_service_name(cluster: str, role: str) -> str:
    """The headless Service of one role's engines (spec.engine): <cluster>-prefill, <cluster>-decode."""
    return _dns_label(f"{cluster}-{role}", 63)


def engine_service_names(cluster: str) -> list[str]:
    return [engine_service_name(cluster, r.value) for r in Role]


def shared_children(cluster: str) -> list[tuple[str, str]]:
    """(kind, name) of the children every agent of `cluster` shares: rank map, Service, engine
    token, peer CA, NetworkPolicy, the engines' Services, spec.router's Deployment and Service."""
    return [
        ("ConfigMap", rankmap_name(cluster)),
        ("Service", service_name(cluster)),
        ("Secret", engine_token_secret_name(cluster)),
        ("Secret", ca_secret_name(cluster)),
        ("NetworkPolicy", network_policy_name(cluster)),
        *(("Service", s) for s in engine_service_names(cluster)),
        ("Deployment", router_name(cluster)),
        ("Service", router_name(cluster)),
    ]


def peer_dns_name(ref: ClusterRef, agent: str) -> str:
    """The host name peers dial agent `agent` by (its pod under the headless Service), which its
    certificate carries; the agents' PDFABRIC_PEER_HOST_TEMPLATE spells the same name."""
    return f"{agent}.{service_name(ref.name)}.{ref.namespace}.svc"


def labels_for(ref: ClusterRef, **extra: str) -> dict[str, str]:
    labels = {
        c.LABEL_APP: c.APP_NAME,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_CLUSTER: ref.name,
        c.LABEL_CLUSTER_UID: ref.uid,
    }
    labels.update(extra)
    return labels


def _meta(ref: ClusterRef, name: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": labels_for(ref, **extra_labels),
        "ownerReferences": [ref.owner_reference()],
    }


def encode_ranks(ranks: tuple[Rank, ...]) -> str:
    """Compact, order-stable form of a node's ranks for the pod annotation (stickiness reads it back)."""
    return ",".join(f"{r.rank_id}@{r.gpu}" for r in ranks)


def decode_ranks(text: str) -> tuple[Rank, ...]:
    ranks = []
    for item in filter(None, text.split(",")):
        rank_id, _, gpu = item.partition("@")
        ranks.append(Rank.from_id(rank_id, int(gpu or 0)))
    return tuple(ranks)


def build_rankmap(ref: ClusterRef, raw_spec: Mapping[str, Any], placement: Placement) -> RankMap:
    agents = tuple(
        AgentEntry(agent_name(ref.name, a.unit, a.node), a.node, a.ranks, a.domain) for a in placement.agents
    )
    return RankMap(
        namespace=ref.namespace,
        cluster=ref.name,
        cluster_uid=ref.uid,
        transport=placement.transport.value,
        spec=dict(raw_spec),
        agents=agents,
        feeds=dict(placement.feeds),
    )


def build_rankmap_configmap(ref: ClusterRef, rankmap: RankMap) -> dict[str, Any]:
    meta = _meta(ref, rankmap_name(ref.name))
    meta["annotations"] = {c.ANN_RANKMAP_HASH: rankmap.digest}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {RANKMAP_KEY: rankmap.to_json()}}


def build_engine_token_secret(ref: ClusterRef, token: str) -> dict[str, Any]:
    """The engine door's token; the caller draws it (secrets.token_urlsafe) once per cluster."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(ref, engine_token_secret_name(ref.name)),
        "type": "Opaque",
        "stringData": {c.TOKEN_KEY: token},
    }


def build_ca_secret(ref: ClusterRef, ca: pki.KeyPair) -> dict[str, Any]:
    """The cluster's peer CA; the caller draws it (pki.new_ca) once per cluster."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(ref, ca_secret_name(ref.name)),
        "type": "kubernetes.io/tls",
        "stringData": {c.TLS_CERT_KEY: ca.cert_pem.decode(), c.TLS_KEY_KEY: ca.key_pem.decode()},
    }


def keypair_from_secret(secret: Mapping[str, Any]) -> pki.KeyPair:
    """The certificate and key of a TLS Secret (the CA's, an agent's) as the API returns it (base64
    data), or as built (stringData)."""
    if "data" not in secret and "stringData" in secret:
        text = secret["stringData"]
        return pki.KeyPair(text[c.TLS_CERT_KEY].encode(), text[c.TLS_KEY_KEY].encode())
    data = secret.get("data") or {}
    return pki.KeyPair(base64.b64decode(data[c.TLS_CERT_KEY]), base64.b64decode(data[c.TLS_KEY_KEY]))


def build_peer_tls_secret(ref: ClusterRef, agent: str, leaf: pki.KeyPair, ca: pki.KeyPair) -> dict[str, Any]:
    """Agent `agent`'s peer certificate (pki.issue_agent, drawn by the caller for each new pod)."""
    meta = _meta(ref, peer_tls_secret_name(agent), **{c.LABEL_AGENT: agent})
    meta["annotations"] = {c.ANN_CERT_SERIAL: pki.serial_hex(leaf.cert_pem)}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "kubernetes.io/tls",
        "stringData": {
            c.TLS_CERT_KEY: leaf.cert_pem.decode(),
            c.TLS_KEY_KEY: leaf.key_pem.decode(),
            c.TLS_CA_KEY: ca.cert_pem.decode(),
        },
    }


def build_headless_service(ref: ClusterRef, spec: PDClusterSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, service_name(ref.name)),
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
        "metadata": _meta(
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


ROUTER_USER = 65532  # SGLang's router reads and writes no files: any non-root user serves


def router_name(cluster: str) -> str:
    return f"{cluster}-router"


def build_router_deployment(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> dict[str, Any] | None:
    """spec.router's Deployment: SGLang's router with every engine as a worker, None without
    spec.router. Its arguments change only with the placement (the endpoints are stable names),
    and then it rolls with a surge (a new router is Ready before an old one goes)."""
    router = spec.router
    if router is None:
        return None
    name = router_name(ref.name)
    labels = {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_ROUTER}
    args = [
        *sglang_router_args(engine_endpoints(ref.name, ref.namespace, spec, placement)),
        "--host", "0.0.0.0", "--port", str(router.port),
        "--prometheus-host", "0.0.0.0", "--prometheus-port", str(router.metrics_port),
        *router.args,
    ]  # fmt: skip
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "command": list(router.command),
        "args": args,
        "ports": [
            {"name": "http", "containerPort": router.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"},
        ],
        # /readiness answers 503 until the router holds a healthy prefill and decode worker (its
        # /health is 200 with none): no traffic to a router that could only fail it.
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/liveness", "port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": unprivileged_container(),
    }
    if router.resources:
        container["resources"] = dict(router.resources)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ROUTER_USER,
            "runAsGroup": ROUTER_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(router.node_selector)
    apply_pod_overrides(pod_spec, container, router.pod)
    if router.pod.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in router.pod.tolerations]
    if router.pod.affinity:
        pod_spec["affinity"] = dict(router.pod.affinity)
    template_meta = pod_metadata({**labels, c.LABEL_APP: c.APP_NAME, c.LABEL_MANAGED_BY: c.MANAGED_BY}, {}, router.pod)
    if not template_meta["annotations"]:
        del template_meta["annotations"]
    deployment_spec = {
        "replicas": router.replicas,
        "selector": {"matchLabels": labels},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    meta = _meta(ref, name, **{c.LABEL_COMPONENT: c.COMPONENT_ROUTER})
    meta["annotations"] = {c.ANN_ROUTER_HASH: _short_hash(json.dumps(deployment_spec, sort_keys=True), 16)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deployment_spec}


def build_router_service(ref: ClusterRef, spec: PDClusterSpec) -> dict[str, Any] | None:
    """Where clients send requests: the router's pods, None without spec.router."""
    if spec.router is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, router_name(ref.name), **{c.LABEL_COMPONENT: c.COMPONENT_ROUTER}),
        "spec": {
            "selector": {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_ROUTER},
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


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
        "metadata": _meta(ref, network_policy_name(ref.name)),
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
    return _short_hash(json.dumps(config, sort_keys=True, default=str), 16)


def unprivileged_container() -> dict[str, Any]:
    """Every container the operator builds: no capability, no privilege gain."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod_security_context(user: int) -> dict[str, Any]:
    """A node pod's: its user as group and fsGroup (the Secret files are group-readable), the
    runtime's default seccomp profile, and runAsNonRoot unless the user is root; with the
    container's settings this meets the "restricted" Pod Security Standard (user 0: "baseline")."""
    ctx: dict[str, Any] = {
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if user != 0:
        ctx["runAsNonRoot"] = True
    return ctx


def apply_pod_overrides(pod_spec: dict[str, Any], container: dict[str, Any], pod: PodOverrides) -> None:
    """Add the user's pod overrides to a pod spec and its one container the builders made (in
    place): appended after the operator's entries, so the operator's stay first and whole; the
    spec's validation (pdfabric_core.spec) refused every name the operator's own entries use.
    Tolerations and affinity are the callers' (the node pods merge them with the placement's)."""
    if pod.env:
        container["env"] = [*container.get("env", []), *(dict(v) for v in pod.env)]
    if pod.volume_mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []), *(dict(m) for m in pod.volume_mounts)]
    if pod.volumes:
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), *(dict(v) for v in pod.volumes)]
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": str(x["name"])} for x in pod.image_pull_secrets]
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    if pod.service_account_name:
        # Its token stays unmounted (automountServiceAccountToken False): neither the agent nor
        # the router calls the API; a projected token volume is the user's to add.
        pod_spec["serviceAccountName"] = pod.service_account_name


def pod_metadata(labels: Mapping[str, str], annotations: Mapping[str, str], pod: PodOverrides) -> dict[str, Any]:
    """Labels and annotations of a pod: the user's, then the operator's over them."""
    return {"labels": {**pod.labels, **labels}, "annotations": {**pod.annotations, **annotations}}


def build_agent_pod(
    ref: ClusterRef,
    spec: PDClusterSpec,
    placement: Placement,
    agent: AgentPlacement,
) -> dict[str, Any]:
    """The agent of one node, with its ranks' GPUs: pinned to the planner's node by required node
    affinity (scheduling.py), bound there by the kube-scheduler, never by spec.nodeName."""
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
        container["env"] += e.engine_env(spec, agent)
        container["ports"] += e.engine_ports(spec.engine, agent)
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
    roles = {g.role for g in e.groups(agent)} if spec.engine is not None else set()
    role_labels = {c.LABEL_SERVES[r.value]: "true" for r in sorted(roles)}
    meta = _meta(
        ref,
        name,
        **{c.LABEL_COMPONENT: c.COMPONENT_AGENT, c.LABEL_NODE: _dns_label(agent.node, 63)},
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
    pod_hash = _short_hash(json.dumps([hashed, meta["labels"], ranks, config, *user], sort_keys=True), 16)
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
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_agent_pods(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> list[dict[str, Any]]:
    return [build_agent_pod(ref, spec, placement, a) for a in placement.agents]
