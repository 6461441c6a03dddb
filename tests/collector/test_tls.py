"""TLS on the collector's ports (``collector.tls``), with a certificate authority made in the test:
real clients over real sockets (the Segment SDK over https, grpcio with the root certificate, the
``websockets`` library over wss, the collector's own WebSocket taking over an upgrade aiohttp
parsed, ``openssl s_client``), what the contexts refuse, errors in the files at start, and the
certificate reloaded in place: in this process, and by SIGHUP to a real ``headwater collector``
(intake workers) while clients send on kept-alive connections.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from grpc import aio
from segment.analytics import Client
from segment.analytics import request as segment_request
from websockets.asyncio.client import connect as ws_connect

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.cli.main import cli
from headwater.collector.auth import hash_key
from headwater.collector.config import CollectorConfig, SourceConfig, TlsConfig
from headwater.collector.protocols import raccoon
from headwater.collector.tls import ServerCertificate, TlsError
from headwater.testing.clients import RawWebSocket, raccoon_request, raccoon_response
from headwater.testing.collector import CollectorProcess, RunningCollector, running_collector
from headwater.testing.tls import CertificateAuthority, self_signed
from headwater.testing.waiting import wait_until

KEY = "tls-write-key"
TIMEOUT_S = 10.0
HOST = "127.0.0.1"


@dataclass
class Pki:
    """A test authority, the server certificate's files it issued, and its root in a file."""

    ca: CertificateAuthority
    directory: Path
    config: TlsConfig = field(init=False)
    ca_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.config = TlsConfig(
            cert_file=self.directory / "server.crt", key_file=self.directory / "server.key"
        )
        self.ca_file = self.directory / "ca.pem"
        self.ca_file.write_bytes(self.ca.cert_pem)
        self.renew()

    def renew(self) -> int:
        """Replace the server's files (each by a rename) with a newly issued pair; its serial."""
        issued = self.ca.issue(HOST, "localhost")
        for data, path in (
            (issued.key_pem, self.config.key_file),
            (issued.cert_pem, self.config.cert_file),
        ):
            path.with_suffix(".new").write_bytes(data)
            path.with_suffix(".new").replace(path)
        return x509.load_pem_x509_certificate(issued.cert_pem).serial_number

    def client(self) -> ssl.SSLContext:
        return self.ca.client_context()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(CertificateAuthority(), tmp_path)


@pytest.fixture
def server(bus: EmbeddedBus, pki: Pki) -> Iterator[RunningCollector]:
    config = CollectorConfig(
        sources=[SourceConfig(id="web", write_keys=[hash_key(KEY)])], tls=pki.config
    )
    with running_collector(bus, config) as running:
        yield running


def serial_of(sock: ssl.SSLSocket) -> int:
    der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def served_serial(port: int, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new connection to ``port`` is shown."""
    raw = socket.create_connection((HOST, port), TIMEOUT_S)
    with context.wrap_socket(raw, server_hostname=HOST) as tls:
        return serial_of(tls)


def file_serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def post_raccoon(conn: http.client.HTTPSConnection, guid: str) -> None:
    """A Raccoon REST request on ``conn``, answered 200 SUCCESS (else AssertionError)."""
    body = raccoon_request(guid, [("tls", guid.encode())])
    conn.request("POST", "/api/v1/events", body, {"Content-Type": "application/proto"})
    answer = conn.getresponse()
    data = answer.read()
    assert answer.status == 200, (answer.status, data)
    assert raccoon_response(data).status == raccoon.Status.SUCCESS


# -- clients over TLS -------------------------------------------------------------------------


def test_the_segment_sdk_sends_over_https(
    server: RunningCollector, bus: EmbeddedBus, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.url.startswith("https://")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(pki.ca_file))  # (the SDK's requests session)
    client = Client(KEY, host=server.url, sync_mode=True, timeout=TIMEOUT_S, max_retries=0)
    try:
        client.track("user-1", "Signed Up", {"plan": "pro"})
        client.identify("user-1", {"email": "ada@example.com"})
    finally:
        # the SDK keeps its connection in a module-wide pool: closed here, before the server
        # stops (a TLS connection the server closes waits for the client's close_notify)
        segment_request._session.close()
    [track] = bus.read("events-track", 0, 0, 10)
    [identify] = bus.read("events-identify", 0, 0, 10)
    assert b'"Signed Up"' in track.value and b"ada@example.com" in identify.value


def test_healthz_answers_over_https(server: RunningCollector, pki: Pki) -> None:
    conn = http.client.HTTPSConnection(
        HOST, server.server.port, context=pki.client(), timeout=TIMEOUT_S
    )
    try:
        conn.request("GET", "/healthz")
        answer = conn.getresponse()
        assert answer.status == 200
        answer.read()
        assert conn.sock.version() in ("TLSv1.2", "TLSv1.3")  # type: ignore[union-attr]
    finally:
        conn.close()


def test_grpcio_with_the_root_certificate_is_answered(
    server: RunningCollector, bus: EmbeddedBus, pki: Pki
) -> None:
    async def call() -> bytes:
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
        async with aio.secure_channel(server.grpc_target, credentials) as channel:
            send = channel.unary_unary(raccoon.METHOD)
            answer: bytes = await send(
                raccoon_request("g-1", [("grpctls", b"e1")]), timeout=TIMEOUT_S
            )
            return answer

    reply = raccoon_response(asyncio.run(call()))
    assert reply.status == raccoon.Status.SUCCESS and dict(reply.data) == {"req_guid": "g-1"}
    assert [r.value for r in bus.read("clickstream-grpctls-log", 0, 0, 10)] == [b"e1"]


def test_grpcio_without_the_root_certificate_is_refused(server: RunningCollector) -> None:
    async def call() -> None:
        async with aio.secure_channel(
            server.grpc_target, grpc.ssl_channel_credentials()
        ) as channel:
            await channel.unary_unary(raccoon.METHOD)(raccoon_request("g", []), timeout=TIMEOUT_S)

    with pytest.raises(aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_websocket_client_sends_over_wss(
    server: RunningCollector, bus: EmbeddedBus, pki: Pki
) -> None:
    assert server.ws_url.startswith("wss://")

    async def exchange() -> bytes:
        headers = {"X-User-ID": "ada"}
        async with ws_connect(server.ws_url, ssl=pki.client(), additional_headers=headers) as ws:
            await ws.send(raccoon_request("w-1", [("wss", b"over-tls")]))
            answer = await asyncio.wait_for(ws.recv(), TIMEOUT_S)
            assert isinstance(answer, bytes)
            return answer

    reply = raccoon_response(asyncio.run(exchange()))
    assert reply.status == raccoon.Status.SUCCESS and dict(reply.data) == {"req_guid": "w-1"}
    assert [r.value for r in bus.read("clickstream-wss-log", 0, 0, 10)] == [b"over-tls"]


def test_an_upgrade_after_a_request_on_a_tls_connection_is_served(
    server: RunningCollector, bus: EmbeddedBus, pki: Pki
) -> None:
    """The upgrade aiohttp parses (the connection's second request) is taken over from the TLS
    transport, frames sent with the handshake included."""
    first = raccoon_request("a-1", [("aftertls", b"early")])

    async def exchange() -> list[bytes]:
        ws = await RawWebSocket.connect(
            HOST,
            server.server.port,
            headers={"X-User-ID": "bob"},
            after_get="/healthz",
            early=_binary_frame(first),
            tls=pki.client(),
        )
        try:
            ws.send_frame(0x2, raccoon_request("a-2", [("aftertls", b"later")]))
            frames = [await ws.recv_data(TIMEOUT_S) for _ in range(2)]
            return [f.payload for f in frames if f is not None]
        finally:
            await ws.close()

    replies = [raccoon_response(p) for p in asyncio.run(exchange())]
    assert sorted(dict(r.data)["req_guid"] for r in replies) == ["a-1", "a-2"]
    assert {r.status for r in replies} == {raccoon.Status.SUCCESS}
    values = [r.value for r in bus.read("clickstream-aftertls-log", 0, 0, 10)]
    assert values == [b"early", b"later"]


def _binary_frame(payload: bytes) -> bytes:
    from headwater.testing.clients import encode_frame

    return encode_frame(0x2, payload)


# -- what the contexts offer and refuse -------------------------------------------------------


def s_client(port: int, pki: Pki, *args: str) -> subprocess.CompletedProcess[str]:
    """``openssl s_client`` against ``port``, trusting the test authority, closing at once.
    Its output can hold the server's first bytes (the gRPC port's SETTINGS frames, when they
    arrive before it closes): not UTF-8, so shown escaped."""
    return subprocess.run(
        ["openssl", "s_client", "-connect", f"{HOST}:{port}", "-CAfile", str(pki.ca_file), *args],
        input="",
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=TIMEOUT_S,
        check=False,
    )


def test_openssl_negotiates_h2_on_the_grpc_port_and_http1_on_the_http_port(
    server: RunningCollector, pki: Pki
) -> None:
    grpc_port = int(server.grpc_target.rsplit(":", 1)[1])
    on_grpc = s_client(grpc_port, pki, "-alpn", "h2")
    assert "ALPN protocol: h2" in on_grpc.stdout, on_grpc.stdout + on_grpc.stderr
    assert "Verify return code: 0 (ok)" in on_grpc.stdout
    on_http = s_client(server.server.port, pki, "-alpn", "h2,http/1.1")
    assert "ALPN protocol: http/1.1" in on_http.stdout, on_http.stdout + on_http.stderr


@pytest.mark.parametrize(
    "args",
    [
        # TLS 1.1 (the client's own floor lowered, so that only the server refuses it)
        ("-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"),
        # TLS 1.2 suites RFC 9113 §9.2.2 blocks: CBC, and a key exchange without ECDHE
        ("-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-SHA"),
        ("-tls1_2", "-cipher", "ECDHE-ECDSA-AES256-SHA384"),
        ("-tls1_2", "-cipher", "AES128-GCM-SHA256"),
    ],
)
def test_old_versions_and_weak_suites_are_refused(
    server: RunningCollector, pki: Pki, args: tuple[str, ...]
) -> None:
    grpc_port = int(server.grpc_target.rsplit(":", 1)[1])
    for port in (server.server.port, grpc_port):
        done = s_client(port, pki, *args)
        assert done.returncode != 0 and "Cipher is (NONE)" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "cipher", ["ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-CHACHA20-POLY1305"]
)
def test_tls12_with_ecdhe_and_aead_is_accepted(
    server: RunningCollector, pki: Pki, cipher: str
) -> None:
    done = s_client(server.server.port, pki, "-tls1_2", "-cipher", cipher)
    assert f"Cipher is {cipher}" in done.stdout, done.stdout + done.stderr


# -- errors at start --------------------------------------------------------------------------


def _missing(pki: Pki) -> TlsConfig:
    return TlsConfig(cert_file=pki.directory / "nowhere.crt", key_file=pki.config.key_file)


def _a_directory(pki: Pki) -> TlsConfig:
    return TlsConfig(cert_file=pki.config.cert_file, key_file=pki.directory)


def _not_pem(pki: Pki) -> TlsConfig:
    (pki.directory / "junk.crt").write_bytes(b"not a certificate\n")
    return TlsConfig(cert_file=pki.directory / "junk.crt", key_file=pki.config.key_file)


def _key_as_cert(pki: Pki) -> TlsConfig:
    return TlsConfig(cert_file=pki.config.key_file, key_file=pki.config.key_file)


def _not_a_key(pki: Pki) -> TlsConfig:
    return TlsConfig(cert_file=pki.config.cert_file, key_file=pki.config.cert_file)


def _other_key(pki: Pki) -> TlsConfig:
    _, key = self_signed(HOST).write(pki.directory, "other")
    return TlsConfig(cert_file=pki.config.cert_file, key_file=key)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_missing, "collector.tls.cert_file: cannot read {d}/nowhere.crt: No such file"),
        (_a_directory, "collector.tls.key_file: cannot read {d}: Is a directory"),
        (_not_pem, "collector.tls.cert_file: {d}/junk.crt holds no PEM certificate"),
        (_key_as_cert, "collector.tls.cert_file: {d}/server.key holds no PEM certificate"),
        (_not_a_key, "collector.tls.key_file: {d}/server.crt holds no private key that loads"),
        (
            _other_key,
            "collector.tls: the key in {d}/other.key does not match the certificate in "
            "{d}/server.crt",
        ),
    ],
)
def test_a_bad_certificate_or_key_is_an_error_naming_the_file(
    pki: Pki, make: Callable[[Pki], TlsConfig], says: str
) -> None:
    with pytest.raises(TlsError) as info:
        ServerCertificate(make(pki), "collector.tls")
    assert says.format(d=pki.directory) in str(info.value)
    assert info.value.code == "HW-CFG-020"


def test_the_collector_command_refuses_to_start_with_a_bad_key(pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "headwater.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'data'}\ncollector:\n  tls:\n"
        f"    cert_file: {pki.config.cert_file}\n    key_file: {_other_key(pki).key_file}\n"
    )
    done = CliRunner().invoke(cli, ["--config", str(config), "collector", "--port", "0"])
    assert done.exit_code == 1
    assert f"error: HW-CFG-020: collector.tls: the key in {tmp_path}/other.key" in done.output
    assert not (tmp_path / "data").exists()  # refused before anything opened


# -- reload -----------------------------------------------------------------------------------


def _reload(server: RunningCollector) -> bool:
    async def reload() -> bool:
        return server.server.reload_tls()

    return asyncio.run_coroutine_threadsafe(reload(), server.loop).result(TIMEOUT_S)


def test_reload_presents_the_new_certificate_to_new_connections_only(
    server: RunningCollector, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    ports = (server.server.port, int(server.grpc_target.rsplit(":", 1)[1]))
    old = file_serial(pki.config.cert_file)
    kept = http.client.HTTPSConnection(HOST, ports[0], context=pki.client(), timeout=TIMEOUT_S)
    try:
        post_raccoon(kept, "before")
        new = pki.renew()
        assert [served_serial(p, pki.client()) for p in ports] == [old, old]  # not yet
        assert _reload(server)
        assert [served_serial(p, pki.client()) for p in ports] == [new, new]
        opened = kept.sock
        post_raccoon(kept, "after")
        assert kept.sock is opened and serial_of(opened) == old  # the open connection stayed

        # a bad pair on reload: logged, and the certificate before it stays
        _, other_key = self_signed(HOST).write(pki.directory, "other")
        pki.config.key_file.write_bytes(other_key.read_bytes())
        assert not _reload(server)
        assert "TLS certificate not reloaded, the previous one stays" in caplog.text
        assert "does not match the certificate" in caplog.text
        assert [served_serial(p, pki.client()) for p in ports] == [new, new]
        post_raccoon(kept, "still")
    finally:
        kept.close()


# -- SIGHUP to a real collector under load ----------------------------------------------------

SENDERS = 4  # HTTP connections kept alive, each sending continuously (and one gRPC channel)
AFTER_RELOAD = 20  # requests each sender completes after the reload before the load stops
FRESH_NEW = 20  # consecutive new connections that must see the new certificate


class Sender(threading.Thread):
    """Sends Raccoon REST requests on one kept-alive TLS connection until stopped."""

    def __init__(self, port: int, context: ssl.SSLContext, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.conn = http.client.HTTPSConnection(HOST, port, context=context, timeout=TIMEOUT_S)
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[BaseException] = []
        self.first_sock: ssl.SSLSocket | None = None
        self.last_sock: ssl.SSLSocket | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                post_raccoon(self.conn, f"{self.name}-{self.done}")
                self.last_sock = self.conn.sock  # type: ignore[assignment]
                self.first_sock = self.first_sock or self.last_sock
                self.done += 1
        except BaseException as e:  # the test asserts there is none
            self.failures.append(e)

    def close(self) -> None:
        self.conn.close()


class GrpcSender(threading.Thread):
    def __init__(self, target: str, root: bytes) -> None:
        super().__init__(name="grpc", daemon=True)
        self.channel = grpc.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=root)
        )
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[BaseException] = []

    def run(self) -> None:
        send = self.channel.unary_unary(raccoon.METHOD)
        try:
            while not self.stop.is_set():
                reply = raccoon_response(
                    send(raccoon_request(f"g{self.done}", [("hup", b"g")]), timeout=TIMEOUT_S)
                )
                assert reply.status == raccoon.Status.SUCCESS
                self.done += 1
        except BaseException as e:  # the test asserts there is none
            self.failures.append(e)

    def close(self) -> None:
        self.channel.close()


def test_sighup_reloads_the_certificate_under_load_without_a_failed_request(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``headwater collector`` with two intake workers: SIGHUP to the main process while four
    HTTP connections and a gRPC channel send continuously. No request fails, each connection
    is the one it opened with (and shows the certificate it opened with), and new connections
    to both ports are shown the new certificate."""
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_file))  # (the helper's /healthz probe)
    config = tmp_path / "headwater.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'state'}\ncollector:\n  workers: 2\n  tls:\n"
        f"    cert_file: {pki.config.cert_file}\n    key_file: {pki.config.key_file}\n"
    )
    process = CollectorProcess(config, tmp_path / "collector.err")
    try:
        port = process.wait_healthy()
        events = process.wait_for_line("headwater: events: ")
        assert f"wss://{HOST}:{port}/api/v1/events" in events
        assert f"POST https://{HOST}:{port}/api/v1/events" in events
        grpc_line = process.wait_for_line("headwater: gRPC EventService on ")
        assert grpc_line.endswith(" (TLS, ALPN h2)")
        grpc_port = int(grpc_line.split(":")[-1].split()[0])
        old = file_serial(pki.config.cert_file)
        senders: list[Sender | GrpcSender] = [
            *(Sender(port, pki.client(), f"s{i}") for i in range(SENDERS)),
            GrpcSender(f"{HOST}:{grpc_port}", pki.ca.cert_pem),
        ]
        try:
            new = _reload_under_load(process, pki, senders, (port, grpc_port))
        finally:
            for s in senders:
                s.stop.set()
            for s in senders:
                s.join(TIMEOUT_S)
        assert [f for s in senders for f in s.failures] == []
        for s in senders:
            if isinstance(s, Sender):  # the connection it opened with, and its certificate
                assert s.first_sock is not None and s.last_sock is s.first_sock
                assert serial_of(s.first_sock) == old != new
            s.close()
        assert process.stop() == 0
        assert process.stderr().count("TLS certificate reloaded") == 2  # (each worker)
    finally:
        process.close()


def _reload_under_load(
    process: CollectorProcess,
    pki: Pki,
    senders: list[Sender | GrpcSender],
    ports: tuple[int, int],
) -> int:
    """Start ``senders``, renew the files and SIGHUP ``process`` once they all send, wait for
    new connections to be shown the new certificate and for every sender to go on; the new
    serial."""
    for s in senders:
        s.start()
    wait_until(lambda: all(s.done > 0 for s in senders), "every sender sending")
    new = pki.renew()
    os.kill(process.proc.pid, signal.SIGHUP)
    before = [s.done for s in senders]
    streak = 0

    def only_new_ones() -> bool:
        nonlocal streak
        for p in ports:
            streak = streak + 1 if served_serial(p, pki.client()) == new else 0
        return streak >= FRESH_NEW

    wait_until(only_new_ones, "new connections shown the new certificate")
    wait_until(
        lambda: all(s.done >= b + AFTER_RELOAD for s, b in zip(senders, before, strict=True)),
        "requests after the reload",
    )
    for s in senders:
        assert not s.failures, s.failures
    return new
