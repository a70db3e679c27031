"""The peer door's PKI: one CA per PDCluster, one certificate per agent pod (pure: no API calls).

Identity: an agent certificate's subject CN is the agent's (pod's) name, and its DNS SAN the pod's
name under the headless Service (``<agent>.<service>.<namespace>.svc``), which is the host name a
peer dials and verifies. A URI SAN ``pdfabric://<namespace>/<cluster>/<agent>`` says the same for
people and other tools. Every agent certificate is both a TLS server (its peer door) and a client
(its calls to peers). The CA key stays in a Secret nobody mounts; only the operator reads it.

P-256 keys: a key and a signature cost about a millisecond, so issuing at every pod creation
(rotation: a replaced agent gets a new key) costs nothing measurable.

Renewal: an agent certificate is issued anew, in the same Secret, two thirds through its validity
(``renewal_time``; cert-manager's default), while its pod keeps running: the kubelet updates the
mounted files and the agent loads them (agent ``tls.TlsReloader``). Peers keep verifying against
the same CA.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALID_FOR = datetime.timedelta(days=3650)
AGENT_VALID_FOR = datetime.timedelta(days=365)
_CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def agent_uri(namespace: str, cluster: str, agent: str) -> str:
    return f"pdfabric://{namespace}/{cluster}/{agent}"


def new_ca(namespace: str, cluster: str, uid: str) -> KeyPair:
    """The CA of one PDCluster, named by its uid (a namesake cluster gets another CA; a subject
    attribute holds at most 64 characters, which namespace and cluster names together exceed)."""
    del namespace, cluster  # the uid names the cluster; names would not fit
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdfabric peer CA {uid}"[:64])])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + CA_VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),  # cert and CRL sign
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_agent(
    ca: KeyPair,
    *,
    namespace: str,
    cluster: str,
    agent: str,
    dns_name: str,
    valid_for: datetime.timedelta = AGENT_VALID_FOR,
    now: datetime.datetime | None = None,
) -> KeyPair:
    """A fresh key and certificate for agent ``agent``, reachable (and verified) as ``dns_name``,
    valid for ``valid_for`` from ``now`` (never past the CA's own end)."""
    ca_cert = ca.cert
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the cluster CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now() if now is None else now
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + valid_for, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),  # digital signature
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(dns_name), x509.UniformResourceIdentifier(agent_uri(namespace, cluster, agent))]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def serial_hex(cert_pem: bytes) -> str:
    """The certificate's serial number, hex (what an integration test compares across rotations)."""
    return format(x509.load_pem_x509_certificate(cert_pem).serial_number, "x")


def renewal_time(cert_pem: bytes) -> datetime.datetime:
    """When a certificate is to be issued anew: two thirds through its validity, so a renewal that
    fails has the last third to be retried in."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    # From when it was issued: its not-before is back-dated for clock skew (which, for a short
    # validity, would make a renewal due at once, and again at every reconcile).
    issued, end = cert.not_valid_before_utc + _CLOCK_SKEW, cert.not_valid_after_utc
    return issued + (end - issued) * 2 / 3


def not_after(cert_pem: bytes) -> datetime.datetime:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
