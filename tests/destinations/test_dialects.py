"""Golden tests of every dialect: types, name normalisation and DDL, compared with SQL written
out here by hand."""

from __future__ import annotations

import pytest

from headwater.destinations.bigquery.dialect import BigQueryDialect
from headwater.destinations.clickhouse.dialect import ClickHouseDialect
from headwater.destinations.dialect import Dialect
from headwater.destinations.duckdb.dialect import DuckDBDialect
from headwater.destinations.postgres.dialect import PostgresDialect
from headwater.destinations.redshift.dialect import RedshiftDialect
from headwater.destinations.snowflake.dialect import SnowflakeDialect
from headwater.destinations.types import ColumnType as T

NAMES = [
    "User Name",
    "utm-source",
    "2fa",
    "Ünïcode",
    'quo"te',
    "a" * 400,
    "CamelCase",
    "page.url",
    "",
    "select",
]
COMMON = ["user_name", "utm_source", "_2fa", "_n_code", "quo_te"]

GOLDEN = {
    "postgres": {
        "dialect": PostgresDialect(),
        "types": ["boolean", "bigint", "numeric", "timestamptz", "text"],
        "catalog": {
            "timestamp with time zone": T.TIMESTAMP,
            "numeric(38,18)": T.FLOAT64,
            "double precision": T.FLOAT64,
            "character varying": T.STRING,
            "integer": None,
        },
        "names": [*COMMON, "a" * 63, "camelcase", "page_url", "_", "select"],
        "create": 'CREATE TABLE IF NOT EXISTS "events" ("id" bigint, "v" text, PRIMARY KEY ("id"))',
        "add": 'ALTER TABLE "events" ADD COLUMN IF NOT EXISTS "new col" boolean',
    },
    "redshift": {
        "dialect": RedshiftDialect(),
        "types": [
            "boolean",
            "bigint",
            "double precision",
            "timestamptz",
            "character varying(65535)",
        ],
        "catalog": {
            "timestamp with time zone": T.TIMESTAMP,
            "numeric(38,18)": T.FLOAT64,
            "character varying": T.STRING,
        },
        "names": [*COMMON, "a" * 127, "camelcase", "page_url", "_", "select"],
        "create": 'CREATE TABLE IF NOT EXISTS "events" ("id" bigint, "v" character varying(65535),'
        ' PRIMARY KEY ("id"))',
        "add": 'ALTER TABLE "events" ADD COLUMN "new col" boolean',
    },
    "snowflake": {
        "dialect": SnowflakeDialect(),
        "types": ["boolean", "bigint", "float", "timestamp_tz", "text"],
        "catalog": {"NUMBER(38,0)": T.INT64, "TIMESTAMP_TZ": T.TIMESTAMP, "VARIANT": None},
        "names": [
            *(n.upper() for n in COMMON),
            "A" * 255,
            "CAMELCASE",
            "PAGE_URL",
            "_",
            "SELECT",
        ],
        "create": 'CREATE TABLE IF NOT EXISTS "events" ("id" bigint, "v" text, PRIMARY KEY ("id"))',
        "add": 'ALTER TABLE "events" ADD COLUMN IF NOT EXISTS "new col" boolean',
    },
    "bigquery": {
        "dialect": BigQueryDialect(),
        "types": ["BOOL", "INT64", "FLOAT64", "TIMESTAMP", "STRING"],
        "names": [
            "User_Name",
            *COMMON[1:],
            "a" * 300,
            "CamelCase",
            "page_url",
            "_",
            "select",
        ],
        "create": "CREATE TABLE IF NOT EXISTS `events` (`id` INT64, `v` STRING)",
        "add": "ALTER TABLE `events` ADD COLUMN IF NOT EXISTS `new col` BOOL",
    },
    "clickhouse": {
        "dialect": ClickHouseDialect(),
        "types": [
            "Nullable(UInt8)",
            "Nullable(Int64)",
            "Nullable(Float64)",
            "Nullable(DateTime64(6, 'UTC'))",
            "Nullable(String)",
        ],
        "catalog": {
            "DateTime64(6, 'UTC')": T.TIMESTAMP,
            "Nullable(Int64)": T.INT64,
            "Bool": T.BOOL,
            "LowCardinality(String)": None,
        },
        "names": [*COMMON, "a" * 255, "camelcase", "page_url", "_", "select"],
        "create": "CREATE TABLE IF NOT EXISTS `events` (`id` Int64, `v` Nullable(String)) "
        "ENGINE = ReplacingMergeTree ORDER BY (`id`) "
        "SETTINGS non_replicated_deduplication_window = 10000",
        "add": "ALTER TABLE `events` ADD COLUMN IF NOT EXISTS `new col` Nullable(UInt8)",
    },
    "duckdb": {
        "dialect": DuckDBDialect(),
        "types": ["BOOLEAN", "BIGINT", "DOUBLE", "TIMESTAMPTZ", "VARCHAR"],
        "catalog": {"TIMESTAMP WITH TIME ZONE": T.TIMESTAMP, "INTEGER": None},
        "names": [*COMMON, "a" * 255, "camelcase", "page_url", "_", "select"],
        "create": 'CREATE TABLE IF NOT EXISTS "events" ("id" BIGINT, "v" VARCHAR, '
        'PRIMARY KEY ("id"))',
        "add": 'ALTER TABLE "events" ADD COLUMN IF NOT EXISTS "new col" BOOLEAN',
    },
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_dialect_golden(name: str) -> None:
    g = GOLDEN[name]
    d: Dialect = g["dialect"]  # type: ignore[assignment]
    assert [d.sql_type(t) for t in T] == g["types"]
    assert [d.normalize(n) for n in NAMES] == g["names"]
    # every SQL type reads back as the type it came from
    assert [d.column_type(d.sql_type(t)) for t in T] == list(T)
    # and so do the spellings the warehouse's catalog reports (None: not one of ours)
    for sql, expected in g.get("catalog", {}).items():  # type: ignore[attr-defined]
        assert d.column_type(sql) == expected, sql
    cols = [
        ("id", d.types[T.INT64] if name == "clickhouse" else d.sql_type(T.INT64)),
        ("v", d.sql_type(T.STRING)),
    ]
    assert d.create_table_sql("events", cols, ("id",)) == g["create"]
    assert d.add_column_sql("events", "new col", d.sql_type(T.BOOL)) == g["add"]


def test_quoting_escapes_the_quote_character() -> None:
    assert PostgresDialect().quote('a"b') == '"a""b"'
    assert BigQueryDialect().quote("a`b") == "`a\\`b`"
    assert ClickHouseDialect().quote("a`b") == "`a``b`"
