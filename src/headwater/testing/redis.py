"""Start a throwaway Redis server for tests.

The server keeps nothing on disk, listens on a free loopback port, and is stopped, with its
temporary directory removed, when the context exits::

    with start_redis() as r:
        redis.Redis.from_url(r.url).ping()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
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
_START_ATTEMPTS = 3  # a fresh port each time, in case another process took the free one
_LOG_TAIL_LINES = 40


class RedisStartError(RuntimeError):
    """redis-server could not be found, or did not come up."""


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
    binary = redis_server_binary()
    tmp = Path(tempfile.mkdtemp(prefix="headwater-redis-"))
    log_path = tmp / "redis.log"
    process: subprocess.Popen[bytes] | None = None
    try:
        for attempt in range(1, _START_ATTEMPTS + 1):
            port = free_port(HOST)
            process = _spawn(binary, tmp, log_path, port)
            try:
                _wait_ready(process, port, log_path, START_TIMEOUT_S)
                break
            except RedisStartError:
                _stop(process)
                process = None
                if "Address already in use" not in _tail(log_path) or attempt == _START_ATTEMPTS:
                    raise
        assert process is not None
        yield RedisService(
            host=HOST, port=port, url=f"redis://{HOST}:{port}/0", data_dir=tmp, pid=process.pid
        )
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(tmp, ignore_errors=True)


def _spawn(binary: Path, tmp: Path, log_path: Path, port: int) -> subprocess.Popen[bytes]:
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
                str(tmp),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )


def _wait_ready(
    process: subprocess.Popen[bytes], port: int, log_path: Path, timeout: float
) -> None:
    """Send PING until the server answers PONG; fail by the deadline or when it exits."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last_error = "no attempt made"
    while True:
        code = process.poll()
        if code is not None:
            raise RedisStartError(
                f"redis-server exited with code {code} before it answered on {HOST}:{port}; "
                f"its log ends with:\n{_tail(log_path)}"
            )
        try:
            _ping(port, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except OSError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise RedisStartError(
                f"redis-server did not answer PING on {HOST}:{port} within {timeout:.0f} s "
                f"(last error: {last_error}); its log ends with:\n{_tail(log_path)}"
            )
        # Back off between checks (this waits on a condition, with a deadline).
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


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


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"
