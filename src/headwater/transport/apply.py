"""``apply: upsert``: a batch of transport changes applied to a SQL table so that it ends equal
to the source table.

The changes of a micro-batch are staged as rows of ``CHANGES`` (one per message: namespace, op,
key and data as JSON text, the columns left unchanged, the log partition and offset). For each
namespace the apply runs, in the transaction that records the batch:

1. a ``truncate`` in the batch deletes every row of the table, and only the changes after it
   (per partition: a truncate is on every partition) are applied;
2. per key, the last change decides: ``delete`` deletes the row; ``read``/``insert``/``update``
   write it (an upsert on the key). Each column's value is the one of the last change that
   carried it: a column an update left unchanged (a TOASTed value PostgreSQL did not send) keeps
   the value of an earlier change in the batch, else the table's own (it is never set to NULL);
3. a table without a key only appends its inserts.

Values come as JSON text (see ``headwater.transport.postgres.values``) and are typed again by
the source column's SQL type: the dialect names the target type and the cast.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from headwater.errors import HeadwaterError, TransientError

if TYPE_CHECKING:
    from headwater.destinations.base import StagedPart

ORDER = "_hw_order"
CHANGES = pa.schema(
    [
        ("namespace", pa.string()),
        ("op", pa.string()),
        ("key", pa.string()),
        ("data", pa.string()),
        ("unchanged", pa.string()),
        ("topic", pa.string()),
        ("part", pa.int64()),
        (ORDER, pa.int64()),
        ("lsn", pa.int64()),  # the source's position, where it is ordered (PostgreSQL LSNs)
    ]
)
TRUNCATES = "_headwater_truncates"  # per writer and namespace: the last truncate applied
TRUNCATES_SQL = (
    f"CREATE TABLE IF NOT EXISTS {TRUNCATES} (writer_id text, namespace text, lsn bigint, "
    "PRIMARY KEY (writer_id, namespace))"
)
OFFSETS = "_headwater_offsets"  # per mirror writer, topic and partition: the next offset
OFFSETS_SQL = (
    f"CREATE TABLE IF NOT EXISTS {OFFSETS} (writer_id text, topic text, part bigint, "
    "next_offset bigint, PRIMARY KEY (writer_id, topic, part))"
)
CHANGES_TABLE = "_hw_changes"  # the staged table's name (a StagedPart's table)
ROW_OPS = ("read", "insert", "update")


@dataclass(frozen=True)
class MirrorColumn:
    name: str
    source_type: str  # the source's SQL type, as PostgreSQL's format_type() writes it
    key: bool = False


@dataclass(frozen=True)
class MirrorTable:
    namespace: str
    name: str  # the target table
    columns: tuple[MirrorColumn, ...]

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)

    @classmethod
    def from_schema(cls, namespace: str, name: str, columns: list[dict[str, Any]]) -> MirrorTable:
        """From a schema message's ``columns``."""
        return cls(
            namespace,
            name,
            tuple(MirrorColumn(str(c["name"]), str(c["type"]), bool(c["key"])) for c in columns),
        )


class MirrorDestination(Protocol):
    """What a destination does for ``apply: upsert`` (DuckDB and PostgreSQL through
    ``SqlDestination``; ClickHouse on its own)."""

    def committed(self, writer_id: str) -> int | None: ...

    def ensure_mirror(self, table: MirrorTable) -> Any: ...

    def apply_changes(
        self,
        writer_id: str,
        batch_id: int | None,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> bool: ...

    def apply_isolated(
        self,
        writer_id: str,
        batch_id: int,
        parts: Sequence[StagedPart],
        tables: Sequence[MirrorTable],
        offsets: Mapping[tuple[str, int], int] | None = None,
    ) -> list[dict[str, Any]]: ...

    def writer_offsets(self, writer_id: str) -> dict[tuple[str, int], int]: ...

    def mark_offsets(self, writer_id: str, offsets: Mapping[tuple[str, int], int]) -> None: ...

    def stage(
        self, writer_id: str, batch_id: int, task: str, tables: Mapping[str, pa.Table]
    ) -> list[StagedPart]: ...

    def discard_staged(
        self, writer_id: str, batch_id: int, parts: Sequence[StagedPart]
    ) -> None: ...

    def clean_staging(self, writer_id: str) -> None: ...

    def close(self) -> None: ...


def isolate(
    n: int,
    apply: Callable[[int, int], None],
    where: Callable[[int], tuple[str, int, int]],
    classify: Callable[[Exception], HeadwaterError],
) -> list[dict[str, Any]]:
    """``on_error: isolate``: apply changes 1..n in order by groups (``apply(first, last)``,
    each on its own), a failing group split in halves until each bad change is alone. Returns
    the bad changes (``topic``, ``part``, ``offset`` from ``where(i)``, ``code``, ``reason``);
    a transient error is raised (the batch is tried again later)."""
    failed: list[dict[str, Any]] = []

    def group(first: int, last: int) -> None:
        try:
            apply(first, last)
            return
        except Exception as exc:
            error = exc if isinstance(exc, HeadwaterError) else classify(exc)
            if isinstance(error, TransientError):
                raise error from exc
            if first == last:
                topic, part, offset = where(first)
                failed.append(
                    {
                        "topic": topic,
                        "part": int(part),
                        "offset": int(offset),
                        "code": getattr(error, "code", "HW-DST-001"),
                        "reason": str(exc).strip(),
                    }
                )
                return
        middle = (first + last) // 2
        group(first, middle)
        group(middle + 1, last)

    if n:
        group(1, n)
    return failed


def mirror_of(destination: object) -> MirrorDestination:
    """``destination`` as a mirror destination; a clear error when it cannot be one."""
    if not hasattr(destination, "apply_changes"):
        kind = getattr(destination, "kind", type(destination).__name__)
        raise TypeError(f"{kind} destinations cannot mirror tables (apply: upsert)")
    return destination  # type: ignore[return-value]


def q(ident: str) -> str:
    return '"' + ident.replace('"', '""') + '"'


def lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class ApplySql(ABC):
    """The statements of an apply in one SQL dialect."""

    @abstractmethod
    def target_type(self, source_type: str) -> str:
        """The column type of the mirror for a source column's SQL type."""

    @abstractmethod
    def field(self, json_text: str, name: str) -> str:
        """SQL of a JSON object's member ``name`` as text (JSON text for arrays/objects)."""

    @abstractmethod
    def has(self, json_list: str, name: str) -> str:
        """SQL: true when the JSON list of names ``json_list`` (maybe NULL) holds ``name``."""

    @abstractmethod
    def typed(self, text: str, source_type: str) -> str:
        """SQL of the text value ``text`` as the mirror's type for ``source_type``."""

    def statements(self, source: str, t: MirrorTable, writer_id: str) -> list[str]:
        """Every statement that applies the namespace's changes in ``source`` to table ``t``
        (``truncate_statements``, then ``row_statements`` in one chunk)."""
        return [
            *self.truncate_statements(source, t, writer_id),
            *self.row_statements(source, t, writer_id),
        ]

    def truncate_statements(self, source: str, t: MirrorTable, writer_id: str) -> list[str]:
        """The statements of the namespace's truncates in ``source`` (a table, or a
        parenthesised query, with the ``CHANGES`` columns), for writer ``writer_id``.

        A truncate is on every partition of the topic, and a batch may hold its copy in one
        partition and not yet in another, so it is applied by its LSN: the first time a
        truncate newer than the one recorded (``TRUNCATES``) is seen, the table is emptied and
        its LSN recorded; from then on a change older than it (a late partition's) is skipped
        (``row_statements``). In order: the table is emptied before the record moves."""
        table, ns, writer = q(t.name), lit(t.namespace), lit(writer_id)
        recorded, newest = self._recorded(t, writer_id), self.newest_truncate(source, t)
        return [
            f"DELETE FROM {table} WHERE coalesce({newest}, -1) > coalesce({recorded}, -1)",
            f"DELETE FROM {TRUNCATES} WHERE writer_id = {writer} AND namespace = {ns} "
            f"AND {newest} IS NOT NULL AND lsn < {newest}",
            f"INSERT INTO {TRUNCATES} SELECT {writer}, {ns}, {newest} "
            f"WHERE {newest} IS NOT NULL AND coalesce({recorded}, -1) < {newest}",
        ]

    def changed(
        self, source: str, t: MirrorTable, writer_id: str, chunk: tuple[int, int] = (0, 1)
    ) -> str:
        """SQL of the namespace's row changes in ``source`` that apply: those after the batch's
        truncate in their partition, and none older than the truncate recorded or newest (a
        late partition's). ``chunk`` (i, n): only the keys of part i of n."""
        ns = lit(t.namespace)
        cut = (
            f"SELECT part, max({ORDER}) AS cut FROM {source} x "
            f"WHERE namespace = {ns} AND op = 'truncate' GROUP BY part"
        )
        since = (
            f"greatest(coalesce({self._recorded(t, writer_id)}, -1), "
            f"coalesce({self.newest_truncate(source, t)}, -1))"
        )
        mine = (
            f"SELECT s.* FROM {source} s LEFT JOIN ({cut}) c ON c.part = s.part "
            f"WHERE s.namespace = {ns} AND s.op IN ('read', 'insert', 'update', 'delete') "
            f"AND (c.cut IS NULL OR s.{ORDER} > c.cut) AND (s.lsn IS NULL OR s.lsn >= {since})"
        )
        if chunk[1] > 1:
            mine += f" AND {self.bucket('s.key', chunk[1])} = {chunk[0]}"
        return mine

    def row_statements(
        self,
        source: str,
        t: MirrorTable,
        writer_id: str,
        chunk: tuple[int, int] = (0, 1),
    ) -> list[str]:
        """The statements of the namespace's row changes, after ``truncate_statements``: per
        key the last change wins. ``chunk`` (i, n): only the keys of part i of n (a key's
        changes are all in one part, so the parts may run one after the other)."""
        table = q(t.name)
        mine = self.changed(source, t, writer_id, chunk)
        names = ", ".join(q(c.name) for c in t.columns)
        if not t.key:
            return [
                f"INSERT INTO {table} ({names}) SELECT {self.inserted(t)} FROM ({mine}) m "
                f"WHERE op IN ('read', 'insert') ORDER BY part, {ORDER}"
            ]
        last = self.last_per_key(mine, t)
        key_match = " AND ".join(f"t.{q(k)} = {self.typed_key(t, k)}" for k in t.key)
        values = ", ".join(
            f"CASE WHEN l.{q('set:' + c.name)} THEN {self.typed(f'l.{q(c.name)}', c.source_type)}"
            f" ELSE t.{q(c.name)} END"
            for c in t.columns
        )
        keys = ", ".join(q(k) for k in t.key)
        updates = ", ".join(f"{q(c.name)} = excluded.{q(c.name)}" for c in t.columns if not c.key)
        conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
        return [
            f"DELETE FROM {table} t WHERE EXISTS (SELECT 1 FROM ({last}) l "
            f"WHERE l.op = 'delete' AND {key_match})",
            f"INSERT INTO {table} ({names}) SELECT {values} FROM ({last}) l "
            f"LEFT JOIN {table} t ON {key_match} WHERE l.op <> 'delete' "
            f"ON CONFLICT ({keys}) {conflict}",
        ]

    def inserted(self, t: MirrorTable) -> str:
        """SQL of a change's values (``data``), typed: what a keyless table appends."""
        return ", ".join(self.typed(self.field("data", c.name), c.source_type) for c in t.columns)

    def typed_key(self, t: MirrorTable, name: str) -> str:
        """SQL of key column ``name``'s value, from ``last_per_key``'s row ``l``."""
        return self.typed(self.field("l.key", name), self._type(t, name))

    def _recorded(self, t: MirrorTable, writer_id: str) -> str:
        return (
            f"(SELECT max(lsn) FROM {TRUNCATES} WHERE writer_id = {lit(writer_id)} "
            f"AND namespace = {lit(t.namespace)})"
        )

    def newest_truncate(self, source: str, t: MirrorTable) -> str:
        """SQL: the LSN of the namespace's newest truncate in ``source`` (NULL: none)."""
        return (
            f"(SELECT max(lsn) FROM {source} x "
            f"WHERE namespace = {lit(t.namespace)} AND op = 'truncate')"
        )

    @abstractmethod
    def bucket(self, text: str, n: int) -> str:
        """SQL: a number in [0, n) from the text ``text``, the same for the same text."""

    def _type(self, t: MirrorTable, name: str) -> str:
        return next(c.source_type for c in t.columns if c.name == name)

    def last(self, value: str, where: str | None = None) -> str:
        """SQL aggregate: ``value`` of the group's row with the highest order (among those
        ``where`` holds), NULL values included."""
        only = f" FILTER (WHERE {where})" if where else ""
        return f"(array_agg({value} ORDER BY {ORDER} DESC){only})[1]"

    def last_per_key(self, mine: str, t: MirrorTable) -> str:
        """Per key: the last op, each column's last value carried (``"<column>"``) and whether
        one was (``"set:<column>"``)."""
        picks = [f"{self.last('op')} AS op"]
        for c in t.columns:
            carried = f"data IS NOT NULL AND NOT coalesce({self.has('unchanged', c.name)}, false)"
            picks.append(f"{self.last(self.field('data', c.name), carried)} AS {q(c.name)}")
            picks.append(f"count(*) FILTER (WHERE {carried}) > 0 AS {q('set:' + c.name)}")
        return f"SELECT key, {', '.join(picks)} FROM ({mine}) m GROUP BY key"


_DUCK_TYPES = {
    "smallint": "SMALLINT",
    "integer": "INTEGER",
    "bigint": "BIGINT",
    "real": "REAL",
    "double precision": "DOUBLE",
    "boolean": "BOOLEAN",
    "text": "VARCHAR",
    "date": "DATE",
    "timestamp without time zone": "TIMESTAMP",
    "timestamp with time zone": "TIMESTAMPTZ",
    "time without time zone": "TIME",
    "uuid": "UUID",
    "json": "JSON",
    "jsonb": "JSON",
    "bytea": "BLOB",
    "interval": "INTERVAL",
}
PRECISION = re.compile(r"\(\d+\)")  # timestamp(3) with time zone -> its base type
NUMERIC = re.compile(r"numeric\((\d+),(\d+)\)")


class DuckDBApply(ApplySql):
    def target_type(self, source_type: str) -> str:
        if source_type.endswith("[]"):
            return self.target_type(source_type[:-2]) + "[]"
        m = NUMERIC.fullmatch(source_type)
        if m:  # DuckDB's DECIMAL holds 38 digits; wider numbers stay exact as text
            return f"DECIMAL({m[1]},{m[2]})" if int(m[1]) <= 38 else "VARCHAR"
        return _DUCK_TYPES.get(PRECISION.sub("", source_type), "VARCHAR")

    def last(self, value: str, where: str | None = None) -> str:
        # keeps one value per group, where array_agg would hold them all (large TOASTed texts)
        order = f"CASE WHEN {where} THEN {ORDER} END" if where else ORDER
        return f"arg_max_null({value}, {order})"

    def bucket(self, text: str, n: int) -> str:
        return f"hash({text}) % {n}"

    def field(self, json_text: str, name: str) -> str:
        pointer = "/" + name.replace("~", "~0").replace("/", "~1")
        return f"json_extract_string({json_text}, {lit(pointer)})"

    def has(self, json_list: str, name: str) -> str:
        return f"json_contains({json_list}, {lit(_json_string(name))})"

    def typed(self, text: str, source_type: str) -> str:
        target = self.target_type(source_type)
        if target == "BLOB":
            return f"from_base64({text})"
        if target.endswith("[]"):
            return f"CAST(CAST({text} AS JSON) AS {target})"
        return text if target == "VARCHAR" else f"CAST({text} AS {target})"


class PostgresApply(ApplySql):
    """A PostgreSQL mirror keeps the source's types."""

    def target_type(self, source_type: str) -> str:
        return source_type

    def bucket(self, text: str, n: int) -> str:
        return f"abs(hashtext({text}) % {n})"

    def field(self, json_text: str, name: str) -> str:
        return f"(CAST({json_text} AS jsonb) ->> {lit(name)})"

    def has(self, json_list: str, name: str) -> str:
        return f"(CAST({json_list} AS jsonb) ? {lit(name)})"

    def typed(self, text: str, source_type: str) -> str:
        if source_type == "bytea":
            return f"decode({text}, 'base64')"
        if source_type.endswith("[]"):
            element = source_type[:-2]
            elements = f"jsonb_array_elements_text(CAST({text} AS jsonb))"
            return (
                f"CASE WHEN {text} IS NULL THEN NULL ELSE "
                f"CAST(ARRAY(SELECT CAST(e AS {element}) FROM {elements} e) AS {source_type}) END"
            )
        return f"CAST({text} AS {source_type})"


def _json_string(text: str) -> str:
    import json

    return json.dumps(text)
