"""What every pod the operator builds shares (the node pods, the router's): no capability or
privilege gain, the restricted Pod Security context, and the user's pod overrides merged after the
operator's own entries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdfabric_core.spec import PodOverrides


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
