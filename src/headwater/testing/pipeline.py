"""Test helpers for the pipeline: micro-batches in the source's layout, without a log, and the
batch's program run in-process (as a Spark task runs it) without Spark."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from headwater.bus import Message, context
from headwater.bus.arrow import ARROW_SCHEMA

SOURCE_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "timestampType int, headers array<struct<key:string,value:binary>>"
)
EPOCH_2024 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def track_message(i: int) -> Message:
    """The ``i``-th of a run of small ``track`` events as a collector puts them on the log
    (event id ``ev-<i>``, keyed ``k<i>``, received 2024-05-01 12:00 UTC)."""
    return Message(
        json.dumps({"n": i, "user": {"id": f"u{i % 7}"}, "price": i * 0.5}).encode(),
        key=f"k{i}".encode(),
        headers=(
            (context.CONTENT_TYPE, b"application/json"),
            (context.TYPE, b"track"),
            (context.EVENT_ID, f"ev-{i}".encode()),
            (context.RECEIVED_AT, b"2024-05-01T12:00:00.000Z"),
            (context.PROTOCOL, b"raccoon-ws"),
        ),
    )


def event_row(
    value: Mapping[str, Any] | bytes | str | None,
    *,
    offset: int = 0,
    topic: str = "events-track",
    headers: Mapping[str, str | None] | None = None,
    key: bytes | None = None,
    content_type: str | None = "application/json",
) -> tuple[Any, ...]:
    """One row as the source gives it; a mapping is sent as JSON. A header given as None is
    left out."""
    if isinstance(value, Mapping):
        data: bytes | None = json.dumps(value).encode()
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = value
    base: dict[str, str | None] = {
        context.TYPE: topic.split("-", 1)[-1],
        context.EVENT_ID: f"ev-{offset}",
        context.RECEIVED_AT: "2024-05-01T12:00:00.000Z",
        context.CLIENT_IP: "81.2.69.142",
        context.SOURCE: "web",
        context.PROTOCOL: "segment",
        context.CONTENT_TYPE: content_type,
    }
    base.update(headers or {})
    hdrs = [(k, v.encode()) for k, v in base.items() if v is not None]
    return (key, data, topic, 0, offset, EPOCH_2024, 0, hdrs)


def rows_of(
    values: Sequence[Mapping[str, Any] | bytes | str | None],
    *,
    each: Sequence[Mapping[str, str | None]] | None = None,
    **kw: Any,
) -> list[Any]:
    """Rows at offsets 0, 1, ...; ``each``: headers of each row (beside ``headers`` for all)."""
    rows = []
    for i, v in enumerate(values):
        headers = {**kw.get("headers", {}), **(each[i] if each is not None else {})}
        rows.append(event_row(v, offset=i, **{**kw, "headers": headers}))
    return rows


def batch(spark: Any, values: Sequence[Mapping[str, Any] | bytes | str | None], **kw: Any) -> Any:
    """A DataFrame of ``values`` at offsets 0, 1, ... in the source's layout."""
    return spark.createDataFrame(rows_of(values, **kw), SOURCE_SCHEMA)


def source_table(values: Sequence[Mapping[str, Any] | bytes | str | None], **kw: Any) -> pa.Table:
    """An Arrow table of ``values`` at offsets 0, 1, ... in the source's layout."""
    names = ARROW_SCHEMA.names
    rows = [dict(zip(names, r, strict=True)) for r in rows_of(values, **kw)]
    for r in rows:
        r["headers"] = [{"key": k, "value": v} for k, v in r["headers"]]
    return pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)


@dataclass
class Processed:
    """What a batch's program made of it, run in-process."""

    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # ordered by offset
    failed: list[Any] = field(default_factory=list)  # FailedEvent
    summary: Any = None  # task.Summary
    plan: Any = None  # plan.BatchPlan
    knowledge: Any = None  # plan.Knowledge

    def rows(self, table: str = "events") -> list[dict[str, Any]]:
        return self.tables.get(table, [])

    def errors(self) -> dict[int, tuple[str, str]]:
        """offset -> (code, reason) of the failed rows."""
        return {e.offset: (e.code, e.reason) for e in self.failed}


def process(
    source: pa.Table,
    dest: Mapping[str, Any] | None = None,
    *,
    path: Path | None = None,
    pipeline: Mapping[str, Any] | None = None,
    knowledge: Any = None,
) -> Processed:
    """Plan ``source`` for the destination ``dest`` (a config mapping; by default a DuckDB file
    under ``path``) learning what it needs from the batch itself, as a fresh writer does, and
    run the program over it in-process: the rows each table would get, and the failures."""
    from headwater.config.model import HeadwaterConfig
    from headwater.destinations import open_destination
    from headwater.pipeline.plan import Knowledge, plan
    from headwater.pipeline.task import LEARN, WRITE, TaskRun

    root = path or Path("/nonexistent")
    spec = {"id": "wh", "type": "duckdb", "path": str(root / "wh.duckdb"), **(dest or {})}
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(root / "data"), "pipeline": {**(pipeline or {}), "destinations": [spec]}}
    )
    dest_config = config.pipeline.destinations[0]
    destination = open_destination(dest_config, config.data_dir)
    known = knowledge if knowledge is not None else Knowledge()
    try:
        for _ in range(4):
            program = plan(
                known, dest_config, destination, config.pipeline, config.checkpoint_dir()
            ).program
            found = TaskRun(program, dest_config.id, LEARN).run(source.to_batches())
            if not known.learn(found.leaves, found.seen, dest_config):
                break
        out = Processed(knowledge=known)
        out.plan = plan(known, dest_config, destination, config.pipeline, config.checkpoint_dir())
        parts: dict[str, list[pa.Table]] = {}

        def on_rows(tables: dict[str, pa.Table]) -> None:
            for name, rows in tables.items():
                parts.setdefault(name, []).append(rows)

        run = TaskRun(out.plan.program, dest_config.id, WRITE, on_rows, out.failed.extend)
        out.summary = run.run(source.to_batches())
        for name, ps in parts.items():
            rows = pa.concat_tables(ps).sort_by("_hw_order").drop_columns(["_hw_order"])
            out.tables[name] = rows.to_pylist()
        out.failed.sort(key=lambda e: e.offset)
        return out
    finally:
        destination.close()


def events_after_steps(
    source: pa.Table, tmp_path: Path, pipeline: Mapping[str, Any] | None = None, **dest: Any
) -> tuple[list[dict[str, Any] | None], dict[int, tuple[str, str]]]:
    """Each row's event after every step (its JSON as an archive keeps it; None for rows that
    failed or were skipped), in offset order, and the failures by offset. Rows are told apart
    by their event id (``event_row`` gives ``ev-<offset>``)."""
    spec = {"type": "files", "format": "jsonl.gz", "path": str(tmp_path / "files"), **dest}
    done = process(source, spec, path=tmp_path, pipeline=pipeline)
    by_id = {}
    for rows in done.tables.values():
        for r in rows:
            event = json.loads(r["event"])
            by_id[event.get("eventn_ctx", {}).get("event_id")] = event
    offsets = source.column("offset").to_pylist()
    return [by_id.get(f"ev-{o}") for o in offsets], done.errors()
