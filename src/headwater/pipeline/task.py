"""Running a batch's program inside a Spark task (or in-process, on a sample), over Arrow.

A task receives its share of the micro-batch as Arrow record batches in the source's layout.
``TaskRun`` runs the program's query over all of them in DuckDB (a connection per task, one
thread: Spark runs a task per core): each batch is turned into the program's input relation
(the record headers it reads as columns, the value as UTF-8 text where it is that, protobuf
payloads decoded) as the query reads it, and the output comes back in batches of ``CHUNK_ROWS``
rows and is handed on:

- the rows of each target table, in parts of ``CHUNK_ROWS`` (``on_rows``: the sink stages them);
- the rows a step failed (``on_failed``: the failed store), except novel ones, whose failure
  may be undone by learning (the writer decides about those once the batch is planned for good);
- a ``Summary``: row counts per table, failures, and for novel rows what they hold: per routed
  table the leaves of their JSON (inferred exactly, in Python) and the planned fields that had a
  value (the program's ``learn_sql`` over just those rows).

No row is turned into Python objects except novel and failed ones.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
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
    SESSION,
    TABLE,
    UTF8,
    header,
    utf8_or_null,
)
from headwater.pipeline.failed import FailedEvent, make_id, now_iso
from headwater.pipeline.positions import Positions
from headwater.pipeline.program import (
    CHUNK_ROWS,
    FAIL_ALL,
    FAIL_NOVEL,
    LEARN,
    LEARN_ROUTED,
    WRITE,
    Program,
    check_mode,
)
from headwater.pipeline.shaping import Shaper
from headwater.pipeline.timing import timed

MALFORMED = "Malformed JSON"
DERIVED = "\x1f"  # between a topic and the index of a row a function made, in its place


@dataclass
class Summary:
    rows: int = 0
    tables: dict[str, int] = field(default_factory=dict)  # target table -> rows
    skipped: int = 0  # routed to no table
    dropped: int = 0  # dropped by a Python function (before the query: not in rows)
    failed: int = 0  # failed by a step (the novel ones included)
    novel: int = 0
    novel_failed: int = 0
    leaves: dict[str, dict[sh.Path, sh.Leaf]] = field(default_factory=dict)  # routed -> leaves
    seen: dict[str, set[sh.Path]] = field(default_factory=dict)  # routed -> fields with values
    seconds: dict[str, float] = field(default_factory=dict)  # task time per phase, summed
    held: Positions = field(default_factory=Positions)  # novel rows held back (hold_novel)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return timed(self.seconds, name)

    def merge(self, other: Summary) -> None:
        self.rows += other.rows
        for t, n in other.tables.items():
            self.tables[t] = self.tables.get(t, 0) + n
        self.skipped += other.skipped
        self.dropped += other.dropped
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
        self.held.merge(other.held)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tables": self.tables,
            "skipped": self.skipped,
            "dropped": self.dropped,
            "failed": self.failed,
            "novel": self.novel,
            "novel_failed": self.novel_failed,
            "leaves": {
                r: [[list(p), sorted(leaf.kinds), leaf.timestamp] for p, leaf in ls.items()]
                for r, ls in self.leaves.items()
            },
            "seen": {r: sorted(list(p) for p in ps) for r, ps in self.seen.items()},
            "seconds": self.seconds,
            "held": self.held.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Summary:
        return cls(
            rows=int(data["rows"]),
            tables={str(t): int(n) for t, n in data["tables"].items()},
            skipped=int(data["skipped"]),
            dropped=int(data.get("dropped", 0)),
            failed=int(data["failed"]),
            novel=int(data["novel"]),
            novel_failed=int(data["novel_failed"]),
            leaves={
                r: {tuple(p): sh.Leaf(frozenset(k), bool(ts)) for p, k, ts in ls}
                for r, ls in data["leaves"].items()
            },
            seen={r: {tuple(p) for p in ps} for r, ps in data["seen"].items()},
            seconds={str(k): float(v) for k, v in data.get("seconds", {}).items()},
            held=Positions.from_json(data.get("held", [])),
        )


# -- the input relation ---------------------------------------------------------------------
def input_table(source: pa.Table, program: Program, first: int = 0) -> pa.Table:
    """The program's input for ``source`` rows (the source's layout), chunk by chunk as they
    came (no copy of the values), numbered (``ROW``) from ``first``."""
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
        ROW: pa.array(np.arange(first, first + n, dtype=np.int64)),
        "value": value,
        "topic": source.column("topic"),
        "partition": source.column("partition"),
        "offset": source.column("offset"),
        "timestamp": source.column("timestamp"),
        "key": source.column("key"),
        "headers": source.column("headers"),
        SESSION: source.column(SESSION)
        if SESSION in source.column_names
        else pa.nulls(n, pa.string()),
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
    per core; UTC, as every timestamp headwater writes). The task's rows go through the program
    as one query (planning a program's query takes tens of milliseconds: once per task, not per
    chunk) that reads its input as a stream and hands its output on in batches; small queries
    over a few rows (learning) run beside it on a second cursor. Closed when the task ends: a
    connection that ran queries holds tens of MB, which an idle Python worker would keep."""

    def __init__(self, program: Program) -> None:
        import duckdb

        # Arrow allocates through the C library, whose freed memory release_memory can hand
        # back; its default, mimalloc, kept freed pages (an idle worker held ~400 MB, now ~220)
        pa.set_memory_pool(pa.system_memory_pool())
        self.con = duckdb.connect()
        self.con.execute("SET threads = 1")
        self.con.execute("SET TimeZone = 'UTC'")
        self.con.execute("SET memory_limit = '256MB'")  # results leave as Arrow; little stays
        if program.functions or program.settings:
            from headwater.pipeline.steps import enrichments, lookup

            lookup.register(self.con, program.geoip_database)
            enrichments.register(self.con, program.settings)
        self._aside: Any = None

    def stream(
        self, query: str, rows: pa.RecordBatchReader, batch_rows: int
    ) -> Iterator[pa.RecordBatch]:
        """``query`` over ``rows`` (read as the query needs them), in batches of at most
        ``batch_rows``, in the order of the input (one thread, no step reorders)."""
        self.con.register(INPUT, rows)
        try:
            yield from self.con.sql(query).to_arrow_reader(batch_rows)
        finally:
            self.con.unregister(INPUT)

    def run(self, query: str, inp: pa.Table) -> pa.Table:
        """``query`` over ``inp``, whole, beside a stream that may be running."""
        if self._aside is None:
            self._aside = self.con.cursor()
        self._aside.register(INPUT, inp)
        try:
            return self._aside.sql(query).to_arrow_table()
        finally:
            self._aside.unregister(INPUT)

    def close(self) -> None:
        if self._aside is not None:
            self._aside.close()
        self.con.close()


# -- a task's run -----------------------------------------------------------------------------
class TaskRun:
    """One task's rows through the program: ``run(batches)`` (Arrow batches in the source's
    layout) returns the ``Summary``.

    The rows stream through one query: DuckDB pulls the input batches as it needs them (each
    turned into the program's input as it is read) and the output comes back in batches of
    ``chunk_rows``, handled as they come: the failed and novel rows need their input rows, so
    the input batches are held until the output has passed them (a few batches). A query that
    meets malformed JSON that looked like an object stops; the rows it had not answered go on
    through the guarded query, which checks every event first."""

    def __init__(
        self,
        program: Program,
        destination: str,
        mode: str = WRITE,
        on_rows: Callable[[dict[str, pa.Table]], None] | None = None,
        on_failed: Callable[[list[FailedEvent]], None] | None = None,
        chunk_rows: int = CHUNK_ROWS,
        failure: tuple[str, str, str] | None = None,
        *,
        hold_novel: bool = False,
        only: Positions | None = None,
    ) -> None:
        """``hold_novel`` (WRITE): hand novel rows to nobody, note their places in the
        summary (``held``) instead; ``only`` (WRITE): handle only the rows at these places (the
        rest were handled by an earlier run of the batch)."""
        check_mode(mode)
        self.program = program
        self.destination = destination
        self.mode = mode
        self.on_rows = on_rows
        self.on_failed = on_failed
        self.chunk_rows = chunk_rows
        self.failure = failure  # FAIL_ALL: (step, code, reason)
        self.hold_novel = hold_novel
        self.only = only
        self.summary = Summary()
        self._buffers = TableBuffers(program.tables)
        self._held: deque[_Held] = deque()  # input batches not yet fully answered, in order
        self._answered = 0  # the rows before this one have come out of the query

    def run(self, batches: Iterable[pa.RecordBatch]) -> Summary:
        inputs = _Inputs(self, iter(batches))
        engine = Engine(self.program)
        try:
            try:
                self._stream(engine, self.program.sql, inputs)
            except Exception as exc:  # DuckDB's, as Arrow's stream reader passes it on
                if MALFORMED not in str(exc) or inputs.error is not None:
                    raise
                unanswered = [h.after(self._answered) for h in self._held]
                self._held = deque(unanswered)
                inputs.again([h.inp for h in unanswered])
                self._stream(engine, self.program.guarded_sql, inputs)
            rest = self._buffers.take(0)
            if rest and self.on_rows is not None:
                with self.summary.phase("stage"):
                    self.on_rows(rest)
            return self.summary
        finally:
            engine.close()

    def _stream(self, engine: Engine, query: str, inputs: _Inputs) -> None:
        first = inputs.peek()
        if first is None:
            return
        reader = pa.RecordBatchReader.from_batches(first.schema, inputs)
        results = engine.stream(query, reader, self.chunk_rows)
        while True:
            with inputs.excluded(self.summary, "query"):  # the reading it caused is not query
                try:
                    out = next(results, None)
                except Exception as exc:
                    if inputs.error is not None:  # reading failed: that is what to report
                        raise inputs.error from exc
                    raise
            if out is None:
                return
            self._answer(pa.Table.from_batches([out]), engine)

    def _answer(self, out: pa.Table, engine: Engine) -> None:
        """Handle a batch of the query's output."""
        if not out.num_rows:
            return
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
            with self.summary.phase("learn"):
                self._learn(out.filter(novel), engine, s)
        if self.mode == WRITE:
            failing = pc.and_(error_valid, pc.invert(novel))
            staging = routed_ok
            if self.only is not None:
                mine = pa.array(self.only.contains(self._places(out.column(ROW))))
                failing, staging = pc.and_(failing, mine), pc.and_(staging, mine)
            if self.hold_novel and s.novel:
                held = pc.and_(staging, novel)
                s.held.add(self._places(out.filter(held).column(ROW)))
                staging = pc.and_(staging, pc.invert(novel))
            if self.only is not None or self.hold_novel:
                s.tables = _value_counts(table.filter(staging)) if _count(staging) else {}
            self._fail(out.filter(failing))
            self._buffers.add(out.filter(staging))
            full = self._buffers.take(self.chunk_rows)
            if full and self.on_rows is not None:
                with self.summary.phase("stage"):
                    self.on_rows(full)
        elif self.mode == FAIL_NOVEL:
            self._fail(out.filter(pc.and_(error_valid, novel)))
        elif self.mode == FAIL_ALL:
            self._fail(out.filter(routed_ok), self.failure)
        self.summary.merge(s)
        self._answered = int(pc.max(out.column(ROW)).as_py()) + 1
        while self._held and self._held[0].end <= self._answered:
            self._held.popleft()

    def _held_rows(self, rows: pa.ChunkedArray | pa.Array, which: str) -> pa.Table:
        """The held input (``inp``) or source (``source``: each input row's record) rows
        numbered ``rows``."""
        held = list(self._held)
        if which == "inp":
            return pa.Table.from_batches([h.inp for h in held]).take(self._at(rows))
        origins, base = [], 0
        for h in held:
            origins.append(h.origin + base)
            base += h.source.num_rows
        index = np.concatenate(origins)[self._at(rows)]
        return pa.Table.from_batches([h.source for h in held]).take(pa.array(index))

    def _at(self, rows: pa.ChunkedArray | pa.Array) -> np.ndarray:
        """Where the rows numbered ``rows`` are among the held input rows."""
        return np.asarray(pc.subtract(rows, self._held[0].first), dtype=np.int64)

    def _places(self, rows: pa.ChunkedArray | pa.Array) -> pa.Table:
        """Topic, partition and offset of the held source rows numbered ``rows``: a row a
        function made (one of several of its record) has a place of its own, its record's with
        ``DERIVED`` and its index after the topic, so each is held, and sent, once."""
        if not len(rows):
            return pa.table({"topic": [], "partition": [], "offset": []})
        places = self._held_rows(rows, "source").select(["topic", "partition", "offset"])
        held = list(self._held)
        if all(h.index is None for h in held):
            return places
        index = np.concatenate(
            [h.index if h.index is not None else np.full(h.inp.num_rows, -1) for h in held]
        )[self._at(rows)]
        made = index >= 0
        if not made.any():
            return places
        topics = np.array(places.column("topic").to_pylist(), dtype=object)
        topics[made] = [f"{t}{DERIVED}{k}" for t, k in zip(topics[made], index[made], strict=True)]
        return places.set_column(0, "topic", pa.array(topics.tolist(), pa.string()))

    def _learn(self, novel: pa.Table, engine: Engine, s: Summary) -> None:
        routed = novel.column(ROUTED).to_pylist()
        texts = novel.column(JSON_TEXT).to_pylist()
        by_table: dict[str, list[str]] = {}
        for r, t in zip(routed, texts, strict=True):
            if t is not None:
                by_table.setdefault(r or "", []).append(t)
        for r, ts in by_table.items():
            s.leaves[r] = sh.infer_texts(ts)
        rows = self._held_rows(novel.column(ROW), "inp")
        flags = engine.run(self.program.learn_sql, rows).to_pylist()
        for row in flags:
            name = row.pop(LEARN_ROUTED) or ""
            paths = [tuple(p) for p in self.program.learn_fields]
            seen = {paths[int(k[1:])] for k, v in row.items() if v}
            s.seen.setdefault(name, set()).update(seen)

    def _fail(self, failed: pa.Table, why: tuple[str, str, str] | None = None) -> None:
        if not failed.num_rows or self.on_failed is None:
            return
        records = self._held_rows(failed.column(ROW), "source").to_pylist()
        errors = failed.column(ERROR).to_pylist()
        at = now_iso()
        events = []
        for record, error in zip(records, errors, strict=True):
            step, code, reason = why or (error["step"], error["code"], error["reason"])
            events.append(failed_event(self.destination, record, step, code, reason or "", at))
        self.on_failed(events)


@dataclass(frozen=True)
class _Held:
    """An input batch the query has read: its records and the program's input for them (a
    row per record, or, after the Python steps, rows for some records, one or several)."""

    first: int  # the number (ROW) of its first row
    source: pa.RecordBatch
    inp: pa.RecordBatch
    origin: np.ndarray  # per input row, its record's place in ``source``
    index: np.ndarray | None = None  # per input row, which of its record's events (-1: the only)

    @property
    def end(self) -> int:
        return self.first + self.inp.num_rows

    def after(self, row: int) -> _Held:
        """The rows from ``row`` on."""
        skip = min(max(row - self.first, 0), self.inp.num_rows)
        index = None if self.index is None else self.index[skip:]
        return _Held(
            self.first + skip, self.source, self.inp.slice(skip), self.origin[skip:], index
        )


class _Inputs:
    """The query's input batches, made from the task's source batches as the query reads them
    (each held by the run until answered). An iterator without ``close``: a query that stops
    early leaves the rest of the task's batches unread, for the next query."""

    def __init__(self, run: TaskRun, batches: Iterator[pa.RecordBatch]) -> None:
        self.run = run
        self.batches = batches
        self.next_row = 0
        self.ready: deque[pa.RecordBatch] = deque()  # made, not yet read by the query
        self.schema: pa.Schema | None = None
        self.spent = 0.0  # seconds spent reading and making input
        self.error: BaseException | None = None  # what reading raised (DuckDB reports its own)

    def __iter__(self) -> _Inputs:
        return self

    def __next__(self) -> pa.RecordBatch:
        if not self.ready:
            self._make()
        if not self.ready:
            raise StopIteration
        return self.ready.popleft()

    def peek(self) -> pa.RecordBatch | None:
        if not self.ready:
            self._make()
        return self.ready[0] if self.ready else None

    def again(self, batches: list[pa.RecordBatch]) -> None:
        """Read ``batches`` (made before) first."""
        self.ready.extendleft(reversed([b for b in batches if b.num_rows]))

    @contextmanager
    def excluded(self, summary: Summary, phase: str) -> Iterator[None]:
        """Time the block as ``phase``, less the reading and making of input done inside it."""
        started, spent = time.perf_counter(), self.spent
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started - (self.spent - spent)
            summary.seconds[phase] = summary.seconds.get(phase, 0.0) + elapsed

    def _make(self) -> None:
        summary = self.run.summary
        started = time.perf_counter()
        try:
            while not self.ready:
                with summary.phase("read"):  # the log, or Spark (the source, the JVM)
                    source = next(self.batches, None)
                if source is None:
                    return
                if not source.num_rows:
                    continue
                with summary.phase("input"):
                    table = input_table(
                        pa.Table.from_batches([source]), self.run.program, self.next_row
                    )
                origin = np.arange(source.num_rows, dtype=np.int64)
                index = None
                if self.run.program.shaping:
                    with summary.phase("shape"):
                        shaped = Shaper.for_spec(self.run.program.shaping).shape(table)
                    summary.dropped += shaped.dropped
                    origin, index = shaped.origin, shaped.index
                    table = shaped.table.set_column(
                        shaped.table.column_names.index(ROW),
                        ROW,
                        pa.array(np.arange(self.next_row, self.next_row + len(origin))),
                    )
                    if not table.num_rows:
                        continue
                with summary.phase("input"):
                    inp = table.combine_chunks().to_batches()[0]
                    if self.schema is None:
                        self.schema = inp.schema
                    elif inp.schema != self.schema:
                        inp = inp.cast(self.schema)
                self.run._held.append(_Held(self.next_row, source, inp, origin, index))
                self.next_row += inp.num_rows
                self.ready.append(inp)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.spent += time.perf_counter() - started


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
