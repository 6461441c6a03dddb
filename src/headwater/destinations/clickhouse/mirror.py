"""``apply: upsert`` on ClickHouse (chdb): a mirror table is a ``ReplacingMergeTree`` ordered by
the source's key, with a version and a deleted flag (``_hw_version``, ``_hw_deleted``); read it
with ``FINAL`` (``SELECT ... FROM t FINAL``: deleted rows are left out).

ClickHouse has no transactions, so each step is idempotent instead, in this order: a truncate
newer than the one recorded empties the table (``TRUNCATE``) and is recorded; each table's rows
go in with a deduplication token (``<writer>:<batch>:<table>``, one block), so a replay's insert
is a no-op; the writer's offsets and then the ledger row are written last. Per key, the row
written is the batch's last change (a delete writes the key with ``_hw_deleted = 1``), each
column from the last change that carried it, else from the table (an unchanged TOAST value);
its version, ``(batch + 1) << 32`` plus the change's rank in the batch, beats every earlier one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.transport.apply import (
    NUMERIC,
    ORDER,
    PRECISION,
    TRUNCATES,
    MirrorColumn,
    MirrorTable,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

VERSION, DELETED = "_hw_version", "_hw_deleted"
BATCH_SHIFT = 32
STEP_BASE = 1 << 31  # a step's versions: above its batch's rows, below the next batch's
OFFSETS_TABLE = "_headwater_offsets"

_TYPES = {
    "smallint": "Int16",
    "integer": "Int32",
    "bigint": "Int64",
    "real": "Float32",
    "double precision": "Float64",
    "boolean": "Bool",
    "date": "Date32",
    "timestamp without time zone": "DateTime64(6)",
    "timestamp with time zone": "DateTime64(6, 'UTC')",
    "uuid": "UUID",
}


def q(ident: str) -> str:
    return "`" + ident.replace("\\", "\\\\").replace("`", "\\`") + "`"


def lit(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def target_type(source_type: str) -> str:
    """The ClickHouse type of a source column (without Nullable)."""
    if source_type.endswith("[]"):
        return f"Array(Nullable({target_type(source_type[:-2])}))"
    m = NUMERIC.fullmatch(source_type)
    if m:
        return f"Decimal({m[1]}, {m[2]})" if int(m[1]) <= 76 else "String"
    return _TYPES.get(PRECISION.sub("", source_type), "String")


def column_sql(c: MirrorColumn) -> str:
    """A mirror column's type: Nullable, except the key and arrays (which cannot be)."""
    t = target_type(c.source_type)
    return t if c.key or t.startswith("Array") else f"Nullable({t})"


def create_sql(ref: str, t: MirrorTable) -> str:
    cols = ", ".join(f"{q(c.name)} {column_sql(c)}" for c in t.columns)
    if t.key:
        order = ", ".join(q(k) for k in t.key)
        engine = f"ReplacingMergeTree({VERSION}, {DELETED}) ORDER BY ({order})"
    else:
        engine = "MergeTree ORDER BY tuple()"
    return (
        f"CREATE TABLE IF NOT EXISTS {ref} ({cols}, {VERSION} UInt64, {DELETED} UInt8) "
        f"ENGINE = {engine} SETTINGS non_replicated_deduplication_window = 10000"
    )


def _text(raw: str) -> str:
    """A JSON member's raw text (``JSONExtractRaw``) as the value's text, NULL for null."""
    return (
        f"if({raw} IN ('', 'null'), NULL, if(startsWith({raw}, '\"'), "
        f"JSONExtractString(concat('[', {raw}, ']'), 1), {raw}))"
    )


def typed(raw: str, source_type: str) -> str:
    """SQL of a value, from its raw JSON text, as the mirror column's type."""
    target = target_type(source_type)
    text = _text(raw)
    if target.startswith("Array"):
        # an array cannot be Nullable: the raw text is made non-Nullable first
        whole = f"if(ifNull({raw}, 'null') IN ('', 'null'), '[]', assumeNotNull({raw}))"
        return f"JSONExtract({whole}, {lit(target)})"
    if source_type == "bytea":
        return f"base64Decode({text})"
    if target.startswith("DateTime64"):
        zone = ", 'UTC'" if "UTC" in target else ""
        return f"parseDateTime64BestEffort({text}, 6{zone})"
    if target == "String":
        return text
    # CAST to a Nullable type turns text it cannot parse into NULL: cast to the type itself,
    # so a bad value fails (isolate mode), NULLs kept apart (short-circuit evaluation forced)
    return f"if(isNull({text}), NULL, CAST(assumeNotNull({text}) AS {target}))"


def truncate_statements(
    source: str, t: MirrorTable, ref: str, db: str, writer_id: str
) -> tuple[str, str, str]:
    """(the newest truncate's LSN in the batch, the recorded one, the record's insert)."""
    ns = lit(t.namespace)
    newest = f"SELECT max(lsn) FROM {source} x WHERE namespace = {ns} AND op = 'truncate'"
    recorded = (
        f"SELECT maxOrNull(lsn) FROM {db}.{TRUNCATES} WHERE writer_id = {lit(writer_id)} "
        f"AND namespace = {ns}"
    )
    return newest, recorded, f"INSERT INTO {db}.{TRUNCATES} VALUES ({lit(writer_id)}, {ns}, "


def rows_select(
    source: str, t: MirrorTable, ref: str, since: int, base: int, rank: bool = True
) -> str:
    """The SELECT of the rows to insert for ``t`` (after truncates up to LSN ``since``), with
    ClickHouse's join defaults (``join_use_nulls = 0``: an array column cannot be Nullable)."""
    ns = lit(t.namespace)
    # a partition without a truncate joins no row: NULL (staged columns are Nullable), or 0
    cut = (
        f"SELECT part, max({ORDER}) + 1 AS after FROM {source} x "
        f"WHERE namespace = {ns} AND op = 'truncate' GROUP BY part"
    )
    mine = (
        f"SELECT s.*, row_number() OVER (ORDER BY s.part, s.{ORDER}) AS _hw_rank "
        f"FROM {source} s LEFT JOIN ({cut}) c ON c.part = s.part "
        f"WHERE s.namespace = {ns} AND s.op IN ('read', 'insert', 'update', 'delete') "
        f"AND s.{ORDER} >= ifNull(c.after, 0) AND (s.lsn IS NULL OR s.lsn >= {since})"
    )
    version = f"{base} + l._hw_last" if rank else str(base)
    if not t.key:
        values = ", ".join(
            typed(f"JSONExtractRaw(data, {lit(c.name)})", c.source_type) for c in t.columns
        )
        return (
            f"SELECT {values}, {base} + _hw_rank, 0 FROM ({mine}) m "
            f"WHERE op IN ('read', 'insert') ORDER BY _hw_rank"
        )
    picks = ["argMax(op, _hw_rank) AS op", "max(_hw_rank) AS _hw_last"]
    for c in t.columns:
        carried = (
            f"data IS NOT NULL AND NOT has(JSONExtract(ifNull(unchanged, '[]'), "
            f"'Array(String)'), {lit(c.name)})"
        )
        picks.append(
            f"argMaxIf(JSONExtractRaw(data, {lit(c.name)}), _hw_rank, {carried}) AS {q(c.name)}"
        )
        picks.append(f"countIf({carried}) > 0 AS {q('set:' + c.name)}")
    last = f"SELECT key, {', '.join(picks)} FROM ({mine}) m GROUP BY key"
    key_of = {
        k.name: typed(f"JSONExtractRaw(l.key, {lit(k.name)})", k.source_type)
        for k in t.columns
        if k.key
    }
    values = []
    for c in t.columns:
        if c.key:
            values.append(f"{key_of[c.name]} AS {q(c.name)}")
        else:
            new = typed(f"l.{q(c.name)}", c.source_type)
            values.append(f"if(l.{q('set:' + c.name)}, {new}, t.{q(c.name)}) AS {q(c.name)}")
    match = " AND ".join(f"t.{q(k)} = {key_of[k]}" for k in t.key)
    return (
        f"SELECT {', '.join(values)}, {version} AS {VERSION}, "
        f"toUInt8(l.op = 'delete') AS {DELETED} FROM ({last}) l "
        f"LEFT JOIN (SELECT * FROM {ref} FINAL) t ON {match}"
    )


def insert_columns(t: MirrorTable) -> Sequence[str]:
    return [*(c.name for c in t.columns), VERSION, DELETED]
