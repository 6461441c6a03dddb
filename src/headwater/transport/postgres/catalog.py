"""What the PostgreSQL reader asks the source's catalog: which tables to capture, the
publication that names them, each table's columns, SQL types and key, and how to convert a type
OID's text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from headwater.transport.postgres.values import Convert, array, scalar

SESSION_OPTIONS = "-c DateStyle=ISO -c TimeZone=UTC -c bytea_output=hex -c extra_float_digits=3"


class SourceError(RuntimeError):
    """The source database refused, or lacks something the reader needs."""


@dataclass(frozen=True)
class TableColumn:
    name: str
    type_oid: int
    sql_type: str  # format_type(): numeric(12,2), timestamp with time zone, integer[]
    key: bool


@dataclass(frozen=True)
class Table:
    schema: str
    name: str
    columns: tuple[TableColumn, ...]

    @property
    def qualified(self) -> str:
        return f"{quote(self.schema)}.{quote(self.name)}"


def quote(ident: str) -> str:
    return '"' + ident.replace('"', '""') + '"'


def connect(dsn: str, replication: bool = False) -> Any:
    """A psycopg2 connection with the session settings values.py relies on."""
    import psycopg2
    import psycopg2.extras

    factory = psycopg2.extras.LogicalReplicationConnection if replication else None
    try:
        conn = psycopg2.connect(dsn, connection_factory=factory, options=SESSION_OPTIONS)
    except psycopg2.Error as e:
        raise SourceError(f"cannot connect to the source database: {e}".strip()) from None
    if not replication:
        conn.autocommit = True
    return conn


def resolve_tables(conn: Any, tables: list[str] | str) -> list[tuple[str, str]]:
    """``(schema, table)`` of every table to capture, sorted. Named tables must exist."""
    with conn.cursor() as cur:
        cur.execute(
            "select table_schema, table_name from information_schema.tables "
            "where table_type = 'BASE TABLE' "
            "and table_schema not in ('pg_catalog', 'information_schema')"
        )
        existing = sorted(cur.fetchall())
    if isinstance(tables, str):
        pattern = re.compile(tables)
        return [(s, t) for s, t in existing if pattern.fullmatch(f"{s}.{t}")]
    found = set(existing)
    out = []
    for name in tables:
        schema, _, table = name.rpartition(".")
        pair = (schema or "public", table)
        if pair not in found:
            raise SourceError(f"table {name!r} does not exist in the source database")
        out.append(pair)
    return sorted(set(out))


def database(conn: Any) -> str:
    with conn.cursor() as cur:
        cur.execute("select current_database()")
        return str(cur.fetchone()[0])


def ensure_publication(conn: Any, name: str, tables: list[tuple[str, str]]) -> None:
    """Make publication ``name`` publish exactly ``tables`` (made when missing)."""
    listed = ", ".join(f"{quote(s)}.{quote(t)}" for s, t in tables)
    with conn.cursor() as cur:
        cur.execute(
            "select schemaname, tablename from pg_publication_tables where pubname = %s", (name,)
        )
        current = sorted(cur.fetchall())
        cur.execute("select 1 from pg_publication where pubname = %s", (name,))
        exists = cur.fetchone() is not None
        if not exists:
            cur.execute(f"create publication {quote(name)} for table {listed}")
        elif current != sorted(tables):
            cur.execute(f"alter publication {quote(name)} set table {listed}")


def table(conn: Any, schema: str, name: str) -> Table:
    """A table's columns in order, with their SQL types and whether each is in the key
    (the replica identity index, else the primary key)."""
    with conn.cursor() as cur:
        cur.execute(
            """
            select a.attname, a.atttypid, format_type(a.atttypid, a.atttypmod),
                   coalesce(a.attnum = any(i.indkey), false)
            from pg_attribute a
            join pg_class c on c.oid = a.attrelid
            join pg_namespace n on n.oid = c.relnamespace
            left join lateral (
                select indkey from pg_index
                where indrelid = c.oid and (indisreplident or indisprimary)
                order by indisreplident desc limit 1
            ) i on true
            where n.nspname = %s and c.relname = %s and a.attnum > 0 and not a.attisdropped
            order by a.attnum
            """,
            (schema, name),
        )
        rows = cur.fetchall()
    if not rows:
        raise SourceError(f"table {schema}.{name} does not exist in the source database")
    return Table(schema, name, tuple(TableColumn(n, o, t, bool(k)) for n, o, t, k in rows))


class Types:
    """SQL type names and converters by type OID, asked of the catalog once each."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._names: dict[tuple[int, int], str] = {}
        self._converters: dict[int, Convert | None] = {}

    def sql_type(self, type_oid: int, modifier: int) -> str:
        name = self._names.get((type_oid, modifier))
        if name is None:
            with self._conn.cursor() as cur:
                cur.execute("select format_type(%s, %s)", (type_oid, modifier))
                name = str(cur.fetchone()[0])
            self._names[(type_oid, modifier)] = name
        return name

    def converter(self, type_oid: int) -> Convert | None:
        if type_oid in self._converters:
            return self._converters[type_oid]
        convert = scalar(type_oid)
        if convert is None:
            with self._conn.cursor() as cur:
                cur.execute(
                    "select typelem, typcategory, typdelim from pg_type where oid = %s",
                    (type_oid,),
                )
                row = cur.fetchone()
            if row is not None and row[1] == "A" and row[0]:
                convert = array(self.converter(int(row[0])), str(row[2]))
        self._converters[type_oid] = convert
        return convert
