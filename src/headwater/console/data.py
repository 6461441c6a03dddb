"""What the console reads, each from the place the CLI reads it: the log (topics, groups, a
record), the pipeline's status file (or the running board), the destinations' own catalogs,
the transport readers' status files. Blocking calls: the pages run them in a thread."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headwater.bus import Bus
from headwater.config.model import HeadwaterConfig
from headwater.errors import HeadwaterError
from headwater.ops.lag import group_rows, lag_row
from headwater.pipeline.config import DestinationConfig

if TYPE_CHECKING:
    from headwater.pipeline.status import DestinationStatus

SCHEMA_WAIT_S = 5.0
COUNT_CAP = 1000  # webhook failures counted on the overview stop here: the page stays quick


@dataclass
class TopicRow:
    name: str
    partitions: int
    records: int
    appended: int
    size_bytes: int | None


@dataclass
class WriterLag:
    group: str
    lag: int
    partitions: list[dict[str, Any]] = field(default_factory=list)


def log_topics(config: HeadwaterConfig, bus: Bus) -> list[TopicRow]:
    """Every topic with its partitions, the records it holds, the records ever appended and,
    on the embedded log, its size on disk."""
    rows = []
    for info in bus.topics():
        held = appended = 0
        for p in range(info.partitions):
            low, high = bus.watermarks(info.name, p)
            held += high - low
            appended += high
        size = None
        if config.bus.backend == "embedded":
            size = _folder_size(config.log_dir() / info.name)
        rows.append(TopicRow(info.name, info.partitions, held, appended, size))
    return rows


def _folder_size(path: Path) -> int | None:
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return None


def writer_lags(config: HeadwaterConfig, bus: Bus) -> list[WriterLag]:
    """Each pipeline destination (delivery destinations too), by the offsets its query's
    checkpoint committed, and each group with offsets on the bus (webhook workers, mirrors),
    with its total lag."""
    out = []
    for dest in config.pipeline.destinations:
        committed = checkpoint_offsets(config.checkpoint_dir() / dest.id)
        rows = []
        for (topic, partition), offset in sorted(committed.items()):
            try:
                low, high = bus.watermarks(topic, partition)
            except HeadwaterError:  # a topic of the failed store (replays), or gone
                continue
            rows.append(lag_row(topic, partition, offset, low, high))
        if rows:
            out.append(WriterLag(f"destination {dest.id}", sum(r["lag"] for r in rows), rows))
    for group in bus.groups():
        rows = group_rows(bus, group)
        out.append(WriterLag(group, sum(r["lag"] or 0 for r in rows), rows))
    return out


def checkpoint_offsets(checkpoint: Path) -> dict[tuple[str, int], int]:
    """The offsets of the last batch a query committed: ``commits/<n>`` says batch n is done,
    ``offsets/<n>`` holds, after its version and metadata lines, one JSON line per source
    (topic -> partition -> next offset). Empty when the query never committed."""
    try:
        done = [int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()]
    except FileNotFoundError:
        return {}
    if not done:
        return {}
    try:
        lines = (checkpoint / "offsets" / str(max(done))).read_text().splitlines()[2:]
    except FileNotFoundError:
        return {}
    out: dict[tuple[str, int], int] = {}
    for line in lines:
        try:
            source = json.loads(line)
        except ValueError:
            continue
        if isinstance(source, dict):
            for topic, parts in source.items():
                if isinstance(parts, dict):
                    for p, offset in parts.items():
                        out[(topic, int(p))] = int(offset)
    return out


def destination_statuses(
    config: HeadwaterConfig, running: list[DestinationStatus] | None
) -> dict[str, DestinationStatus]:
    """Each destination's status: the running pipeline's board in this process, else the
    status file a pipeline wrote."""
    from headwater.pipeline.status import read_status

    if running is None:
        written = read_status(config)
        running = written.destinations if written is not None else []
    return {s.destination: s for s in running}


def transport_statuses(config: HeadwaterConfig) -> list[dict[str, Any]]:
    from headwater.transport.reader import read_status

    out = []
    for reader in config.transport.readers:
        status = read_status(config.transport_dir(reader.id))
        updated = status.get("updated_at")
        namespaces = {
            name: {
                "phase": entry.get("phase"),
                "position": entry.get("position"),
                "lag": entry.get("lag"),
                "rows": entry.get("rows", entry.get("lines")),
            }
            for name, entry in sorted(status.get("namespaces", {}).items())
        }
        out.append(
            {
                "id": reader.id,
                "type": reader.type,
                "age_s": None if updated is None else time.time() - updated,
                "running": bool(status.get("running")),
                "position": status.get("position"),
                "lag_bytes": status.get("lag_bytes"),
                "changes": status.get("changes"),
                "error": status.get("error"),
                "namespaces": namespaces,
            }
        )
    return out


def table_columns(
    config: HeadwaterConfig, dest: DestinationConfig, writes_here: bool
) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
    """The tables of a destination as the destination has them (columns and types, the
    ``__<type>`` siblings included), and why they could not be read (None: they were).
    ``writes_here``: this process runs the pipeline (``up``)."""
    sql = (
        "SELECT table_name, column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = {schema} AND table_name NOT LIKE '\\_headwater%' ESCAPE '\\' "
        "ORDER BY table_name, ordinal_position"
    )
    try:
        if dest.type == "duckdb":
            path = Path(dest.path) if dest.path else config.warehouse_path()
            rows = _duckdb_rows(path, sql, writes_here)
        elif dest.type == "postgres" and dest.dsn:
            rows = _postgres_rows(dest, sql)
        else:
            return {}, f"tables of a {dest.type} destination are not shown here"
    except FileNotFoundError:
        return {}, "no table yet (no batch has been written)"
    except Exception as exc:  # the destination is down or busy: say so on the page
        return {}, f"could not read the tables: {exc}"
    tables: dict[str, list[tuple[str, str]]] = {}
    for table, column, kind in rows:
        tables.setdefault(table, []).append((column, kind))
    return tables, None


def _duckdb_rows(path: Path, sql: str, writes_here: bool) -> list[tuple[Any, ...]]:
    """Read-only and held only for the query, as ``headwater sql`` does; in the process that
    writes the file (``up``) a connection configured like the writer's, which DuckDB shares
    with it (a read-only one there would make the writer's next connection fail)."""
    import duckdb

    from headwater.ops.warehouse import query

    text = sql.format(schema="'main'")
    if not writes_here:
        return query(path, text, SCHEMA_WAIT_S)[1]
    if not path.exists():
        raise FileNotFoundError(2, "no warehouse yet", str(path))
    con = duckdb.connect(str(path))
    try:
        return con.execute(text).fetchall()
    finally:
        con.close()


def _postgres_rows(dest: DestinationConfig, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dest.dsn or "", connect_timeout=5) as con:
        return con.execute(sql.format(schema="current_schema()")).fetchall()
