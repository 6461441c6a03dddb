"""Start a throwaway PostgreSQL 15 cluster for tests.

The cluster lives in a temporary directory, listens on a free loopback port with ``trust``
authentication, has a database ``headwater``, and is stopped and deleted when the context exits::

    with start_postgres() as pg:
        psycopg.connect(pg.dsn)

PostgreSQL refuses to run as root. When we are root, the server runs as the ``postgres`` system
user (or ``nobody`` when there is none), and its directory is owned by that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from headwater.testing._service import start_on_free_port, tail, wait_ready

HOST = "127.0.0.1"
SUPERUSER = "postgres"
DBNAME = "headwater"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_START_ATTEMPTS = 3  # a fresh port each time, in case another process took the free one
_DEBIAN_BINDIR = Path("/usr/lib/postgresql/15/bin")
_SERVER_OPTIONS = {
    # A test cluster: durability is not wanted, speed is.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "max_replication_slots": "10",
    "max_wal_senders": "10",
    "wal_level": "logical",
}


class PostgresStartError(RuntimeError):
    """The PostgreSQL binaries could not be found, or the cluster did not come up."""


@dataclass(frozen=True)
class PostgresService:
    host: str
    port: int
    user: str
    dbname: str
    dsn: str
    data_dir: Path
    pid: int

    def fresh_database(self, name: str) -> str:
        """Drop and create database ``name`` on this server; its DSN."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn.rsplit("/", 1)[0] + f"/{name}"


@dataclass(frozen=True)
class _OsUser:
    """The system user the server runs as; ``None`` ids mean "whoever we are"."""

    name: str
    uid: int | None
    gid: int | None


def postgres_bindir() -> Path:
    """The directory with ``initdb`` and ``pg_ctl``: ``$HW_PG_BINDIR``, Debian's
    PostgreSQL 15, ``pg_config --bindir``, or ``PATH``, in that order."""
    override = os.environ.get("HW_PG_BINDIR")
    candidates: list[Path] = [Path(override)] if override else []
    candidates.append(_DEBIAN_BINDIR)
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            if out:
                candidates.append(Path(out))
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise PostgresStartError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found in "
        f"{', '.join(str(c) for c in candidates)}; run scripts/bootstrap.sh or "
        "`apt-get install postgresql-15`, or set HW_PG_BINDIR"
    )


@contextlib.contextmanager
def start_postgres() -> Iterator[PostgresService]:
    """Run a throwaway PostgreSQL cluster on a free loopback port until the context exits."""
    bindir = postgres_bindir()
    os_user = _server_os_user()
    base = Path(tempfile.mkdtemp(prefix="headwater-pg-", dir=_temp_root(os_user)))
    data_dir = base / "data"
    log_path = base / "postgres.log"
    started = False
    try:
        if os_user.uid is not None and os_user.gid is not None:
            os.chown(base, os_user.uid, os_user.gid)
        _run(
            os_user,
            [
                str(bindir / "initdb"),
                "--pgdata",
                str(data_dir),
                "--username",
                SUPERUSER,
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--locale",
                "C",
                "--no-sync",
            ],
            cwd=base,
            what="initdb",
        )
        port, _ = start_on_free_port(
            lambda candidate: _start(bindir, os_user, base, data_dir, log_path, candidate),
            host=HOST,
            log_path=log_path,
            port_taken=("could not bind", "already in use"),
            error_cls=PostgresStartError,
            attempts=_START_ATTEMPTS,
        )
        started = True  # from here on, stop it whatever happens
        _run(
            os_user,
            [
                str(bindir / "createdb"),
                "--host",
                HOST,
                "--port",
                str(port),
                "--username",
                SUPERUSER,
                DBNAME,
            ],
            cwd=base,
            what="createdb",
        )
        yield PostgresService(
            host=HOST,
            port=port,
            user=SUPERUSER,
            dbname=DBNAME,
            dsn=f"postgresql://{SUPERUSER}@{HOST}:{port}/{DBNAME}",
            data_dir=data_dir,
            pid=_postmaster_pid(data_dir),
        )
    finally:
        if started:
            _stop(bindir, os_user, data_dir)
        shutil.rmtree(base, ignore_errors=True)


def _server_os_user() -> _OsUser:
    if os.geteuid() != 0:
        return _OsUser(name=pwd.getpwuid(os.geteuid()).pw_name, uid=None, gid=None)
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return _OsUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid)
    raise PostgresStartError(
        "running as root, and PostgreSQL refuses root: no 'postgres' or 'nobody' user to run it as"
    )


def _temp_root(os_user: _OsUser) -> str | None:
    """Where to make the cluster's directory: the usual temp dir, unless the server's system
    user (when we are root and it is another) could not reach it; then ``/tmp``."""
    root = Path(tempfile.gettempdir()).resolve()
    if os_user.uid is None:
        return None
    for directory in (root, *root.parents):
        if not directory.stat().st_mode & 0o001:  # not searchable by others
            return "/tmp"
    return None


def _run(
    os_user: _OsUser, argv: Sequence[str], *, cwd: Path, what: str, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool as the server's system user; raise with its output on failure."""
    try:
        result = subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(),
            user=os_user.uid,
            group=os_user.gid,
            extra_groups=[] if os_user.uid is not None else None,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise PostgresStartError(f"{what} did not finish within {timeout:.0f} s") from exc
    if result.returncode != 0:
        raise PostgresStartError(
            f"{what} failed with exit code {result.returncode} (as user {os_user.name}):\n"
            f"{result.stdout}{result.stderr}".rstrip()
        )
    return result


def _env() -> dict[str, str]:
    # No PG* variables from the caller's shell may point the tools at another server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _start(
    bindir: Path, os_user: _OsUser, base: Path, data_dir: Path, log_path: Path, port: int
) -> None:
    """Start the server on ``port`` and wait until it accepts connections; stop it if not."""
    try:
        _pg_ctl_start(bindir, os_user, base, data_dir, log_path, port)
        _wait_ready(bindir, base, data_dir, log_path, port)
    except BaseException:
        _stop(bindir, os_user, data_dir)
        raise


def _pg_ctl_start(
    bindir: Path, os_user: _OsUser, base: Path, data_dir: Path, log_path: Path, port: int
) -> None:
    options = [f"-c listen_addresses={HOST}", f"-p {port}", f"-k '{base}'"]
    options += [f"-c {name}={value}" for name, value in _SERVER_OPTIONS.items()]
    try:
        _run(
            os_user,
            [
                str(bindir / "pg_ctl"),
                "start",
                "--pgdata",
                str(data_dir),
                "--log",
                str(log_path),
                "--options",
                " ".join(options),
                "--no-wait",
            ],
            cwd=base,
            what="pg_ctl start",
        )
    except PostgresStartError as exc:
        raise PostgresStartError(f"{exc}\nserver log:\n{tail(log_path)}") from exc


def _wait_ready(bindir: Path, base: Path, data_dir: Path, log_path: Path, port: int) -> None:
    """Poll ``pg_isready`` over TCP until the server accepts connections, or fail by the
    deadline, or as soon as the server is seen to have exited."""
    pg_isready = bindir / "pg_isready"
    seen_pid: int | None = None

    def probe(_timeout: float) -> str | None:
        result = subprocess.run(
            [str(pg_isready), "--host", HOST, "--port", str(port), "--timeout", "2"],
            cwd=base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=_env(),
            check=False,
        )
        if result.returncode == 0:
            return None
        return f"pg_isready: {result.stdout.strip() or result.returncode}"

    def exited() -> str | None:
        # The pid file goes when the server exits: remember the pid once it has been seen.
        nonlocal seen_pid
        with contextlib.suppress(PostgresStartError):
            seen_pid = _postmaster_pid(data_dir)
        if seen_pid is None or _alive(seen_pid):
            return None
        return f"PostgreSQL (pid {seen_pid}) exited before accepting connections on {HOST}:{port}"

    wait_ready(
        probe,
        exited,
        f"PostgreSQL did not accept connections on {HOST}:{port}",
        log_path,
        START_TIMEOUT_S,
        PostgresStartError,
        first_delay=0.02,
        max_delay=0.25,
    )


def _stop(bindir: Path, os_user: _OsUser, data_dir: Path) -> None:
    """Stop the server immediately; kill the postmaster if pg_ctl cannot."""
    pid: int | None = None
    with contextlib.suppress(PostgresStartError):
        pid = _postmaster_pid(data_dir)
    with contextlib.suppress(PostgresStartError):
        _run(
            os_user,
            [
                str(bindir / "pg_ctl"),
                "stop",
                "--pgdata",
                str(data_dir),
                "--mode",
                "immediate",
                "--wait",
                "--timeout",
                str(int(STOP_TIMEOUT_S)),
            ],
            cwd=data_dir.parent,
            what="pg_ctl stop",
            timeout=STOP_TIMEOUT_S + 10,
        )
    if pid is not None and _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def _postmaster_pid(data_dir: Path) -> int:
    try:
        first_line = (data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        return int(first_line)
    except (OSError, ValueError) as exc:
        raise PostgresStartError(f"no postmaster.pid in {data_dir}") from exc


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # The state follows the parenthesised command name, which may itself contain ')'.
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")
