"""The executors' write path (``format("headwater_sink")``, issue 8) against Spark's own Parquet
writer, on one Spark frame of ``--rows`` rows x 25 typed columns (5 each of boolean, bigint,
double, timestamp, string), ``local[2]``, 4 partitions:

- reference: ``frame.write.parquet(...)`` (Spark's writer, no commit to a warehouse);
- DuckDB: tasks stage Parquet through the sink, the driver loads them with the ledger row;
- PostgreSQL (a throwaway local server): tasks COPY into UNLOGGED staging tables, the driver
  moves them with ``INSERT ... SELECT`` and the ledger row.

Each path runs once on 20,000 rows first (Spark compiles, workers start), then is timed; the
figures are rows/s for the whole write (stage + commit) and the ratio to the reference.

    .venv/bin/python bench/sink.py --rows 1000000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import fmt_number, print_table, progress
from headwater.config.model import HeadwaterConfig
from headwater.destinations import Column, TableSchema, open_destination
from headwater.destinations.types import ColumnType as T
from headwater.pipeline import sink
from headwater.pipeline.config import SparkConfig
from headwater.pipeline.spark import spark_session

KINDS = {"b": T.BOOL, "i": T.INT64, "d": T.FLOAT64, "t": T.TIMESTAMP, "s": T.STRING}
COLUMNS = {f"{k}{n}": t for k, t in KINDS.items() for n in range(5)}
PARTITIONS = 4
WARM_UP_ROWS = 20_000


def make_frame(spark: Any, rows: int) -> Any:
    from pyspark.sql import functions as F

    i = F.col("id")
    cols = [F.lit("events").alias("_hw_table"), i.alias("_hw_order")]
    for name in COLUMNS:
        n = int(name[1:]) + 1
        expr = {
            "b": (i % (n + 1)) == 0,
            "i": i * n + 7,
            "d": i / (n + 0.5),
            "t": F.timestamp_seconds(i + 1_700_000_000 + n),
            "s": F.concat(F.lit(f"value-{n}-"), (i * n).cast("string")),
        }[name[0]]
        cols.append(expr.alias(name))
    return spark.range(0, rows, 1, PARTITIONS).select(*cols)


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hw-bench-sink-"))
    spark = spark_session(SparkConfig(master="local[2]"), app_name="bench-sink")
    sink.register(spark)
    results: list[tuple[str, float, dict[str, float]]] = []
    pg_context = None
    try:
        dests: list[dict[str, Any]] = [
            {"id": "duck", "type": "duckdb", "path": str(work / "warehouse.duckdb")}
        ]
        if not args.skip_postgres:
            from headwater.testing.postgres import start_postgres

            pg_context = start_postgres()
            pg = pg_context.__enter__()
            dests.append({"id": "pg", "type": "postgres", "dsn": pg.dsn})
        config = HeadwaterConfig.model_validate(
            {"data_dir": str(work / "data"), "pipeline": {"destinations": dests}}
        )

        def parquet(rows: int) -> Callable[[], None]:
            out = work / f"parquet-{rows}"
            return lambda: make_frame(spark, rows).write.mode("overwrite").parquet(str(out))

        for rows in (WARM_UP_ROWS, args.rows):
            progress(f"parquet reference, {rows} rows")
            seconds = timed(parquet(rows))
            if rows == args.rows:
                results.append(("Spark's Parquet writer (reference)", seconds, {}))

        for dest in config.pipeline.destinations:
            d = open_destination(dest, config.data_dir)
            schema = TableSchema("events", {n: Column(n, t) for n, t in COLUMNS.items()})
            schemas = {"events": d.ensure_table(schema)}
            d.clean_staging(dest.id)
            for batch_id, rows in enumerate((WARM_UP_ROWS, args.rows)):
                progress(f"{dest.type} through the sink, {rows} rows")
                started = time.perf_counter()
                parts = sink.stage_frame(
                    make_frame(spark, rows), config, dest, batch_id, {"events": list(COLUMNS)}
                )
                staged = time.perf_counter()
                assert d.commit_staged(dest.id, batch_id, parts, schemas)
                done = time.perf_counter()
                if rows == args.rows:
                    phases = {"stage": staged - started, "commit": done - staged}
                    results.append((f"sink -> {dest.type}", done - started, phases))
            d.close()
    finally:
        if pg_context is not None:
            pg_context.__exit__(None, None, None)
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    reference = results[0][1]
    table = [
        (
            name,
            fmt_number(args.rows / seconds),
            f"{seconds:.2f}",
            ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()) or "-",
            f"{reference / seconds:.2f}",
        )
        for name, seconds, phases in results
    ]
    print(
        f"{args.rows:,} rows x {len(COLUMNS)} columns, local[2], {PARTITIONS} partitions\n"
        + print_table(["path", "rows/s", "seconds", "phases", "x reference"], table)
    )


if __name__ == "__main__":
    main()
