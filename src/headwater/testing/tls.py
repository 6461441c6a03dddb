"""Certificates made in a test (``cryptography``): a certificate authority that issues server
certificates for names (DNS names or IP addresses), a self-signed certificate, and the SSL
contexts a test server and a client trusting the authority use. Keys are EC P-256: quick to make.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Certificate:
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """``<stem>.crt`` and ``<stem>.key`` in ``directory``: the paths."""
        cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        return cert, key

    def server_context(self) -> ssl.SSLContext:
        """A server-side context presenting this certificate."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as directory:
            context.load_cert_chain(*self.write(Path(directory), "server"))
        return context


class CertificateAuthority:
    def __init__(self, name: str = "headwater test CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = _builder(self._name, self._name, self._key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
        self._cert = builder.sign(self._key, hashes.SHA256())

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, *names: str) -> Certificate:
        """A server certificate for ``names`` (each a DNS name or an IP address)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
        builder = _builder(subject, self._name, key.public_key())
        builder = builder.add_extension(_alt_names(names), False)
        return _certificate(builder.sign(self._key, hashes.SHA256()), key)

    def client_context(self) -> ssl.SSLContext:
        """A client-side context that trusts this authority only (host names checked)."""
        return ssl.create_default_context(cadata=self.cert_pem.decode())


def self_signed(*names: str) -> Certificate:
    """A certificate for ``names`` signed by its own key: trusted by no one."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    builder = _builder(subject, subject, key.public_key()).add_extension(_alt_names(names), False)
    return _certificate(builder.sign(key, hashes.SHA256()), key)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _VALID)
        .not_valid_after(now + _VALID)
    )


def _alt_names(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _certificate(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Certificate:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return Certificate(cert.public_bytes(serialization.Encoding.PEM), key_pem)
