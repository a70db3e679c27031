"""The agents' peer certificates, applied: the cluster's peer CA (created once, read from its
Secret after), a fresh key and certificate for each new agent pod, and renewal in place before
expiry (the running agent loads the new files)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from pdfabric_operator import pki
from pdfabric_operator.bookkeeping import ClusterMemory, Result
from pdfabric_operator.builders.credentials import build_ca_secret, build_peer_tls_secret, keypair_from_secret
from pdfabric_operator.builders.names import ClusterRef, ca_secret_name, peer_dns_name, peer_tls_secret_name
from pdfabric_operator.kube import Kube
from pdfabric_operator.snapshot import OwnPod


def cluster_ca(kube: Kube, ref: ClusterRef, memory: ClusterMemory, *, new: bool = False) -> pki.KeyPair:
    """The cluster's peer CA: as remembered, else from its Secret, else made and stored (once per
    PDCluster). `new`: the cluster was never reconciled, so it is made without a read first (a
    namesake already there, 409, is read then)."""
    if memory.ca is None:
        memory.ca = _stored_or_new_ca(kube, ref, new)
    return memory.ca


def _stored_or_new_ca(kube: Kube, ref: ClusterRef, new: bool) -> pki.KeyPair:
    name = ca_secret_name(ref.name)
    have = None if new else kube.get("Secret", ref.namespace, name)
    if have is None:
        ca = pki.new_ca(ref.namespace, ref.name, ref.uid)
        if kube.create(build_ca_secret(ref, ca)):
            return ca
        have = kube.get("Secret", ref.namespace, name)  # another replica, or an earlier run, made it
        if have is None:
            raise RuntimeError(f"Secret {ref.namespace}/{name} was created and is gone again")
    return keypair_from_secret(have)


def issue_peer_tls(
    kube: Kube, ref: ClusterRef, agent: str, ca: pki.KeyPair, valid_for: timedelta, now: datetime
) -> datetime:
    """A fresh key and certificate for agent pod `agent`, signed by `ca`, in its Secret (created or
    replaced); returns when it is to be renewed."""
    leaf = pki.issue_agent(
        ca,
        namespace=ref.namespace,
        cluster=ref.name,
        agent=agent,
        dns_name=peer_dns_name(ref, agent),
        valid_for=valid_for,
        now=now,
    )
    secret = build_peer_tls_secret(ref, agent, leaf, ca)
    if not kube.create(secret):
        have = kube.get("Secret", ref.namespace, secret["metadata"]["name"])
        if have is None:
            kube.create(secret)
        else:
            kube.replace(secret, have["metadata"]["resourceVersion"])
    return pki.renewal_time(leaf.cert_pem)


def renew_peer_tls(
    kube: Kube,
    ref: ClusterRef,
    running: Sequence[OwnPod],
    memory: ClusterMemory,
    valid_for: timedelta,
    now: datetime,
    out: Result,
) -> None:
    """Issue anew the peer certificate of each running agent whose renewal time came (or whose
    Secret is gone), in place: the pod keeps running and its agent loads the new files."""
    for p in running:
        due = memory.cert_renew_at.get(p.name)
        if due is None:  # first seen by this operator (a restart): its Secret says
            have = kube.get("Secret", ref.namespace, peer_tls_secret_name(p.name))
            due = pki.renewal_time(keypair_from_secret(have).cert_pem) if have is not None else now
            memory.cert_renew_at[p.name] = due
        if now < due:
            continue
        memory.cert_renew_at[p.name] = issue_peer_tls(kube, ref, p.name, cluster_ca(kube, ref, memory), valid_for, now)
        out.actions.append(f"renew certificate of {p.name}")
        out.notices.append(
            ("PeerCertificateRenewed", f"issued agent {p.name} a new peer certificate (Secret "
             f"{peer_tls_secret_name(p.name)}); the running agent loads it")
        )  # fmt: skip
