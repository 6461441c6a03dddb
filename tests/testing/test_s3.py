"""headwater.testing.s3: a real S3-compatible server on loopback, with the clients the Delta
destination uses (delta-rs, and pyarrow's S3 filesystem) against it.

The server is SeaweedFS (Apache-2.0), built once from its Go module with ``go`` (as
scripts/bootstrap.sh does): MinIO's server is AGPL and is not served by any registry reachable
here, while the Go module proxy serves SeaweedFS. Requests must be signed with the key the
starter makes up.

delta-rs (1.x) commits a version by writing its log entry with a conditional put
(``If-None-Match: *``), with no lock service; SeaweedFS honours it, atomically, so a writer
whose snapshot went stale gets a commit conflict instead of overwriting the other's commit.

Tables are read with ``to_pyarrow_dataset().to_table(use_threads=False)``: with deltalake 1.6.6,
reading with Arrow's threads (``to_pyarrow_table()``, or ``to_table()`` with its default) leaves
threads that abort the interpreter at exit about half the time, local tables as well as S3.
"""

from __future__ import annotations

import dataclasses
import http.client
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from headwater.testing import s3 as s3_module
from headwater.testing.s3 import S3Service, WeedBuildError, cached_weed, start_s3, weed_binary

deltalake = pytest.importorskip("deltalake")
pa = pytest.importorskip("pyarrow")


def _bucket(s3: S3Service) -> str:
    return s3.create_bucket(f"hw-{uuid.uuid4().hex[:12]}")


def _rows(s3: S3Service, uri: str) -> list[int]:
    table = deltalake.DeltaTable(uri, storage_options=s3.storage_options)
    read = table.to_pyarrow_dataset().to_table(use_threads=False)
    return sorted(read.column("n").to_pylist())


def _numbers(*values: int) -> Any:
    return pa.table({"n": pa.array(values, pa.int64())})


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


# --- building weed ---------------------------------------------------------------------------


def test_only_a_weed_built_by_the_current_recipe_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADWATER_CACHE", str(tmp_path))
    binary = tmp_path / "headwater" / "go" / "bin" / "weed"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x7fELF")
    assert cached_weed() is None  # interrupted: a binary, no stamp
    (binary.parent / s3_module.STAMP).write_text("github.com/seaweedfs/seaweedfs@v0.0.1 ./weed\n")
    assert cached_weed() is None  # built by another recipe
    (binary.parent / s3_module.STAMP).write_text(s3_module._recipe())
    assert cached_weed() == binary
    monkeypatch.delenv("HW_WEED", raising=False)
    monkeypatch.setattr(s3_module.shutil, "which", lambda *_, **__: None)
    assert weed_binary() == binary  # no Go needed once built


def test_no_go_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADWATER_CACHE", str(tmp_path))
    monkeypatch.delenv("HW_WEED", raising=False)
    monkeypatch.setattr(s3_module.shutil, "which", lambda *_, **__: None)
    with pytest.raises(WeedBuildError, match=r"`go` is not installed") as caught:
        weed_binary()
    assert s3_module.WEED_VERSION in str(caught.value)
    assert caught.value.code == "HW-DEP-003"


# --- the server -------------------------------------------------------------------------------


def test_requests_must_be_signed_with_its_key(s3_server: S3Service) -> None:
    assert s3_server.endpoint == f"http://127.0.0.1:{s3_server.port}"
    connection = http.client.HTTPConnection("127.0.0.1", s3_server.port, timeout=10)
    try:
        connection.request("GET", "/")
        anonymous = connection.getresponse()
        anonymous.read()
    finally:
        connection.close()
    assert anonymous.status == 403
    wrong = dataclasses.replace(s3_server, secret_key="not-the-secret")
    status, body = wrong.request("GET", "/")
    assert status == 403
    assert b"SignatureDoesNotMatch" in body
    assert s3_server.request("GET", "/")[0] == 200


def test_a_conditional_put_does_not_replace_an_object(s3_server: S3Service) -> None:
    bucket = _bucket(s3_server)
    assert s3_server.request("PUT", f"/{bucket}/k", b"first", {"If-None-Match": "*"})[0] == 200
    status, body = s3_server.request("PUT", f"/{bucket}/k", b"second", {"If-None-Match": "*"})
    assert (status, b"PreconditionFailed" in body) == (412, True)
    assert s3_server.request("GET", f"/{bucket}/k") == (200, b"first")


def test_of_racing_conditional_puts_exactly_one_wins(s3_server: S3Service) -> None:
    bucket = _bucket(s3_server)
    # Its first object gives the bucket a volume; racing for that makes the losers wait for
    # the lock in steps of a second (they still lose).
    assert s3_server.request("PUT", f"/{bucket}/first", b"")[0] == 200
    writers = 4
    start = threading.Barrier(writers)

    def put(i: int) -> int:
        start.wait(timeout=30)
        path = f"/{bucket}/_delta_log/00000000000000000001.json"
        return s3_server.request("PUT", path, f"writer {i}".encode(), {"If-None-Match": "*"})[0]

    with ThreadPoolExecutor(writers) as pool:
        statuses = list(pool.map(put, range(writers)))
    assert sorted(statuses) == [200] + [412] * (writers - 1)


def _grpc_sockets() -> set[Path]:
    """The Unix sockets weed leaves in /tmp unless they are removed."""
    return set(Path("/tmp").glob("seaweedfs-*-grpc-*.sock"))


def test_the_server_is_stopped_and_removed_on_exit() -> None:
    before = _grpc_sockets()
    with start_s3() as s3:
        assert _running(s3.pid)
        assert s3.data_dir.is_dir()
        bucket = s3.create_bucket("lake")
        assert s3.request("PUT", f"/{bucket}/k", b"v")[0] == 200
        sockets = _grpc_sockets() - before
    assert sockets  # it made some, so that they are gone below is a finding
    assert not _running(s3.pid)
    assert not s3.data_dir.exists()
    with pytest.raises(OSError):
        s3.request("GET", "/", timeout=2)
    assert not [s for s in sockets if s.exists()]


# --- delta-rs -----------------------------------------------------------------------------------


def test_delta_rs_writes_appends_and_reads_a_table(s3_server: S3Service) -> None:
    uri = f"s3://{_bucket(s3_server)}/events"
    options = s3_server.storage_options
    deltalake.write_deltalake(uri, _numbers(1, 2), storage_options=options)
    deltalake.write_deltalake(uri, _numbers(3), mode="append", storage_options=options)
    assert deltalake.DeltaTable(uri, storage_options=options).version() == 1
    assert _rows(s3_server, uri) == [1, 2, 3]


def test_a_commit_on_a_stale_snapshot_conflicts_instead_of_overwriting(
    s3_server: S3Service,
) -> None:
    uri = f"s3://{_bucket(s3_server)}/events"
    options = s3_server.storage_options
    deltalake.write_deltalake(uri, _numbers(0), storage_options=options)
    first = deltalake.DeltaTable(uri, storage_options=options)
    second = deltalake.DeltaTable(uri, storage_options=options)
    no_retry = deltalake.CommitProperties(max_commit_retries=0)
    deltalake.write_deltalake(first, _numbers(1), mode="append", commit_properties=no_retry)
    with pytest.raises(deltalake.exceptions.CommitFailedError):
        deltalake.write_deltalake(second, _numbers(2), mode="append", commit_properties=no_retry)
    assert _rows(s3_server, uri) == [0, 1]
    # allowed to retry, it sees version 1 taken and commits version 2 (blind appends commute)
    deltalake.write_deltalake(second, _numbers(2), mode="append")
    assert deltalake.DeltaTable(uri, storage_options=options).version() == 2
    assert _rows(s3_server, uri) == [0, 1, 2]


def test_of_two_concurrent_commits_one_fails_cleanly(s3_server: S3Service) -> None:
    uri = f"s3://{_bucket(s3_server)}/events"
    options = s3_server.storage_options
    deltalake.write_deltalake(uri, _numbers(0), storage_options=options)
    handles = [deltalake.DeltaTable(uri, storage_options=options) for _ in range(2)]
    start = threading.Barrier(2)
    no_retry = deltalake.CommitProperties(max_commit_retries=0)

    def commit(i: int) -> str:
        start.wait(timeout=30)
        try:
            deltalake.write_deltalake(
                handles[i], _numbers(10 + i), mode="append", commit_properties=no_retry
            )
        except deltalake.exceptions.CommitFailedError:
            return "conflict"
        return "committed"

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(commit, range(2)))
    assert sorted(outcomes) == ["committed", "conflict"]
    assert deltalake.DeltaTable(uri, storage_options=options).version() == 1
    assert _rows(s3_server, uri) == [0, 10 + outcomes.index("committed")]


# --- pyarrow ------------------------------------------------------------------------------------


def test_pyarrow_s3_filesystem_writes_and_reads_parquet(s3_server: S3Service) -> None:
    fs = pytest.importorskip("pyarrow.fs")
    pq = pytest.importorskip("pyarrow.parquet")
    s3fs = fs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{s3_server.port}",
        scheme="http",
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        region=s3_server.region,
    )
    path = f"{_bucket(s3_server)}/raw/part-0.parquet"
    pq.write_table(_numbers(5, 6, 7), path, filesystem=s3fs)
    assert s3fs.get_file_info(path).type == fs.FileType.File
    assert pq.read_table(path, filesystem=s3fs).column("n").to_pylist() == [5, 6, 7]
    anonymous = fs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{s3_server.port}",
        scheme="http",
        anonymous=True,
        region=s3_server.region,
    )
    with pytest.raises(OSError, match=r"ACCESS_DENIED|AccessDenied|403"):
        pq.read_table(path, filesystem=anonymous)
