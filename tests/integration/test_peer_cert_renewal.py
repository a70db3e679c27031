"""Peer certificates are renewed in place: two thirds through an agent certificate's validity the
operator issues a new key and certificate into the same Secret, without replacing the pod (its
agent loads the new files: tests/unit/test_peer_tls_reload.py), and says so with a Normal Event.
The real operator, under the chart's RBAC, with certificates valid for 60 s."""

from __future__ import annotations

import base64
import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.builders import pdcluster
from tests.integration import pdcluster_harness as h
from tests.integration.pdcluster_harness import agent_pods, apply_pdc, selector, wait_ready, wait_until

operator_kubeconfig, gpu_nodes = h.operator_kubeconfig, h.gpu_nodes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VALID_S = 60


@pytest.fixture
def short_lived_operator(cluster: Any, operator_kubeconfig: Path, namespace: str) -> Iterator[Any]:
    env = {"PDFABRIC_PEER_CERT_VALIDITY_S": str(VALID_S)}
    with h.running_operator(cluster, operator_kubeconfig, f"pdfabric-{namespace}", extra_env=env) as runner:
        yield runner
        h.delete_all_pdclusters(cluster, namespace)


def _leaf(cluster: Any, namespace: str, agent: str) -> x509.Certificate:
    secret = cluster.get_json("secret", f"{agent}-peer-tls", "-n", namespace)
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))


def test_a_certificate_is_issued_anew_two_thirds_through_without_replacing_the_pod(
    cluster: Any, namespace: str, gpu_nodes: Any, short_lived_operator: Any
) -> None:
    gpu_nodes("n", 2)
    apply_pdc(
        cluster,
        pdcluster().prefill(tp=8).decode(tp=8).placement(nodeSelector=selector(namespace)).manifest(),
        namespace,
    )
    wait_ready(cluster, namespace, "pd")
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")}
    first = {name: _leaf(cluster, namespace, name) for name in pods}
    for cert in first.values():
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        # Valid for VALID_S from issue, back-dated 5 minutes for clock skew between nodes.
        assert lifetime == datetime.timedelta(seconds=VALID_S + 300)

    def renewed() -> bool:
        return all(_leaf(cluster, namespace, n).serial_number != first[n].serial_number for n in pods)

    # Due two thirds through the validity from issue (40 s), not from the back-dated not-before.
    wait_until(renewed, timeout=90, what="every agent certificate issued anew")
    again = {name: _leaf(cluster, namespace, name).serial_number for name in pods}
    time.sleep(5)  # reconciles run every second: a renewed certificate is not renewed again at once
    assert {name: _leaf(cluster, namespace, name).serial_number for name in pods} == again
    ca_secret = cluster.get_json("secret", "pd-peer-ca", "-n", namespace)
    ca = x509.load_pem_x509_certificate(base64.b64decode(ca_secret["data"]["tls.crt"]))
    for name in pods:
        cert = _leaf(cluster, namespace, name)
        cert.verify_directly_issued_by(ca)  # the same CA: peers keep trusting each other
        assert cert.subject == first[name].subject
        assert cert.public_key().public_bytes(*_spki()) != first[name].public_key().public_bytes(*_spki())
    # The pods were not replaced: same uids, still Ready.
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in agent_pods(cluster, namespace, "pd")} == pods
    wait_ready(cluster, namespace, "pd")
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=PeerCertificateRenewed")
    assert events["items"] and all(e["type"] == "Normal" for e in events["items"])


def _spki() -> tuple[Any, Any]:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
