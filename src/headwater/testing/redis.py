"""Start a throwaway Redis server for tests.

The server keeps nothing on disk, listens on a free loopback port, and is stopped, with its
temporary directory removed, when the context exits::

    with start_redis() as r:
        redis.Redis.from_url(r.url).ping()
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from headwater.testing._service import ProcessSpec, run_process

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_START_ATTEMPTS = 3  # a fresh port each time, in case another process took the free one


class RedisStartError(RuntimeError):
    """redis-server could not be found, or did not come up."""


_PROCESS = ProcessSpec(
    name="redis-server",
    answers="PING",
    error_cls=RedisStartError,
    host=HOST,
    port_taken=("Address already in use",),
    temp_prefix="headwater-redis-",
    log_name="redis.log",
    start_timeout=START_TIMEOUT_S,
    stop_timeout=STOP_TIMEOUT_S,
    attempts=_START_ATTEMPTS,
)


@dataclass(frozen=True)
class RedisService:
    host: str
    port: int
    url: str
    data_dir: Path
    pid: int


def redis_server_binary() -> Path:
    """``$HW_REDIS_SERVER`` if set, else ``redis-server`` on ``PATH`` or in /usr/bin."""
    override = os.environ.get("HW_REDIS_SERVER")
    if override:
        return Path(override)
    found = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
    if found is None:
        raise RedisStartError(
            "redis-server not found; run scripts/bootstrap.sh or `apt-get install redis-server`, "
            "or set HW_REDIS_SERVER"
        )
    return Path(found)


@contextlib.contextmanager
def start_redis() -> Iterator[RedisService]:
    """Run a throwaway Redis server on a free loopback port until the context exits."""
    spawn = functools.partial(_spawn, redis_server_binary())
    with run_process(_PROCESS, spawn, _ping) as running:
        yield RedisService(
            host=HOST,
            port=running.port,
            url=f"redis://{HOST}:{running.port}/0",
            data_dir=running.directory,
            pid=running.process.pid,
        )


def _spawn(binary: Path, port: int, directory: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [
                str(binary),
                "--port",
                str(port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                str(directory),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )


def _ping(port: int, timeout: float) -> None:
    """Raise ``OSError`` unless the server on ``port`` answers PING with PONG."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(b"PING\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(64)
            if not chunk:
                raise ConnectionError("redis-server closed the connection before answering PING")
            reply += chunk
    if reply != b"+PONG\r\n":
        raise OSError(f"unexpected reply to PING: {reply!r}")
