"""What the service starters (broker, PostgreSQL, Redis) share: start on a free port and try
another when it was taken meanwhile, wait until the service answers, stop its process, and show
the end of its log when anything fails.

- :func:`run_process`: the whole life of a service that is one child process (broker, Redis).
- :func:`start_on_free_port`, :func:`wait_ready`, :func:`tail`: the parts, for a service with
  its own way to start and stop (PostgreSQL, through ``pg_ctl``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from headwater.testing.ports import free_port

LOG_TAIL_LINES = 40
_PROBE_TIMEOUT_S = 2.0  # the longest one readiness check may take
_PROBE_TIMEOUT_MIN_S = 0.1

T = TypeVar("T")

# Takes the longest time the check may take; answers ``None`` when the service is ready, else
# why not (shown in the error when time runs out, as "(last error: ...)").
Probe = Callable[[float], str | None]
# ``spawn(port, directory, log_path)``: start the service's process, its output to ``log_path``.
Spawn = Callable[[int, Path, Path], subprocess.Popen[bytes]]
# ``check(port, timeout)``: return when the service answers, raise ``OSError`` while it does not.
Check = Callable[[int, float], None]


@dataclass(frozen=True)
class ProcessSpec:
    """How to run one kind of single-process service, and how to speak of it in errors."""

    name: str  # "redis-server": "redis-server exited with code 1 before it answered on ..."
    answers: str  # "PING": "redis-server did not answer PING on ... within 30 s"
    error_cls: type[Exception]
    host: str
    port_taken: tuple[str, ...]  # what its log says when another process has its port
    temp_prefix: str  # of the directory it runs in, removed after
    log_name: str
    start_timeout: float
    stop_timeout: float
    terminate_first: bool = True  # SIGTERM, SIGKILL after ``stop_timeout``; else SIGKILL
    attempts: int = 3  # a fresh port each time, in case another process took the free one


@dataclass(frozen=True)
class RunningProcess:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path
    log_path: Path


@contextlib.contextmanager
def run_process(
    spec: ProcessSpec, spawn: Spawn, check: Check, port: int | None = None
) -> Iterator[RunningProcess]:
    """Run ``spawn``'s process on ``port`` (by default a free port) in a temporary directory
    until the context exits, once ``check`` passes; then stop it and remove the directory."""
    directory = Path(tempfile.mkdtemp(prefix=spec.temp_prefix))
    log_path = directory / spec.log_name
    process: subprocess.Popen[bytes] | None = None
    try:
        chosen, process = start_on_free_port(
            lambda candidate: _start_process(spec, spawn, check, candidate, directory, log_path),
            host=spec.host,
            log_path=log_path,
            port_taken=spec.port_taken,
            error_cls=spec.error_cls,
            attempts=spec.attempts,
            port=port,
        )
        yield RunningProcess(process=process, port=chosen, directory=directory, log_path=log_path)
    finally:
        if process is not None:
            stop_process(process, spec.stop_timeout, terminate_first=spec.terminate_first)
        shutil.rmtree(directory, ignore_errors=True)


def _start_process(
    spec: ProcessSpec, spawn: Spawn, check: Check, port: int, directory: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    """Spawn the process and wait until it answers; stop it when it does not come up."""
    address = f"{spec.host}:{port}"
    process = spawn(port, directory, log_path)

    def exited() -> str | None:
        code = process.poll()
        if code is None:
            return None
        return f"{spec.name} exited with code {code} before it answered on {address}"

    def probe(timeout: float) -> str | None:
        try:
            check(port, timeout)
        except OSError as exc:
            return f"last error: {type(exc).__name__}: {exc}"
        return None

    try:
        wait_ready(
            probe,
            exited,
            f"{spec.name} did not answer {spec.answers} on {address}",
            log_path,
            spec.start_timeout,
            spec.error_cls,
        )
    except BaseException:
        stop_process(process, spec.stop_timeout, terminate_first=spec.terminate_first)
        raise
    return process


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the log at ``path``, for an error message."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(text[-lines:]) or "(empty log)"


def start_on_free_port(
    start: Callable[[int], T],
    *,
    host: str,
    log_path: Path,
    port_taken: Sequence[str],
    error_cls: type[Exception],
    attempts: int,
    port: int | None = None,
) -> tuple[int, T]:
    """``start(port)`` on ``port``, or on a free port of ``host``; return the port and what
    ``start`` returned.

    A free port can be taken by another process before the service binds it: when ``start``
    raises ``error_cls`` and the log at ``log_path`` shows one of ``port_taken``, try a fresh
    port, ``attempts`` times in all (once when ``port`` is given). ``start`` must leave nothing
    running when it raises.
    """
    tries = 1 if port else attempts
    for attempt in range(1, tries + 1):
        chosen = port or free_port(host)
        try:
            return chosen, start(chosen)
        except error_cls:
            log = tail(log_path)
            if attempt == tries or not any(marker in log for marker in port_taken):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def wait_ready(
    probe: Probe,
    exited: Callable[[], str | None],
    describe: str,
    log_path: Path,
    timeout: float,
    error_cls: Callable[[str], Exception],
    *,
    first_delay: float = 0.01,
    max_delay: float = 0.2,
) -> None:
    """Call ``probe`` until it answers ``None``; raise ``error_cls`` with the end of the log
    as soon as ``exited()`` says how the service exited, or when ``timeout`` seconds pass.

    ``describe`` says what did not happen ("redis-server did not answer PING on host:port");
    the timeout error adds the time and the probe's last answer.
    """
    deadline = time.monotonic() + timeout
    delay = first_delay
    while True:
        gone = exited()
        if gone is not None:
            raise error_cls(f"{gone}; its log ends with:\n{tail(log_path)}")
        remaining = deadline - time.monotonic()
        failure = probe(min(_PROBE_TIMEOUT_S, max(_PROBE_TIMEOUT_MIN_S, remaining)))
        if failure is None:
            return
        if time.monotonic() >= deadline:
            raise error_cls(
                f"{describe} within {timeout:.0f} s ({failure}); its log ends with:\n"
                f"{tail(log_path)}"
            )
        # Back off between checks (this waits on a condition, with a deadline).
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def stop_process(
    process: subprocess.Popen[bytes], timeout: float, *, terminate_first: bool = True
) -> None:
    """Stop ``process`` and reap it: SIGTERM, then SIGKILL if it has not exited within
    ``timeout`` seconds; or SIGKILL at once when not ``terminate_first``."""
    if process.poll() is not None:
        return
    if not terminate_first:
        process.kill()
        process.wait(timeout=timeout)
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
