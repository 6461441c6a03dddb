"""Running a batch's program inside a Spark task (or in-process, on a sample), over Arrow.

A task receives its share of the micro-batch as Arrow record batches in the source's layout.
``TaskRun`` gathers them into chunks of ``CHUNK_ROWS`` rows, turns each chunk into the program's
input relation (the record headers it reads as columns, the value as UTF-8 text where it is
that, protobuf payloads decoded), runs the program's query in DuckDB (a connection per task,
the query prepared once for all its chunks; one thread: Spark runs a task per core), and hands
on what came out:

- the rows of each target table, in chunks (``on_rows``: the sink stages them);
- the rows a step failed (``on_failed``: the failed store), except novel ones, whose failure
  may be undone by learning (the writer decides about those once the batch is planned for good);
- a ``Summary``: row counts per table, failures, and for novel rows what they hold: per routed
  table the leaves of their JSON (inferred exactly, in Python) and the planned fields that had a
  value (the program's ``learn_sql`` over just those rows).

No row is turned into Python objects except novel and failed ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headwater.bus import context
from headwater.pipeline import shape as sh
from headwater.pipeline.columns import (
    ERROR,
    INPUT,
    JSON_TEXT,
    NOVEL,
    ORDER,
    PROTO_ERROR,
    PROTO_JSON,
    ROUTED,
    ROW,
    TABLE,
    UTF8,
    header,
)
from headwater.pipeline.failed import FailedEvent, make_id, now_iso
from headwater.pipeline.program import (
    CHUNK_ROWS,
    FAIL_ALL,
    FAIL_NOVEL,
    LEARN,
    LEARN_ROUTED,
    MODES,
    WRITE,
    Program,
)
from headwater.pipeline.timing import timed

MALFORMED = "Malformed JSON"


@dataclass
class Summary:
    rows: int = 0
    tables: dict[str, int] = field(default_factory=dict)  # target table -> rows
    skipped: int = 0  # routed to no table
    failed: int = 0  # failed by a step (the novel ones included)
    novel: int = 0
    novel_failed: int = 0
    leaves: dict[str, dict[sh.Path, sh.Leaf]] = field(default_factory=dict)  # routed -> leaves
    seen: dict[str, set[sh.Path]] = field(default_factory=dict)  # routed -> fields with values
    seconds: dict[str, float] = field(default_factory=dict)  # task time per phase, summed

    def phase(self, name: str) -> AbstractContextManager[None]:
        return timed(self.seconds, name)

    def merge(self, other: Summary) -> None:
        self.rows += other.rows
        for t, n in other.tables.items():
            self.tables[t] = self.tables.get(t, 0) + n
        self.skipped += other.skipped
        self.failed += other.failed
        self.novel += other.novel
        self.novel_failed += other.novel_failed
        for routed, leaves in other.leaves.items():
            mine = self.leaves.setdefault(routed, {})
            for path, leaf in leaves.items():
                mine[path] = leaf if path not in mine else mine[path].merge(leaf)
        for routed, paths in other.seen.items():
            self.seen.setdefault(routed, set()).update(paths)
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tables": self.tables,
            "skipped": self.skipped,
            "failed": self.failed,
            "novel": self.novel,
            "novel_failed": self.novel_failed,
            "leaves": {
                r: [[list(p), sorted(leaf.kinds), leaf.timestamp] for p, leaf in ls.items()]
                for r, ls in self.leaves.items()
            },
            "seen": {r: sorted(list(p) for p in ps) for r, ps in self.seen.items()},
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Summary:
        return cls(
            rows=int(data["rows"]),
            tables={str(t): int(n) for t, n in data["tables"].items()},
            skipped=int(data["skipped"]),
            failed=int(data["failed"]),
            novel=int(data["novel"]),
            novel_failed=int(data["novel_failed"]),
            leaves={
                r: {tuple(p): sh.Leaf(frozenset(k), bool(ts)) for p, k, ts in ls}
                for r, ls in data["leaves"].items()
            },
            seen={r: {tuple(p) for p in ps} for r, ps in data["seen"].items()},
            seconds={str(k): float(v) for k, v in data.get("seconds", {}).items()},
        )


# -- the input relation ---------------------------------------------------------------------
def input_table(source: pa.Table, program: Program) -> pa.Table:
    """The program's input for ``source`` rows (the source's layout), chunk by chunk as they
    came (no copy of the values)."""
    n = source.num_rows
    names = sorted({*program.headers, *([context.TYPE] if program.protobuf else [])})
    value = source.column("value")
    texts, found = [], {name: [] for name in names}
    for chunk in value.chunks:
        texts.append(utf8_or_null(chunk))
    for chunk in source.column("headers").chunks:
        for name, values in header_values(chunk, names).items():
            found[name].append(values)
    headers = {name: pa.chunked_array(chunks, pa.string()) for name, chunks in found.items()}
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        ROW: pa.array(np.arange(n, dtype=np.int64)),
        "value": value,
        "topic": source.column("topic"),
        "partition": source.column("partition"),
        "offset": source.column("offset"),
        "timestamp": source.column("timestamp"),
        UTF8: pa.chunked_array(texts, pa.string()),
    }
    for name in program.headers:
        columns[header(name)] = headers[name]
    if program.protobuf:
        from headwater.pipeline.steps.protobuf import MessageType, decode_values

        kinds = {t: MessageType.from_json(m) for t, m in program.protobuf.items()}
        texts, errors = decode_values(
            value.combine_chunks(), headers[context.TYPE].combine_chunks(), kinds
        )
        columns[PROTO_JSON] = texts
        columns[PROTO_ERROR] = errors
    return pa.table(columns)


def header_values(headers: pa.Array, names: Iterable[str]) -> dict[str, pa.Array]:
    """Per header name, its first value in each record as text (null where absent)."""
    n = len(headers)
    flat = headers.flatten()
    keys = flat.field("key")
    values = flat.field("value")
    parent = pc.list_parent_indices(headers).to_numpy()
    out = {}
    for name in names:
        hit = np.flatnonzero(
            pc.fill_null(pc.equal(keys, name), False).to_numpy(zero_copy_only=False)
        )
        position = np.full(n, -1, dtype=np.int64)
        position[parent[hit][::-1]] = hit[::-1]  # the first one wins
        taken = values.take(pa.array(position, mask=position < 0))
        out[name] = utf8_or_null(taken, replace=True)
    return out


def utf8_or_null(values: pa.Array, *, replace: bool = False) -> pa.Array:
    """``values`` (binary) as text: the same buffers seen as text when they are valid UTF-8
    (checked by Arrow in one pass, no copy); else, per value, null (or with replacement
    characters when ``replace``)."""
    text = values.view(pa.string())
    try:
        text.validate(full=True)
        return text
    except pa.ArrowInvalid:
        pass
    out = []
    for v in values.to_pylist():
        if v is None:
            out.append(None)
            continue
        try:
            out.append(v.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(v.decode("utf-8", "replace") if replace else None)
    return pa.array(out, pa.string())


# -- memory ---------------------------------------------------------------------------------
def release_memory() -> None:
    """Hand what the process freed back to the system (after a task: a Python worker then
    waits, idle, for the next one, while the driver commits)."""
    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: other C libraries have no such call)."""
    import ctypes

    return getattr(ctypes.CDLL(None), "malloc_trim", None)


# -- the engine -----------------------------------------------------------------------------
class Engine:
    """A task's DuckDB connection with the program's functions (one thread: Spark runs a task
    per core; UTC, as every timestamp headwater writes) and its queries prepared: a program's
    query takes tens of milliseconds to plan, so each is planned once per task and run per
    chunk over whatever ``hw_input`` holds then. Closed when the task ends: a connection that
    ran queries holds tens of MB, which the Python worker would keep while it idles."""

    def __init__(self, program: Program) -> None:
        import duckdb

        # Arrow allocates through the C library, whose freed memory release_memory can hand
        # back; its default, mimalloc, kept freed pages (an idle worker held ~400 MB, now ~220)
        pa.set_memory_pool(pa.system_memory_pool())
        self.con = duckdb.connect()
        self.con.execute("SET threads = 1")
        self.con.execute("SET TimeZone = 'UTC'")
        self.con.execute("SET memory_limit = '256MB'")  # results leave as Arrow; little stays
        if program.functions:
            from headwater.pipeline.steps import lookup

            lookup.register(self.con, program.geoip_database)
        self.prepared: dict[str, str] = {}  # SQL -> statement name

    def run(self, query: str, inp: pa.Table) -> pa.Table:
        self.con.register(INPUT, inp)
        try:
            name = self.prepared.get(query)
            if name is None:
                name = f"hw_q{len(self.prepared)}"
                self.con.execute(f"PREPARE {name} AS {query}")
                self.prepared[query] = name
            return self.con.sql(f"EXECUTE {name}").to_arrow_table()
        finally:
            self.con.unregister(INPUT)

    def close(self) -> None:
        self.con.close()


def warm() -> None:
    """Load what running a program needs (a worker's first task then starts at once)."""
    import duckdb

    from headwater.pipeline import sink  # noqa: F401  (the writer's module)
    from headwater.pipeline.steps import lookup  # noqa: F401

    duckdb.connect().execute("SELECT 1").fetchall()


def run_query(engine: Engine, program: Program, inp: pa.Table) -> pa.Table:
    """The program over ``inp``; a chunk holding malformed JSON that looked like an object
    runs again with every event checked first."""
    import duckdb

    try:
        return engine.run(program.sql, inp)
    except duckdb.InvalidInputException as exc:
        if MALFORMED not in str(exc):
            raise
        return engine.run(program.guarded_sql, inp)


# -- a task's run -----------------------------------------------------------------------------
class TaskRun:
    """One task's rows through the program (``add`` each Arrow batch, then ``finish``)."""

    def __init__(
        self,
        program: Program,
        destination: str,
        mode: str = WRITE,
        on_rows: Callable[[dict[str, pa.Table]], None] | None = None,
        on_failed: Callable[[list[FailedEvent]], None] | None = None,
        chunk_rows: int = CHUNK_ROWS,
        failure: tuple[str, str, str] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
        self.program = program
        self.destination = destination
        self.mode = mode
        self.on_rows = on_rows
        self.on_failed = on_failed
        self.chunk_rows = chunk_rows
        self.failure = failure  # FAIL_ALL: (step, code, reason)
        self.summary = Summary()
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._buffers = TableBuffers(program.tables)
        self._engine: Engine | None = None  # opened by the first chunk, closed by finish

    def add(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.chunk_rows:
            self._run_pending()

    def finish(self) -> Summary:
        try:
            if self._pending:
                self._run_pending()
            rest = self._buffers.take(0)
            if rest and self.on_rows is not None:
                with self.summary.phase("stage"):
                    self.on_rows(rest)
            return self.summary
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the engine (``finish`` does; a run given up on calls it)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.program)
        return self._engine

    def _run_pending(self) -> None:
        source = pa.Table.from_batches(self._pending)
        self._pending = []
        self._pending_rows = 0
        self._chunk(source)

    def _chunk(self, source: pa.Table) -> None:
        timing = self.summary
        with timing.phase("input"):
            inp = input_table(source, self.program)
        with timing.phase("query"):
            out = run_query(self.engine, self.program, inp)
        s = Summary(rows=out.num_rows)
        table = out.column(TABLE)
        error_valid = pc.is_valid(out.column(ERROR))
        novel = pc.fill_null(out.column(NOVEL), False)
        ok = pc.invert(error_valid)
        routed_ok = pc.and_(ok, pc.not_equal(table, ""))
        for name, count in _value_counts(table.filter(routed_ok)).items():
            s.tables[name] = count
        s.skipped = _count(pc.and_(pc.and_(ok, pc.equal(table, "")), pc.invert(novel)))
        s.failed = _count(error_valid)
        s.novel = _count(novel)
        s.novel_failed = _count(pc.and_(novel, error_valid))
        if s.novel and self.mode in (WRITE, LEARN):
            with timing.phase("learn"):
                self._learn(out.filter(novel), inp, s)
        if self.mode == WRITE:
            self._fail(source, out.filter(pc.and_(error_valid, pc.invert(novel))))
            self._buffers.add(out.filter(routed_ok))
            full = self._buffers.take(self.chunk_rows)
            if full and self.on_rows is not None:
                with timing.phase("stage"):
                    self.on_rows(full)
        elif self.mode == FAIL_NOVEL:
            self._fail(source, out.filter(pc.and_(error_valid, novel)))
        elif self.mode == FAIL_ALL:
            self._fail(source, out.filter(routed_ok), self.failure)
        self.summary.merge(s)

    def _learn(self, novel: pa.Table, inp: pa.Table, s: Summary) -> None:
        routed = novel.column(ROUTED).to_pylist()
        texts = novel.column(JSON_TEXT).to_pylist()
        by_table: dict[str, list[str]] = {}
        for r, t in zip(routed, texts, strict=True):
            if t is not None:
                by_table.setdefault(r or "", []).append(t)
        for r, ts in by_table.items():
            s.leaves[r] = sh.infer_texts(ts)
        rows = inp.take(novel.column(ROW))
        flags = self.engine.run(self.program.learn_sql, rows).to_pylist()
        for row in flags:
            name = row.pop(LEARN_ROUTED) or ""
            paths = [tuple(p) for p in self.program.learn_fields]
            seen = {paths[int(k[1:])] for k, v in row.items() if v}
            s.seen.setdefault(name, set()).update(seen)

    def _fail(
        self, source: pa.Table, failed: pa.Table, why: tuple[str, str, str] | None = None
    ) -> None:
        if not failed.num_rows or self.on_failed is None:
            return
        records = source.take(failed.column(ROW)).to_pylist()
        errors = failed.column(ERROR).to_pylist()
        at = now_iso()
        events = []
        for record, error in zip(records, errors, strict=True):
            step, code, reason = why or (error["step"], error["code"], error["reason"])
            events.append(failed_event(self.destination, record, step, code, reason or "", at))
        self.on_failed(events)


def failed_event(
    destination: str, record: Mapping[str, Any], step: str, code: str, reason: str, at: str
) -> FailedEvent:
    """The failed store's entry for a source record."""
    headers = tuple((h["key"], bytes(h["value"] or b"")) for h in record["headers"] or [])
    return FailedEvent(
        id=make_id(destination, record["topic"], record["partition"], record["offset"]),
        destination=destination,
        step=step,
        code=code,
        reason=reason,
        topic=record["topic"],
        partition=record["partition"],
        offset=record["offset"],
        failed_at=at,
        key=None if record["key"] is None else bytes(record["key"]),
        value=bytes(record["value"] or b""),
        headers=headers,
    )


def _count(mask: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(mask).as_py() or 0)


def _value_counts(values: pa.ChunkedArray | pa.Array) -> dict[str, int]:
    counts = pc.value_counts(values)
    return {str(v["values"]): int(v["counts"]) for v in counts.to_pylist()}


class TableBuffers:
    """A task's rows per target table, renamed to the table's columns (and ``_hw_order``)."""

    def __init__(self, tables: Mapping[str, Sequence[Sequence[str]]]) -> None:
        self.columns = {t: [o for _, o in cols] + [ORDER] for t, cols in tables.items()}
        self.names = {t: [c for c, _ in cols] + [ORDER] for t, cols in tables.items()}
        self.parts: dict[str, list[pa.Table]] = {}
        self.rows: dict[str, int] = {}

    def add(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        names = rows.column(TABLE)
        tables = pc.unique(names).to_pylist()
        for table in tables:
            if table not in self.columns:
                raise ValueError(f"a row's {TABLE} {table!r} is no table of the program")
            mine = rows.filter(pc.equal(names, table)) if len(tables) > 1 else rows
            picked = mine.select(self.columns[table]).rename_columns(self.names[table])
            self.parts.setdefault(table, []).append(picked)
            self.rows[table] = self.rows.get(table, 0) + mine.num_rows

    def take(self, at_least: int) -> dict[str, pa.Table]:
        """The tables holding ``at_least`` rows (every non-empty one for 0), removed."""
        out = {}
        for table, count in list(self.rows.items()):
            if count and count >= at_least:
                out[table] = pa.concat_tables(self.parts.pop(table))
                del self.rows[table]
        return out
