"""The Secrets the operator issues: the engine door's token, the cluster's peer CA (read only by
the operator) and each agent pod's peer certificate; the caller draws the keys (pki.py)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from pdfabric_operator import constants as c
from pdfabric_operator import pki
from pdfabric_operator.builders.names import (
    ClusterRef,
    ca_secret_name,
    engine_token_secret_name,
    object_meta,
    peer_tls_secret_name,
)


def build_engine_token_secret(ref: ClusterRef, token: str) -> dict[str, Any]:
    """The engine door's token; the caller draws it (secrets.token_urlsafe) once per cluster."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(ref, engine_token_secret_name(ref.name)),
        "type": "Opaque",
        "stringData": {c.TOKEN_KEY: token},
    }


def build_ca_secret(ref: ClusterRef, ca: pki.KeyPair) -> dict[str, Any]:
    """The cluster's peer CA; the caller draws it (pki.new_ca) once per cluster."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(ref, ca_secret_name(ref.name)),
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
    meta = object_meta(ref, peer_tls_secret_name(agent), **{c.LABEL_AGENT: agent})
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
