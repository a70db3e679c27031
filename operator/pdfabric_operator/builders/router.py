"""spec.router: an engine's PD router (SGLang's or vLLM's, spec.router.kind) as a Deployment in
front of the engines, its workers the engines' endpoints, and the Service clients send requests to."""

from __future__ import annotations

import json
from typing import Any

from pdfabric_core.engines.router import router_worker_args
from pdfabric_core.spec import PDClusterSpec, RouterKind
from pdfabric_operator import constants as c
from pdfabric_operator.builders.names import ClusterRef, object_meta, router_name, short_hash
from pdfabric_operator.builders.pod_spec import apply_pod_overrides, pod_metadata, unprivileged_container
from pdfabric_operator.builders.services import engine_endpoints
from pdfabric_operator.placement import Placement

ROUTER_USER = 65532  # neither router reads or writes files: any non-root user serves
STARTUP_PROBE_PERIOD_S = 10


def _startup(spec: PDClusterSpec) -> tuple[list[str], dict[str, Any] | None]:
    """vLLM's router listens only once every worker answers its health check, which it waits for
    up to --worker-startup-timeout-secs (600 s unless told) and then exits: it is told the engines'
    own startup allowance, and a startup probe holds the liveness probe off as long. SGLang's
    router listens at once (its /readiness says when it holds healthy workers)."""
    assert spec.router is not None and spec.engine is not None
    if spec.router.kind != RouterKind.VLLM:
        return [], None
    wait_s = max(spec.engine.prefill.startup_seconds, spec.engine.decode.startup_seconds)
    probe = {
        "httpGet": {"path": "/liveness", "port": "http"},
        "periodSeconds": STARTUP_PROBE_PERIOD_S,
        "failureThreshold": -(-wait_s // STARTUP_PROBE_PERIOD_S) + 3,
    }
    return ["--worker-startup-timeout-secs", str(wait_s)], probe


def build_router_deployment(ref: ClusterRef, spec: PDClusterSpec, placement: Placement) -> dict[str, Any] | None:
    """spec.router's Deployment: its kind's router with every engine as a worker, None without
    spec.router. Its arguments change only with the placement (the endpoints are stable names),
    and then it rolls with a surge (a new router is Ready before an old one goes)."""
    router = spec.router
    if router is None:
        return None
    name = router_name(ref.name)
    labels = {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_ROUTER}
    startup_args, startup_probe = _startup(spec)
    args = [
        *router_worker_args(router.kind, engine_endpoints(ref.name, ref.namespace, spec, placement)),
        "--host", "0.0.0.0", "--port", str(router.port),
        "--prometheus-host", "0.0.0.0", "--prometheus-port", str(router.metrics_port),
        *startup_args,
        *router.args,
    ]  # fmt: skip
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "command": list(router.launch_command),
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
    if startup_probe is not None:
        container["startupProbe"] = startup_probe
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
    meta = object_meta(ref, name, **{c.LABEL_COMPONENT: c.COMPONENT_ROUTER})
    meta["annotations"] = {c.ANN_ROUTER_HASH: short_hash(json.dumps(deployment_spec, sort_keys=True), 16)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deployment_spec}


def build_router_service(ref: ClusterRef, spec: PDClusterSpec) -> dict[str, Any] | None:
    """Where clients send requests: the router's pods, None without spec.router."""
    if spec.router is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(ref, router_name(ref.name), **{c.LABEL_COMPONENT: c.COMPONENT_ROUTER}),
        "spec": {
            "selector": {c.LABEL_CLUSTER_UID: ref.uid, c.LABEL_COMPONENT: c.COMPONENT_ROUTER},
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
