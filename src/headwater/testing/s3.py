"""A throwaway S3-compatible server for tests: SeaweedFS, built once from its Go module.

The server is SeaweedFS (Apache-2.0): MinIO's server is AGPL and not installable here, while
SeaweedFS's Go module is served by the Go module proxy. Its one binary, ``weed``, is built once
into ``<cache>/go/bin/weed`` (``<cache>``: see :func:`headwater.jvm.cache.cache_dir`) with the
module cache beside it; a stamp file holding the build recipe marks a finished build, so an
interrupted one, or one of another version, is built again, and a lock keeps two processes from
building at once. ``go install module@version`` refuses this module (its go.mod has a
``replace`` directive), so the module is downloaded and built in place.

:func:`start_s3` runs ``weed mini`` (master, volume server, filer, S3 gateway and an admin server
in one process, set up for small use: unlike ``weed server`` it does not hold off creating the
first volume for seconds) on free loopback ports with its data in a temporary directory, and
requires requests signed with the access key it makes up; it is killed and its directory removed
when the context exits::

    with start_s3() as s3:
        s3.create_bucket("lake")
        deltalake.write_deltalake("s3://lake/t", table, storage_options=s3.storage_options)

    python -m headwater.testing.s3    # what scripts/bootstrap.sh runs: build weed unless built
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from headwater.errors import TerminalError
from headwater.jvm.cache import cache_dir
from headwater.testing._service import ProcessSpec, run_process
from headwater.testing.ports import free_port

WEED_MODULE = "github.com/seaweedfs/seaweedfs"
WEED_VERSION = "v0.0.0-20261109003541-7506e5f91cd6"  # SeaweedFS 4.53
WEED_PACKAGE = "./weed"
_BUILD_FLAGS = ("-trimpath", "-ldflags=-s -w")  # no debug information: 160 MB, not 230
BUILD_TIMEOUT_S = 1800.0  # about 6 minutes on 2 cores, with the module download
STAMP = ".weed.complete"

HOST = "127.0.0.1"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_START_ATTEMPTS = 3  # fresh ports each time, in case another process took a free one
# Volumes of 64 MB, created as they are needed, one per bucket to begin with; as many as the
# disk has room for (0).
VOLUME_SIZE_LIMIT_MB = 64
MAX_VOLUMES = 0
# Its Go runtime collects garbage harder as the heap nears this (a soft limit, not a cap).
GO_MEMORY_LIMIT = "256MiB"
# weed serves gRPC on these Unix sockets too, always under /tmp, and leaves them when killed.
_GRPC_SOCKET = "/tmp/seaweedfs-{service}-grpc-{port}.sock"


class WeedBuildError(TerminalError):
    """SeaweedFS's weed could not be built (no Go, the module proxy unreachable, a failed build)."""

    code = "HW-DEP-003"


class S3StartError(RuntimeError):
    """weed could not be found or built, or the S3 server did not come up."""


# --- building weed ----------------------------------------------------------------------------


def go_dir() -> Path:
    """GOPATH of the Go tools headwater builds (h2spec, weed): ``<cache>/go``."""
    return cache_dir() / "go"


def _recipe() -> str:
    return f"{WEED_MODULE}@{WEED_VERSION} {WEED_PACKAGE} {' '.join(_BUILD_FLAGS)}\n"


def cached_weed() -> Path | None:
    """The weed binary if it was built completely by the current recipe, else None."""
    binary = go_dir() / "bin" / "weed"
    stamp = binary.parent / STAMP
    if binary.is_file() and stamp.is_file() and stamp.read_text() == _recipe():
        return binary
    return None


def weed_binary(*, quiet: bool = True) -> Path:
    """``$HW_WEED`` if set, else the cached weed binary, built first unless it was."""
    override = os.environ.get("HW_WEED")
    if override:
        return Path(override)
    binary = cached_weed()
    if binary is not None:
        return binary
    with _locked(go_dir() / ".weed.lock"):
        binary = cached_weed()  # another process built it while we waited for the lock
        if binary is None:
            _build(quiet=quiet)
            binary = cached_weed()
    assert binary is not None
    return binary


def _go() -> str:
    found = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if found is None:
        raise WeedBuildError(
            f"SeaweedFS's weed ({WEED_MODULE}@{WEED_VERSION}) is not built in {go_dir()} and "
            "`go` is not installed to build it: install Go 1.26 or newer (https://go.dev/dl/, "
            "or apt-get install golang-go) or run scripts/bootstrap.sh; or set HW_WEED to a "
            "weed binary"
        )
    return found


def _build(*, quiet: bool) -> None:
    go = _go()
    root = go_dir()
    binary = root / "bin" / "weed"
    binary.parent.mkdir(parents=True, exist_ok=True)
    build_cache = root / "weed-build-cache"
    env = {
        **os.environ,
        "GOPATH": str(root),
        "GOMODCACHE": str(root / "pkg" / "mod"),
        "GOCACHE": str(build_cache),
        "GOFLAGS": "-modcacherw",  # a module cache that can be deleted
        "GOWORK": "off",
    }
    if not quiet:
        print(
            f"headwater: building SeaweedFS's weed ({WEED_MODULE}@{WEED_VERSION}) into {binary} "
            "(once; about 6 minutes)",
            file=sys.stderr,
        )
    listing = _run_go([go, "mod", "download", "-json", f"{WEED_MODULE}@{WEED_VERSION}"], env, root)
    try:
        source = Path(json.loads(listing)["Dir"])
    except (ValueError, KeyError) as exc:
        raise WeedBuildError(f"`go mod download` did not say where the module is: {exc}") from None
    partial = binary.with_name("weed.partial")
    _run_go([go, "build", *_BUILD_FLAGS, "-o", str(partial), WEED_PACKAGE], env, source)
    (binary.parent / STAMP).unlink(missing_ok=True)
    partial.replace(binary)
    (binary.parent / STAMP).write_text(_recipe())
    # The compiled packages (about 2 GB) serve no other build; the module cache is kept.
    shutil.rmtree(build_cache, ignore_errors=True)


def _run_go(command: list[str], env: Mapping[str, str], cwd: Path) -> str:
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise WeedBuildError(
            f"`{' '.join(command[1:3])}` of {WEED_MODULE}@{WEED_VERSION} took more than "
            f"{BUILD_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-3000:]
        raise WeedBuildError(
            f"`{' '.join(command[1:3])}` of {WEED_MODULE}@{WEED_VERSION} failed "
            f"(exit {done.returncode}); is the Go module proxy reachable and the version "
            f"served?\n{output}"
        )
    return done.stdout


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- the server -------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Service:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    region: str
    port: int
    data_dir: Path
    pid: int

    @property
    def storage_options(self) -> dict[str, str]:
        """delta-rs's ``storage_options`` for this server. delta-rs commits with a conditional
        put (``If-None-Match: *``), which this server honours, so no lock is configured."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, bytes]:
        """Send one request signed with this server's key (path style: ``/bucket/key``);
        return its status and body."""
        return _signed_request(
            self.port, self.access_key, self.secret_key, method, path, body, headers, timeout
        )

    def create_bucket(self, name: str) -> str:
        """Create the bucket ``name`` unless it exists; return its name."""
        status, body = self.request("PUT", f"/{name}")
        if status != 200 and b"BucketAlreadyOwnedByYou" not in body:
            raise S3StartError(f"creating bucket {name!r} answered {status}: {body[:500]!r}")
        return name


@dataclass(frozen=True)
class _Key:
    access: str
    secret: str


@dataclass(frozen=True)
class _Ports:
    """The ports of one ``weed mini`` besides its S3 port."""

    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3_grpc: int
    admin: int
    admin_grpc: int

    def sockets(self) -> list[Path]:
        """The Unix sockets weed serves its gRPC services on beside these ports."""
        grpc = {
            "master": self.master_grpc,
            "volume": self.volume_grpc,
            "filer": self.filer_grpc,
            "s3": self.s3_grpc,
            "admin": self.admin_grpc,
        }
        return [Path(_GRPC_SOCKET.format(service=s, port=p)) for s, p in grpc.items()]


_PROCESS = ProcessSpec(
    name="weed mini",
    answers="a signed ListBuckets",
    error_cls=S3StartError,
    host=HOST,
    port_taken=("address already in use",),
    temp_prefix="headwater-s3-",
    log_name="weed.log",
    start_timeout=START_TIMEOUT_S,
    stop_timeout=STOP_TIMEOUT_S,
    # On SIGTERM it lingers (its S3 gateway keeps retrying the filer that stopped); its data
    # is thrown away anyway.
    terminate_first=False,
    attempts=_START_ATTEMPTS,
)


@contextlib.contextmanager
def start_s3() -> Iterator[S3Service]:
    """Run a throwaway SeaweedFS S3 server on free loopback ports until the context exits."""
    try:
        binary = weed_binary()
    except WeedBuildError as exc:
        raise S3StartError(str(exc)) from exc
    key = _Key(access=f"hw{secrets.token_hex(8)}", secret=secrets.token_hex(20))
    ports: dict[int, _Ports] = {}  # by S3 port, one entry per attempt
    spawn = functools.partial(_spawn, binary, key, ports)
    check = functools.partial(_check, key, ports)
    try:
        with run_process(_PROCESS, spawn, check) as running:
            yield S3Service(
                endpoint=f"http://{HOST}:{running.port}",
                access_key=key.access,
                secret_key=key.secret,
                region=REGION,
                port=running.port,
                data_dir=running.directory,
                pid=running.process.pid,
            )
    finally:
        for other in ports.values():
            for socket_path in other.sockets():
                if socket_path.is_socket():
                    socket_path.unlink(missing_ok=True)


def _other_ports(s3: int) -> _Ports:
    """Nine free loopback ports besides ``s3``, all different."""
    chosen: list[int] = []
    while len(chosen) < 9:
        port = free_port(HOST)
        if port != s3 and port not in chosen:
            chosen.append(port)
    return _Ports(*chosen)


def _spawn(
    binary: Path, key: _Key, ports: dict[int, _Ports], s3: int, directory: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    other = ports[s3] = _other_ports(s3)
    data = directory / "data"
    data.mkdir(exist_ok=True)
    config = directory / "s3.json"
    identity = {
        "name": "headwater",
        "credentials": [{"accessKey": key.access, "secretKey": key.secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    # Nothing of the tests' environment configures it: WEED_* overrides its settings, AWS_*
    # keys would become an identity.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "AWS_"))}
    env["GOMEMLIMIT"] = GO_MEMORY_LIMIT
    # one volume per bucket (each bucket is a collection of its own), not 7
    env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
    command = [
        str(binary),
        "-logtostderr",  # else it writes log files to /tmp
        "mini",
        f"-dir={data}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        f"-master.port={other.master}",
        f"-master.port.grpc={other.master_grpc}",
        "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
        f"-volume.port={other.volume}",
        f"-volume.port.grpc={other.volume_grpc}",
        f"-volume.max={MAX_VOLUMES}",
        f"-filer.port={other.filer}",
        f"-filer.port.grpc={other.filer_grpc}",
        f"-filer.localSocket={directory / 'filer.sock'}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={other.s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.iam=false",
        f"-s3.config={config}",
        f"-s3.localSocket={directory / 's3.sock'}",
        "-webdav=false",
        "-admin.ui=false",  # its admin server still listens, on ports of our choosing
        f"-admin.port={other.admin}",
        f"-admin.port.grpc={other.admin_grpc}",
        "-admin.port.legacy=0",
    ]
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env=env,
        )


def _check(key: _Key, ports: dict[int, _Ports], s3: int, timeout: float) -> None:
    """Raise ``OSError`` until the server answers a signed ListBuckets and its master knows a
    volume server to store objects on."""
    status, body = _signed_request(s3, key.access, key.secret, "GET", "/", timeout=timeout)
    if status != 200:
        raise OSError(f"ListBuckets answered {status}: {body[:300]!r}")
    master = ports[s3].master
    try:
        connection = http.client.HTTPConnection(HOST, master, timeout=timeout)
        try:
            connection.request("GET", "/dir/status")
            response = connection.getresponse()
            topology = response.read()
        finally:
            connection.close()
    except http.client.HTTPException as exc:
        raise OSError(f"master on port {master}: {type(exc).__name__}: {exc}") from exc
    if response.status != 200 or b'"DataNodes":[{' not in topology.replace(b" ", b""):
        raise OSError(f"no volume server has joined the master yet: {topology[:300]!r}")


# --- AWS Signature Version 4, for the requests the starter itself makes ------------------------


def _signed_request(
    port: int,
    access_key: str,
    secret_key: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """Send ``method path`` to the S3 server on ``port``, signed (SigV4, service ``s3``)."""
    now = datetime.datetime.now(datetime.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    canonical_path = quote(path, safe="/~")
    payload = hashlib.sha256(body).hexdigest()
    signed = {k.lower(): v.strip() for k, v in (headers or {}).items()}
    signed |= {"host": f"{HOST}:{port}", "x-amz-content-sha256": payload, "x-amz-date": stamp}
    names = sorted(signed)
    canonical = "\n".join(
        [
            method,
            canonical_path,
            "",  # no query string
            "".join(f"{n}:{signed[n]}\n" for n in names),
            ";".join(names),
            payload,
        ]
    )
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    signing_key = f"AWS4{secret_key}".encode()
    for part in (day, REGION, "s3", "aws4_request"):
        signing_key = hmac.new(signing_key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
    signed["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request(method, canonical_path, body=body, headers=signed)
        response = connection.getresponse()
        return response.status, response.read()
    except http.client.HTTPException as exc:
        raise OSError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        connection.close()


def main(argv: list[str]) -> int:
    """Build weed unless it is built; print its path (nothing with ``--quiet``)."""
    try:
        binary = weed_binary(quiet=False)
    except WeedBuildError as exc:
        print(f"headwater: {exc}", file=sys.stderr)
        return 1
    if "--quiet" not in argv:
        print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
