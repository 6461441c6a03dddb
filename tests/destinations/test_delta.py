"""The Delta Lake destination, read back by delta-rs (its own log replay and query engine): one
table version per batch and none for a replay, Delta's ``txn`` marker per writer, partitions by
the event's day or an expression, a batch cut between two tables' commits landing once, upserts
MERGEd on the key, staged files of dead attempts cleaned, compaction, Z-order and vacuum (also
from the command line), and config errors named.

Each test that writes runs twice: on a local folder, and on ``s3a://`` paths of a real
S3-compatible server on loopback (SeaweedFS, ``headwater.testing.s3``: MinIO's server is AGPL
and not installable here), with the credentials and endpoint in the environment, as a user
gives them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from headwater.cli.main import cli
from headwater.destinations import Column, TableSchema, open_destination
from headwater.destinations.base import ORDER_COLUMN, DestinationError, DestinationUnavailable
from headwater.destinations.delta.client import DeltaDestination
from headwater.destinations.delta.errors import classify
from headwater.destinations.delta.maintenance import vacuum
from headwater.destinations.types import ColumnType as T
from headwater.pipeline.config import DestinationConfig
from headwater.testing.warehouse import delta_leftovers, delta_query

DAY1 = datetime(2026, 11, 28, 23, 59, 59, tzinfo=UTC)
DAY2 = datetime(2026, 11, 29, 0, 0, 1, tzinfo=UTC)


def open_delta(root: Path | str, **extra: Any) -> DeltaDestination:
    config = DestinationConfig.model_validate(
        {"id": "lake", "type": "delta", "path": str(root), **extra}
    )
    d = open_destination(config, Path("data"))  # (the path is given: no data_dir needed)
    assert isinstance(d, DeltaDestination)
    return d


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the destination keeps its tables: a folder, or a fresh bucket on the S3 server
    (its endpoint and keys in the AWS_* environment, as a user gives them)."""
    if request.param == "local":
        return str(tmp_path / "lake")
    s3 = request.getfixturevalue("s3_server")
    for name, value in s3.storage_options.items():
        monkeypatch.setenv(name, value)
    bucket = s3.create_bucket(f"lake-{uuid.uuid4().hex[:12]}")
    return f"s3a://{bucket}/tables"


@pytest.fixture
def lake(root: str) -> Iterator[DeltaDestination]:
    d = open_delta(root)
    yield d
    d.close()


EVENTS = TableSchema(
    "events",
    {"id": Column("id", T.INT64), "_timestamp": Column("_timestamp", T.TIMESTAMP)},
)


def events(ids: list[int], at: list[datetime] | None = None) -> pa.Table:
    at = at or [DAY1] * len(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "_timestamp": pa.array(at, pa.timestamp("us", tz="UTC")),
            ORDER_COLUMN: pa.array(range(len(ids)), pa.int64()),
        }
    )


def writes(d: DeltaDestination, table: str = "events") -> list[dict[str, Any]]:
    dt = d.delta_table(table)
    return [h for h in dt.history() if h["operation"] in ("WRITE", "MERGE")]


def test_one_version_per_batch_with_the_writers_txn_and_none_for_a_replay(
    lake: DeltaDestination,
) -> None:
    schemas = {"events": lake.ensure_table(EVENTS)}
    for batch in range(3):
        parts = lake.stage("lake", batch, "p0a0", {"events": events([batch * 10, batch * 10 + 1])})
        parts += lake.stage("lake", batch, "p1a0", {"events": events([batch * 10 + 2])})
        assert lake.commit_staged("lake", batch, parts, schemas) is True
        lake.clean_staging("lake")
    again = lake.stage("lake", 2, "p0a1", {"events": events([20, 21])})
    assert lake.commit_staged("lake", 2, again, schemas) is False  # a replay after a crash
    history = writes(lake)
    assert len(history) == 3
    assert sorted(int(h["headwater.batch"]) for h in history) == [0, 1, 2]
    assert lake.delta_table("events").transaction_version("lake") == 2
    assert delta_query(lake, "SELECT count(*), count(DISTINCT id) FROM events") == [(9, 9)]
    assert delta_leftovers(lake) == []


def test_partitioned_by_the_events_day_in_folders_delta_rs_reads(lake: DeltaDestination) -> None:
    schemas = {"events": lake.ensure_table(EVENTS)}
    parts = lake.stage("lake", 0, "p0a0", {"events": events([1, 2, 3], [DAY1, DAY2, DAY2])})
    assert len(parts) == 2  # one file per day
    lake.commit_staged("lake", 0, parts, schemas)
    dt = lake.delta_table("events")
    assert dt.metadata().partition_columns == ["event_date"]
    assert sorted(p["event_date"] for p in dt.partitions()) == ["2026-11-28", "2026-11-29"]
    folders = sorted(Path(f).parent.name for f in dt.file_uris())
    assert folders == ["event_date=2026-11-28", "event_date=2026-11-29"]
    got = delta_query(lake, "SELECT id, CAST(event_date AS VARCHAR) FROM events ORDER BY id")
    assert got == [(1, "2026-11-28"), (2, "2026-11-29"), (3, "2026-11-29")]
    assert "event_date" not in lake.table("events").columns  # the destination's own column


def test_a_partition_expression_with_awkward_values_and_nulls(root: str) -> None:
    d = open_delta(
        root,
        options={
            "partition_by": "CASE WHEN id > 0 THEN 'a b/c:' || id END",
            "partition_column": "part",
        },
    )
    schemas = {"t": d.ensure_table(TableSchema("t", {"id": Column("id", T.INT64)}))}
    rows = pa.table({"id": pa.array([1, 1, 2, -1], pa.int64())})
    d.commit_staged("lake", 0, d.stage("lake", 0, "p0", {"t": rows}), schemas)
    got = delta_query(d, "SELECT part, count(*) FROM t GROUP BY part ORDER BY part NULLS FIRST")
    assert got == [(None, 1), ("a b/c:1", 2), ("a b/c:2", 1)]
    d.close()


def test_a_bad_partition_expression_is_named(tmp_path: Path) -> None:
    d = open_delta(tmp_path / "lake", options={"partition_by": "nope + 1"})  # no I/O before
    with pytest.raises(DestinationError, match="partition expression 'nope \\+ 1'"):
        d.ensure_table(EVENTS)


def test_a_batch_cut_between_two_tables_commits_lands_once(
    root: str, lake: DeltaDestination, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delta has no transaction across tables: the crash comes after ``a``'s commit and before
    ``b``'s; the replay adds nothing to ``a`` and everything to ``b``."""
    other = TableSchema("b", EVENTS.columns)
    schemas = {"events": lake.ensure_table(EVENTS), "b": lake.ensure_table(other)}
    tables = {"events": events([1, 2]), "b": events([7])}
    real = DeltaDestination._commit_table

    def crash_on_b(self: DeltaDestination, writer: str, batch: int, name: str, parts: Any) -> bool:
        if name == "b":
            raise SystemExit("power cut")
        return real(self, writer, batch, name, parts)

    monkeypatch.setattr(DeltaDestination, "_commit_table", crash_on_b)
    with pytest.raises(SystemExit):
        lake.commit_staged("lake", 0, lake.stage("lake", 0, "p0", tables), schemas)
    monkeypatch.setattr(DeltaDestination, "_commit_table", real)
    restarted = open_delta(root)
    assert restarted.committed("lake") is None
    restarted.clean_staging("lake")  # the writer starting: the cut batch's staged files go
    parts = restarted.stage("lake", 0, "p0", tables)
    assert restarted.commit_staged("lake", 0, parts, schemas) is True
    restarted.clean_staging("lake")
    assert delta_query(restarted, "SELECT id FROM events ORDER BY id") == [(1,), (2,)]
    assert delta_query(restarted, "SELECT id FROM b") == [(7,)]
    assert len(writes(restarted, "events")) == 1 and len(writes(restarted, "b")) == 1
    assert delta_leftovers(restarted) == []


def test_upserts_merge_on_the_key_the_last_row_of_the_batch_winning(root: str) -> None:
    d = open_delta(root, primary_key=["id"])
    users = TableSchema("users", {"id": Column("id", T.INT64), "v": Column("v", T.STRING)}, ("id",))
    schemas = {"users": d.ensure_table(users)}
    assert schemas["users"].primary_key == ("id",)

    def rows(ids: list[int], vs: list[str], order: list[int]) -> pa.Table:
        return pa.table(
            {"id": pa.array(ids, pa.int64()), "v": vs, ORDER_COLUMN: pa.array(order, pa.int64())}
        )

    d.commit_staged(
        "lake", 0, d.stage("lake", 0, "p0", {"users": rows([1, 2], ["a", "b"], [0, 1])}), schemas
    )
    a = d.stage("lake", 1, "p0", {"users": rows([1, 3], ["last", "x"], [7, 1])})
    b = d.stage("lake", 1, "p1", {"users": rows([1, 3, 3], ["early", "y", "z"], [3, 5, 2])})
    assert d.commit_staged("lake", 1, a + b, schemas) is True
    d.clean_staging("lake")
    assert (
        d.commit_staged(
            "lake", 1, d.stage("lake", 1, "p0", {"users": rows([1], ["no"], [9])}), schemas
        )
        is False
    )
    assert delta_query(d, "SELECT id, v FROM users ORDER BY id") == [
        (1, "last"),
        (2, "b"),
        (3, "y"),
    ]
    assert [h["operation"] for h in writes(d, "users")] == ["MERGE", "MERGE"]
    assert delta_leftovers(d) == []
    reopened = open_delta(root, primary_key=["id"])
    assert reopened.table("users").primary_key == ("id",)  # kept in the table's properties
    d.close()


def test_a_crashed_runs_files_go_at_the_start_and_a_dead_attempts_with_vacuum(
    root: str, lake: DeltaDestination
) -> None:
    schemas = {"events": lake.ensure_table(EVENTS)}
    dead = lake.stage("lake", 0, "p0a0", {"events": events([1, 2])})  # its executor died
    live = lake.stage("lake", 0, "p0a1", {"events": events([1, 2])})
    lake.commit_staged("lake", 0, live, schemas)
    lake.clean_staging("lake")  # after the commit: no listing of the table's folders
    assert delta_leftovers(lake) == [p.ref for p in dead]  # never listed in the log: unseen
    lake.stage("lake", 1, "p0a0", {"events": events([3])})  # then the run crashed
    theirs = lake.stage("other", 0, "p0a0", {"events": events([4])})
    restarted = open_delta(root)
    restarted.clean_staging("lake")  # the writer starting: its batch 1 was never recorded
    assert delta_leftovers(restarted) == sorted(p.ref for p in dead + theirs)
    assert delta_query(restarted, "SELECT id FROM events ORDER BY id") == [(1,), (2,)]
    gone = vacuum({"events": restarted.delta_table("events")}, 0, dry_run=False)
    # unlisted files older than the retention (SeaweedFS also lists the emptied partition
    # folder as an object, which vacuum deletes with them)
    assert gone[0].files_removed >= 2
    assert delta_leftovers(restarted) == []
    assert delta_query(restarted, "SELECT id FROM events ORDER BY id") == [(1,), (2,)]


def test_missing_staged_files_make_the_batch_stage_again(lake: DeltaDestination) -> None:
    schemas = {"events": lake.ensure_table(EVENTS)}
    parts = lake.stage("lake", 0, "p0", {"events": events([1])})
    lake.location.delete([parts[0].ref])
    with pytest.raises(DestinationUnavailable, match="must be staged again"):
        lake.commit_staged("lake", 0, parts, schemas)
    assert lake.committed("lake") is None


def many_small_batches(d: DeltaDestination, n: int) -> dict[str, TableSchema]:
    schemas = {"events": d.ensure_table(EVENTS)}
    for b in range(n):
        d.commit_staged("lake", b, d.stage("lake", b, "p0", {"events": events([b])}), schemas)
        d.clean_staging("lake")
    return schemas


def test_optimize_zorder_and_vacuum_from_the_command_line(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    config = tmp_path / "headwater.yaml"
    dest = {"id": "lake", "type": "delta", "path": str(root), "options": {"zorder_by": ["id"]}}
    config.write_text(
        json.dumps({"data_dir": str(tmp_path / "data"), "pipeline": {"destinations": [dest]}})
    )
    d = open_delta(root)
    many_small_batches(d, 6)
    before = len(d.delta_table("events").file_uris())
    runner = CliRunner()
    out = runner.invoke(
        cli, ["--config", str(config), "pipeline", "optimize", "lake", "--format", "json"]
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["table"] == "events" and report["action"] == "zorder"
    assert report["files_removed"] == before == 6 and report["files_added"] == 1
    dt = d.delta_table("events")
    assert len(dt.file_uris()) == 1
    assert delta_query(d, "SELECT count(*), min(id), max(id) FROM events") == [(6, 0, 5)]
    dry = runner.invoke(
        cli,
        [
            "--config",
            str(config),
            "pipeline",
            "vacuum",
            "lake",
            "--retention-hours",
            "0",
            "--dry-run",
            "--format",
            "json",
        ],
    )
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["files_removed"] == 6
    assert sum(1 for _ in root.glob("events/*/*.parquet")) == 7
    gone = runner.invoke(
        cli, ["--config", str(config), "pipeline", "vacuum", "lake", "--retention-hours", "0"]
    )
    assert gone.exit_code == 0, gone.output
    assert sum(1 for _ in root.glob("events/*/*.parquet")) == 1
    assert delta_query(d, "SELECT count(*) FROM events") == [(6,)]
    wrong = runner.invoke(cli, ["--config", str(config), "pipeline", "optimize", "nope"])
    assert wrong.exit_code != 0 and "no destination 'nope'" in wrong.output


def test_auto_compaction_every_n_commits(root: str) -> None:
    d = open_delta(root, options={"auto_compact_every": 4})
    many_small_batches(d, 8)
    dt = d.delta_table("events")
    assert len(dt.file_uris()) == 1  # compacted after the 4th and the 8th commit
    assert [h["operation"] for h in dt.history()].count("OPTIMIZE") == 2
    assert delta_query(d, "SELECT count(*) FROM events") == [(8,)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"options": {"partition_column": "Event Date"}}, "not a column name"),
        ({"options": {"compression": "brotli9"}}, "unknown compression"),
        ({"options": {"zorder": ["id"]}}, "zorder"),
        ({"options": {"auto_compact_every": -1}}, "auto_compact_every"),
    ],
)
def test_bad_options_are_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="delta destination's options") as e:
        DestinationConfig.model_validate({"id": "lake", "type": "delta", "path": "x", **extra})
    assert message in str(e.value)


def test_a_path_that_is_neither_a_folder_nor_s3_is_refused(tmp_path: Path) -> None:
    config = DestinationConfig(id="lake", type="delta", path="gs://bucket/x")
    with pytest.raises(DestinationError, match="local folder or s3a://bucket/prefix"):
        open_destination(config, tmp_path)


def test_errors_are_classified() -> None:
    from deltalake.exceptions import CommitFailedError, DeltaError

    assert isinstance(classify(CommitFailedError("lost to another writer")), DestinationUnavailable)
    assert isinstance(classify(ConnectionResetError("reset by peer")), DestinationUnavailable)
    assert isinstance(
        classify(DeltaError("Generic S3 error: connection refused")), DestinationUnavailable
    )
    assert isinstance(classify(DeltaError("Schema error: invalid data type")), DestinationError)
    assert isinstance(classify(PermissionError("read-only file system")), DestinationError)
