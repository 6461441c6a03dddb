"""TLS on headwater's listening ports (the collector's HTTP and gRPC ports, the console): the
SSL contexts they serve with, made from a ``tls`` section, and the certificate reloaded in place.

Every context accepts TLS 1.2 and later; in TLS 1.2 only ECDHE key exchange with AEAD ciphers
(AES-GCM, ChaCha20-Poly1305), which leaves out every suite on RFC 9113 §9.2.2's block list for
HTTP/2. Each port offers one ALPN protocol: ``h2`` on the gRPC port, ``http/1.1`` on the HTTP
ports.

``reload`` reads the files again and loads them into the same contexts: new handshakes present
the new certificate, open connections keep theirs. The files are read once into memory and the
pair is first loaded into a scratch context, so a pair that does not load (or files replaced
half-way) leaves the old certificate serving; the error is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from headwater.collector.config import TlsConfig
from headwater.errors import ConfigError

log = logging.getLogger(__name__)

HTTP1 = "http/1.1"
H2 = "h2"
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"  # TLS 1.2; TLS 1.3's suites are all AEAD


class TlsError(ConfigError):
    """A certificate or key that cannot serve: unreadable, not PEM, or not a pair."""

    code = "HW-CFG-020"


@dataclass(frozen=True)
class _Pair:
    """A certificate (with its chain) and its key, as read from their files."""

    cert_pem: bytes
    key_pem: bytes
    config: TlsConfig
    where: str  # the config key, for messages: collector.tls

    @classmethod
    def read(cls, config: TlsConfig, where: str) -> _Pair:
        return cls(
            _read(config.cert_file, f"{where}.cert_file"),
            _read(config.key_file, f"{where}.key_file"),
            config,
            where,
        )

    def load_into(self, context: ssl.SSLContext) -> None:
        """Make ``context`` present this pair (``TlsError`` naming the file that is wrong)."""
        cert, key = self.config.cert_file, self.config.key_file
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=self.cert_pem.decode("ascii", "replace")
            )
        except (ssl.SSLError, ValueError):
            raise TlsError(
                f"{self.where}.cert_file: {cert} holds no PEM certificate "
                "(-----BEGIN CERTIFICATE-----)"
            ) from None
        with (
            _in_memory(self.cert_pem, cert) as cert_path,
            _in_memory(self.key_pem, key) as key_path,
        ):
            try:
                context.load_cert_chain(cert_path, key_path, password=_no_password)
            except ssl.SSLError as e:
                if e.reason == "KEY_VALUES_MISMATCH":
                    raise TlsError(
                        f"{self.where}: the key in {key} does not match the certificate in {cert}"
                    ) from None
                raise TlsError(
                    f"{self.where}.key_file: {key} holds no private key that loads "
                    f"(an unencrypted PEM key is needed): {e}"
                ) from None


def _read(path: Path, key: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TlsError(f"{key}: cannot read {path}: {e.strerror or e}") from None


def _no_password() -> bytes:
    return b""  # an encrypted key fails to load instead of prompting on the terminal


@contextlib.contextmanager
def _in_memory(data: bytes, path: Path) -> Iterator[str]:
    """A path OpenSSL can open holding ``data``: an anonymous file in memory (Linux), else
    ``path`` itself."""
    if not hasattr(os, "memfd_create"):
        yield str(path)
        return
    fd = os.memfd_create("headwater-tls", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _context(alpn: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(CIPHERS)
    context.options |= (
        ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    )
    context.set_alpn_protocols([alpn])
    return context


class ServerCertificate:
    """One ``tls`` section's certificate and the server contexts that present it."""

    def __init__(self, config: TlsConfig, where: str) -> None:
        """Read and check the pair now (``TlsError`` naming the file that is wrong)."""
        self.where = where
        self._pair = _Pair.read(config, where)
        self._pair.load_into(_context(HTTP1))
        self._contexts: list[ssl.SSLContext] = []

    def context(self, alpn: str) -> ssl.SSLContext:
        """A server context offering ``alpn`` (``H2`` or ``HTTP1``), reloaded with the others."""
        context = _context(alpn)
        self._pair.load_into(context)
        self._contexts.append(context)
        return context

    def reload(self) -> bool:
        """Read the files again and present them on every context; False (logged, the old
        certificate kept) when they do not load."""
        try:
            pair = _Pair.read(self._pair.config, self.where)
            pair.load_into(_context(HTTP1))
            for context in self._contexts:
                pair.load_into(context)
        except TlsError as e:
            log.error("TLS certificate not reloaded, the previous one stays: %s", e)
            return False
        self._pair = pair
        log.info("TLS certificate reloaded from %s", pair.config.cert_file)
        return True


def server_certificate(config: TlsConfig | None, where: str) -> ServerCertificate | None:
    """The certificate of a ``tls`` section (None: the port serves plain TCP)."""
    return None if config is None else ServerCertificate(config, where)
