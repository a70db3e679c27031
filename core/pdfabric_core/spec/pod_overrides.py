"""The rules for pod overrides (spec.agent.pod, spec.router.pod): what users may add to the pods
the operator builds, and what stays the operator's (docs/pods.md). The CRD's CEL mirrors them where
CEL can see them; a unit test checks that both name the same reserved keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdfabric_core.spec.model import FORBIDDEN_ENGINE_ENV, SpecError
from pdfabric_core.spec.serving import PodOverrides

# What a PDCluster's pod overrides (agent.pod, router.pod) may not touch: the operator's own
# labels and annotations (selectors, the pod index and kopf's bookkeeping read them), the volumes
# and paths the agent's contract mounts, and the Secrets the operator issues (a CA key mounted
# into a pod would let its processes mint agent certificates).
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/managed-by", "app.kubernetes.io/component")
RESERVED_KEY_PREFIX = "pdfabric.dev/"
RESERVED_VOLUMES = ("rankmap", "engine-token", "peer-tls", "home", "dshm")
RESERVED_PATHS = ("/etc/pdfabric", "/var/lib/pdfabric", "/dev/shm")
RESERVED_SECRET_SUFFIXES = ("-peer-ca", "-peer-tls", "-engine-token")
# Set by the operator in the node pod's container (the downward API, the agent's settings).
RESERVED_NODE_ENV = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "POD_IP", "HOME")


def _reserved_path(path: str) -> str | None:
    """The reserved path `path` would hide or sit inside (or be), None when it is clear of them."""
    norm = "/" + path.strip("/")
    for reserved in RESERVED_PATHS:
        if norm == reserved or norm.startswith(reserved + "/") or reserved.startswith(norm.rstrip("/") + "/"):
            return reserved
    return None


def _secret_names(volume: Mapping[str, Any]) -> list[str]:
    """The Secrets a volume mounts: a secret volume's, a projected volume's secret sources."""
    names = [str((volume.get("secret") or {}).get("secretName") or "")]
    for source in (volume.get("projected") or {}).get("sources") or []:
        names.append(str((source.get("secret") or {}).get("name") or ""))
    return [n for n in names if n]


def check_env_secret(var: Mapping[str, Any], where: str) -> None:
    """A variable may not read a Secret the operator issues (valueFrom.secretKeyRef)."""
    secret = str(((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") or "")
    if secret.endswith(RESERVED_SECRET_SUFFIXES):
        raise SpecError(
            f"{where}.env: {var.get('name')} reads Secret {secret}, a name of the Secrets the operator issues "
            f"(peer CA, agent certificates, engine token), which only the operator places"
        )


def validate_pod(pod: PodOverrides, where: str, reserved_env: tuple[str, ...]) -> None:
    """The pod overrides' rules (mirrored by the CRD's CEL where CEL can see them): nothing that
    would break the contract of the pods the operator builds."""
    for kind, keys in (("labels", pod.labels), ("annotations", pod.annotations)):
        for key in keys:
            if key.startswith(RESERVED_KEY_PREFIX) or (kind == "labels" and key in RESERVED_LABELS):
                raise SpecError(f"{where}.{kind}: {key} is the operator's (its selectors and bookkeeping read it)")
    names = []
    for volume in pod.volumes:
        name = str(volume.get("name") or "")
        if not name:
            raise SpecError(f"{where}.volumes: every volume needs a name")
        if name in RESERVED_VOLUMES:
            raise SpecError(f"{where}.volumes: {name} is the name of a volume the operator mounts")
        for secret in _secret_names(volume):
            if secret.endswith(RESERVED_SECRET_SUFFIXES):
                raise SpecError(
                    f"{where}.volumes: {name} mounts Secret {secret}, a name of the Secrets the operator issues "
                    f"(peer CA, agent certificates, engine token), which only the operator places"
                )
        names.append(name)
    if len(set(names)) != len(names):
        raise SpecError(f"{where}.volumes: volume names must be unique")
    for mount in pod.volume_mounts:
        path, name = str(mount.get("mountPath") or ""), str(mount.get("name") or "")
        if name not in names:
            raise SpecError(f"{where}.volumeMounts: {name or 'a mount'} names no volume of {where}.volumes")
        reserved = _reserved_path(path) if path else None
        if not path.startswith("/") or reserved is not None:
            raise SpecError(
                f"{where}.volumeMounts: {name} at {path!r} must be an absolute path clear of "
                f"{', '.join(RESERVED_PATHS)} (the agent's files)"
            )
    for var in pod.env:
        name = str(var.get("name") or "")
        if not name:
            raise SpecError(f"{where}.env: every variable needs a name")
        if name.startswith("PDFABRIC_") or name in reserved_env or name in FORBIDDEN_ENGINE_ENV:
            raise SpecError(f"{where}.env: {name} is set by the operator (or is the device plugin's)")
        check_env_secret(var, where)
    for tol in pod.tolerations:
        effects = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
        if tol.get("operator", "Equal") not in ("Exists", "Equal") or tol.get("effect", "") not in effects:
            raise SpecError(
                f"{where}.tolerations: operator must be Exists or Equal, effect a taint effect: {dict(tol)}"
            )
    for ref in pod.image_pull_secrets:
        if not ref.get("name"):
            raise SpecError(f"{where}.imagePullSecrets: every entry needs a name")
