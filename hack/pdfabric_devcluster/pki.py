"""Certificates and keys for the local control plane: one CA, serving and client certs, SA keys."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID_FOR = datetime.timedelta(days=30)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


class Pki:
    """Writes PEM files under `root`; every path is returned so callers never guess names."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        self._not_before = now - datetime.timedelta(minutes=5)
        self._not_after = now + _VALID_FOR
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca_cert = (
            self._builder(_name("pdfabric-devcluster-ca"), self.ca_key.public_key())
            .issuer_name(_name("pdfabric-devcluster-ca"))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.ca_key, hashes.SHA256())
        )
        self.ca_path = root / "ca.crt"
        self.ca_path.write_bytes(self.ca_cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, public_key: object) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .public_key(public_key)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
        )

    def issue(self, name: str, cn: str, *, org: str | None = None, server: bool = False) -> tuple[Path, Path]:
        """Issue a leaf cert; server certs cover 127.0.0.1, localhost and the in-cluster names."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            self._builder(_name(cn, org), key.public_key())
            .issuer_name(self.ca_cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(self.ca_key, hashes.SHA256())
        cert_path, key_path = self.root / f"{name}.crt", self.root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return cert_path, key_path

    def service_account_keys(self) -> tuple[Path, Path]:
        """RSA pair the apiserver signs service-account tokens with (public, private)."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        priv, pub = self.root / "sa.key", self.root / "sa.pub"
        _write_key(priv, key)
        pub.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return pub, priv
