"""Kubernetes API I/O of the reconciler: raw JSON requests through one ApiClient, counted.

Raw dicts (no model classes): the builders already produce plain manifests, and skipping the
client's deserialisation keeps a 100-cluster reconcile cheap in CPU and memory.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from pdfabric_operator import constants as c
from pdfabric_operator.metrics import API_REQUESTS, ERRORS, ErrorType

_METHODS = {"get": "GET", "create": "POST", "update": "PUT", "patch": "PATCH", "delete": "DELETE"}
_PLURALS = {
    "Pod": "pods",
    "ConfigMap": "configmaps",
    "Service": "services",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PDCluster": c.PLURAL,
    "PDRole": c.ROLE_PLURAL,
}
# Kinds outside the core group: their API prefix.
_GROUPS = {
    "NetworkPolicy": "/apis/networking.k8s.io/v1",
    "Deployment": "/apis/apps/v1",
    "PodDisruptionBudget": "/apis/policy/v1",
    "PDCluster": f"/apis/{c.API_VERSION}",
    "PDRole": f"/apis/{c.API_VERSION}",
}


def _resource(path: str) -> str:
    """The resource a request path names (.../namespaces/NS/RESOURCE[/NAME[/SUB]]): "pods",
    "pdclusters/status"; a bounded set, so it is a fine metric label."""
    parts = path.split("/namespaces/", 1)[-1].split("/")[1:]
    return "/".join(parts[:1] + parts[2:3])


def load_configuration() -> client.Configuration:
    """$PDFABRIC_KUBECONFIG, else in-cluster credentials, else $KUBECONFIG; never the global default.

    The variables are read per call: the client library reads $KUBECONFIG once at import.
    """
    cfg = client.Configuration()
    explicit = os.environ.get("PDFABRIC_KUBECONFIG")
    if explicit:
        config.load_kube_config(config_file=explicit, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
    # Reconciles run in a thread pool; the default pool of 4 connections would serialise them.
    cfg.connection_pool_maxsize = 32
    return cfg


class Refused(Exception):
    """The API server would not create an object for a reason retrying does not fix: admission
    (Pod Security, a ResourceQuota, a webhook) or validation. `message` is the server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def server_message(exc: ApiException) -> str:
    """The Status object's message, or the HTTP reason when the body is not one."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(exc.reason or exc.status)


def error_type(exc: BaseException) -> ErrorType:
    if isinstance(exc, Refused):
        return ErrorType.API_FORBIDDEN if exc.status == 403 else ErrorType.API_OTHER
    if isinstance(exc, ApiException):
        if exc.status == 409:
            return ErrorType.API_CONFLICT
        if exc.status == 404:
            return ErrorType.API_NOT_FOUND
        if exc.status in (401, 403):
            return ErrorType.API_FORBIDDEN
        if exc.status and exc.status >= 500:
            return ErrorType.API_SERVER
        return ErrorType.API_OTHER
    return ErrorType.INTERNAL


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client

    @classmethod
    def from_configuration(cls, cfg: client.Configuration) -> Kube:
        return cls(client.ApiClient(cfg))

    def request(
        self,
        verb: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any] | None:
        API_REQUESTS.labels(verb, _resource(path)).inc()
        method, url, headers, payload, post = self.api.param_serialize(
            method=_METHODS[verb],
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(
            method, url, header_params=headers, body=payload, post_params=post, _request_timeout=30
        )
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp, body=data.decode(errors="replace") if data else None)
        return json.loads(data) if data else None

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None) -> str:
        base = f"{_GROUPS.get(kind, '/api/v1')}/namespaces/{namespace}/{_PLURALS[kind]}"
        return f"{base}/{name}" if name else base

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("get", self.path(kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> bool:
        """Create; False when it already exists (a deterministic name: someone made it first).
        Refused when the server will not have it (400, 403, 422)."""
        meta = obj["metadata"]
        try:
            self.request("create", self.path(obj["kind"], meta["namespace"]), obj)
        except ApiException as exc:
            if exc.status == 409:
                ERRORS.labels(ErrorType.API_CONFLICT.value).inc()
                return False
            if exc.status in (400, 403, 422):
                raise Refused(exc.status, server_message(exc)) from exc
            raise
        return True

    def replace(self, obj: dict[str, Any], resource_version: str) -> None:
        meta = dict(obj["metadata"], resourceVersion=resource_version)
        self.request("update", self.path(obj["kind"], meta["namespace"], meta["name"]), dict(obj, metadata=meta))

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete; False when already gone. `uid` guards against deleting a namesake recreated since."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("delete", self.path(kind, namespace, name), body)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def annotate(
        self, kind: str, namespace: str, name: str, uid: str, annotations: dict[str, str], *, labels: bool = False
    ) -> bool:
        """Merge `annotations` (with `labels`: labels) into the object; False when it is gone or a
        namesake took its name (the uid in the patch is a precondition)."""
        patch = {"metadata": {"uid": uid, "labels" if labels else "annotations": annotations}}
        try:
            self.request("patch", self.path(kind, namespace, name), patch, content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch .status; returns the object as written (its resourceVersion matters)."""
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}/{name}/status"
        return self.request("patch", path, {"status": patch}, content_type="application/merge-patch+json")
