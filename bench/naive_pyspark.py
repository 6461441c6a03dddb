"""Reference 1 of bench/pipeline.py: the naive PySpark load, in its own process.

What a data engineer writes first to get JSON events into DuckDB with Spark: ``spark.read.json``
with schema inference (one pass over the file to infer, a second to parse), nested structs
flattened to ``parent_child`` columns, the frame collected with ``toArrow()``, and DuckDB's
``CREATE TABLE AS`` over the Arrow table. It runs in its own process so that its JVM, its
memory and its compiled code are its own; a run on ``--warmup`` small sample comes first, so the
timed run is not paying for the JVM's warm-up (as headwater's is not). Prints one JSON object::

    .venv/bin/python bench/naive_pyspark.py --input events.ndjson --warmup sample.ndjson \
        --database out.duckdb
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _common import TreeRss, progress


def flat_columns(schema: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(path, column name) of every leaf of ``schema``; structs are opened, arrays kept whole."""
    from pyspark.sql.types import StructType

    out: list[tuple[tuple[str, ...], str]] = []
    for field in schema.fields:
        path = (*prefix, field.name)
        if isinstance(field.dataType, StructType):
            out.extend(flat_columns(field.dataType, path))
        else:
            out.append((path, "_".join(path)))
    return out


def load(spark: Any, source: Path, database: Path) -> tuple[int, int]:
    """Read, flatten, collect and load ``source``; (rows, columns) of the table made."""
    import duckdb
    from pyspark.sql import functions as F

    frame = spark.read.json(str(source))
    columns = [
        F.col("`" + "`.`".join(path) + "`").alias(name) for path, name in flat_columns(frame.schema)
    ]
    events = frame.select(*columns).toArrow()
    with duckdb.connect(str(database)) as con:
        con.execute("drop table if exists events")
        con.register("events_arrow", events)
        con.execute("create table events as select * from events_arrow")
        rows = con.execute("select count(*) from events").fetchone()[0]  # type: ignore[index]
        width = len(con.execute("describe events").fetchall())
    return rows, width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, required=True, help="NDJSON events, one a line")
    parser.add_argument("--warmup", type=Path, required=True, help="a small NDJSON sample")
    parser.add_argument("--database", type=Path, required=True, help="the DuckDB file to make")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--driver-memory",
        default="4g",
        help="enough for the script's toArrow() of 1M events through the driver",
    )
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    progress(f"naive PySpark: starting Spark ({args.master})")
    spark = (
        SparkSession.builder.master(args.master)
        .appName("naive-pyspark")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        progress("naive PySpark: warm-up on the sample")
        load(spark, args.warmup, args.database)
        progress("naive PySpark: the timed run")
        with TreeRss() as rss:
            t0 = time.perf_counter()
            rows, width = load(spark, args.input, args.database)
            seconds = time.perf_counter() - t0
    finally:
        spark.stop()
    json.dump(
        {
            "events": rows,
            "seconds": seconds,
            "events_per_s": rows / seconds,
            "peak_rss_bytes": rss.peak,
            "peak_pss_bytes": rss.peak_pss,
            "rows": rows,
            "columns": width,
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
