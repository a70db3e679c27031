"""The peer door's TLS: contexts from the agent's certificate directory, and the peer's identity.

``PDFABRIC_PEER_TLS_DIR`` holds what the operator issued for this agent pod (its Secret):
``tls.crt`` and ``tls.key`` (this agent: subject CN = its name, DNS SAN = its name under the
headless Service) and ``ca.crt`` (the PDCluster's CA, the only issuer either side trusts).

- Server side: TLS 1.3, a client certificate is required and must chain to the cluster CA; the
  handshake fails otherwise, before any HTTP is read. The caller's agent name is its certificate's
  CN (``peer_agent``); the server then checks that name against the rank map.
- Client side: this agent's certificate is presented; the server's must chain to the cluster CA
  and carry the DNS name the rank map's agent is dialled by (hostname verification).
"""

from __future__ import annotations

import os
import ssl
from typing import Any

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"


def _paths(tls_dir: str) -> tuple[str, str, str]:
    return os.path.join(tls_dir, CERT_FILE), os.path.join(tls_dir, KEY_FILE), os.path.join(tls_dir, CA_FILE)


def server_context(tls_dir: str) -> ssl.SSLContext:
    cert, key, ca = _paths(tls_dir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls_dir: str) -> ssl.SSLContext:
    cert, key, ca = _paths(tls_dir)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_agent(peercert: Any) -> str | None:
    """The agent name in a verified peer certificate (``SSLSocket.getpeercert()``): its subject CN."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for attr in rdn:
            if len(attr) == 2 and attr[0] == "commonName" and isinstance(attr[1], str):
                return attr[1]
    return None
