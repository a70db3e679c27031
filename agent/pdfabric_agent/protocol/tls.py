"""The peer door's TLS: contexts from the agent's certificate directory, and the peer's identity.

``PDFABRIC_PEER_TLS_DIR`` holds what the operator issued for this agent pod (its Secret):
``tls.crt`` and ``tls.key`` (this agent: subject CN = its name, DNS SAN = its name under the
headless Service) and ``ca.crt`` (the PDCluster's CA, the only issuer either side trusts).

- Server side: TLS 1.3, a client certificate is required and must chain to the cluster CA; the
  handshake fails otherwise, before any HTTP is read. The caller's agent name is its certificate's
  CN (``peer_agent``); the server then checks that name against the rank map.
- Client side: this agent's certificate is presented; the server's must chain to the cluster CA
  and carry the DNS name the rank map's agent is dialled by (hostname verification).
- Renewal: the operator issues the certificate anew in the same Secret while the pod runs; the
  kubelet swaps the mounted files. ``PeerTls.reload_if_changed`` (every ``RELOAD_CHECK_S``) loads
  them into the same two contexts, so new connections present the new certificate and
  connections already open carry on.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

log = logging.getLogger("pdfabric.agent")

INPUT_NAME = "peer-certificate"
RELOAD_CHECK_S = 10.0  # the kubelet syncs a Secret volume within about a minute

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


FileStamp = tuple[int, int, int] | None  # (inode, mtime ns, size) of a file, None when missing


class PeerTls:
    """This agent's two peer-door contexts, one pair per certificate directory, loaded again in
    place when the files change."""

    _by_dir: dict[str, PeerTls] = {}

    def __init__(self, tls_dir: str) -> None:
        self.tls_dir = tls_dir
        self.server = server_context(tls_dir)
        self.client = client_context(tls_dir)
        self._stamps = self._stat()
        self.reloads = 0
        self.problem = ""  # why the last changed set did not load ("" once one did)

    @classmethod
    def of(cls, tls_dir: str) -> PeerTls:
        """The process's contexts for `tls_dir` (the peer door and the peer client share them)."""
        found = cls._by_dir.get(tls_dir)
        if found is None:
            found = cls._by_dir[tls_dir] = cls(tls_dir)
        return found

    def _stat(self) -> tuple[FileStamp, ...]:
        stamps: list[FileStamp] = []
        for path in _paths(self.tls_dir):
            try:
                st = os.stat(path)  # through the Secret volume's symlinks
            except OSError:
                stamps.append(None)
                continue
            stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def reload_if_changed(self) -> str | None:
        """Load the directory's files again when they changed: "loaded"; a set that does not load
        (a key that does not match its certificate halfway through an update) is "refused", tried
        again next time, and the contexts keep what they had; None when nothing changed."""
        stamps = self._stat()
        if stamps == self._stamps:
            return None
        cert, key, ca = _paths(self.tls_dir)
        try:
            # Into fresh contexts first: a set that fails halfway would leave a live context with
            # the new certificate and the old key, and every handshake failing.
            server_context(self.tls_dir)
            client_context(self.tls_dir)
            for ctx in (self.server, self.client):
                ctx.load_cert_chain(cert, key)
                ctx.load_verify_locations(cafile=ca)
        except Exception as exc:
            self.problem = f"the peer certificate in {self.tls_dir} changed but does not load: {exc}"
            log.warning("%s", self.problem)
            return "refused"
        self._stamps = stamps
        self.reloads += 1
        self.problem = ""
        log.info("peer certificate reloaded from %s", self.tls_dir)
        return "loaded"


def peer_agent(peercert: Any) -> str | None:
    """The agent name in a verified peer certificate (``SSLSocket.getpeercert()``): its subject CN."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for attr in rdn:
            if len(attr) == 2 and attr[0] == "commonName" and isinstance(attr[1], str):
                return attr[1]
    return None


def peer_expiry(peercert: Any) -> float | None:
    """When a verified peer certificate expires (``notAfter``, seconds since the epoch); None when
    it does not say. The handshake refused an expired one; this is for connections that outlive it."""
    not_after = peercert.get("notAfter") if isinstance(peercert, dict) else None
    if not isinstance(not_after, str):
        return None
    try:
        return float(ssl.cert_time_to_seconds(not_after))
    except ValueError:
        return None
