"""Benchmark of the pipeline: clickstream events on the embedded log into DuckDB, PostgreSQL and
Delta Lake.

Run from the repository root::

    .venv/bin/python bench/pipeline.py                          # 1M events; tens of minutes
    .venv/bin/python bench/pipeline.py --events 20000 --skip-stream --skip-postgres   # quick
    .venv/bin/python bench/pipeline.py --skip-batch --stream-seconds 60   # stream only
    .venv/bin/python bench/pipeline.py --format json
    .venv/bin/python bench/pipeline.py --bus kafka              # the batch case from Kafka too
    .venv/bin/python bench/pipeline.py --bus kafka --events 20000   # quick
    .venv/bin/python bench/pipeline.py --events 20000 --warmup-events 10000 --skip-postgres \
        --skip-small-batches --skip-shaped --skip-fixed --skip-stream   # quick, Delta included
    .venv/bin/python bench/pipeline.py --skip-batch --skip-fixed --stream-seconds 30   # streams
    .venv/bin/python bench/pipeline.py --skip-batch --skip-fixed --skip-duckdb-stream  # Delta's

What it measures, in one run, on the same ``--events`` clickstream events (nested, 20-40
fields, some type drift) appended once to an embedded log (topic ``events-track``, 2
partitions, the collector's context headers), Spark ``local[2]`` (issue 8):

1. **Batch mode, DuckDB and PostgreSQL** (a throwaway server, ``headwater.testing.postgres``):
   each destination's query with ``Trigger.AvailableNow`` in-process after a warm-up run.
   Figures: events/s, the peak RSS of the process tree (driver, JVM, Python workers), the rows
   and columns landed, checked exactly once. DuckDB again in micro-batches of a quarter of the
   events (``max_records_per_trigger``): the peak RSS must not grow with the batch size.
2. **Reference 1: naive PySpark** (``bench/naive_pyspark.py``) in its own process on the same
   events' JSON (an NDJSON file): ``spark.read.json`` with inference, structs flattened,
   ``toArrow()``, DuckDB ``CREATE TABLE AS``; timed there after a warm-up on a sample, with its
   own peak RSS. Ratio headwater / naive.
3. **Fixed cost.** ``headwater pipeline --once`` as the CLI in a subprocess on a fresh data
   dir holding ``--fixed-events`` events: wall time, JVM start included.
4. **Stream mode.** The DuckDB destination in ``mode: stream`` (trigger every ``--trigger-s``)
   while this script appends events at a steady rate; a poller finds each measured event's row
   and records append time -> row visible. First ``--rate`` (5k/s): ``--stream-warmup-s`` of load
   (Spark compiles the query's code in its first micro-batches; not the steady state), then
   ``--stream-seconds`` measured: p50/p95/p99. Then the rate doubles (``--ladder-warmup-s`` +
   ``--ladder-seconds`` each) until p95 reaches ``--p95-limit-s`` or the rate cannot be
   sustained (events not all visible within ``--drain-s`` after the window, or the appender
   falling behind), up to ``--max-rate`` and within ``--ladder-budget-s``: the highest steady
   rate with p95 under the limit.
5. **Delta Lake** (unless ``--skip-delta``), on the same events:

   a. headwater's ``type: delta`` destination (tables under ``<scratch>/batch/lake``, written
      by delta-rs) in batch mode as in 1, warmed up with the others. Figures: events/s, peak
      RSS, rows, distinct event ids and table versions, read back through delta-rs
      (``QueryBuilder``). Targets: >= 0.8x the DuckDB destination's
      events/s in the same run, >= 1.0x reference 2, peak RSS <= 2.2 GB, exactly once.
   b. **Reference 2: naive PySpark into Delta**, in its own process like reference 1 (a child
      of this script, ``naive_delta_main``): ``spark.read.json``, structs flattened as there,
      ``df.write.format("delta").mode("append").save(path)`` with Delta Lake for Spark on the
      session (``headwater.jvm.maven.DELTA_SPARK``, fetched with mvn the first time), timed
      after a warm-up on the sample, with its own peak RSS; its rows and distinct
      ``messageId``s read back through delta-rs.
   c. Stream mode into Delta at ``--rate`` (``--stream-warmup-s`` then ``--stream-seconds``,
      no ladder): append time -> the row in a committed table version, found by a poller that
      reads the files each new version adds. Target: p95 <= 5 s, every event seen.

Each target of issue 8 is printed next to its figure, met or missed, with the command run.

``--bus kafka`` (default ``embedded``) measures only the batch DuckDB case, read from one
Apache Kafka broker (``headwater.testing.kafka``, KRaft on loopback, JVM ``_common.KAFKA_JVM``)
through Spark's Kafka connector and, in the same run, from the embedded log: the same events on
both (topic ``events-track``, 2 partitions, the same headers), each path warmed up first (on
Kafka from its own topic, ``events-warmup``). Figures: each run's events/s, peak RSS (the
broker, a child of this process, left out; its own VmHWM printed apart) and rows landed, and
the ratio Kafka / embedded log against its target (within 20%: >= 0.8x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import (
    TreeRss,
    arguments,
    bench_directory,
    broker_figures,
    emit_json,
    fmt_number,
    kafka_broker,
    percentile,
    print_table,
    progress,
    run_facts,
)
from headwater.bus import Message, open_bus
from headwater.bus import context as ctx
from headwater.config.model import HeadwaterConfig
from headwater.testing.postgres import start_postgres

if TYPE_CHECKING:
    from headwater.testing.kafka import KafkaCluster

TOPIC = "events-track"
WARMUP_TOPIC = "events-warmup"  # --bus kafka: the warm-up's topic on the broker the runs share
KAFKA_TARGET = 0.8  # --bus kafka: events/s from Kafka within 20% of the embedded log's
DELTA_TARGET = 0.8  # batch -> Delta: events/s against the DuckDB destination's in the same run
DELTA_NAIVE_TARGET = 1.0  # batch -> Delta: events/s against reference 2 (naive Spark -> Delta)
DELTA_RSS_GB = 2.2
DELTA_P95_S = 5.0  # stream -> Delta at --rate: receive -> committed version
TABLE = "events"  # the table every destination here writes (the default table_name_template)
NAIVE_ID = "messageId"  # reference 2's event id: the payload's own, as it flattens it
REPO = Path(__file__).resolve().parent.parent
ID_COLUMN = "eventn_ctx_event_id"  # the collector's event id header, as the pipeline lands it
# new rows since the last poll (rows are only appended, so rowids grow; a rowid filter is cheap)
POLL_SQL = f"select rowid, {ID_COLUMN} from events where rowid > ?"
WARMUP_EVENTS = 100_000
PAGES = ["/", "/pricing", "/docs", "/blog/launch", "/signup", "/checkout", "/account"]
EVENTS = ["Page Viewed", "Product Clicked", "Added To Cart", "Checkout Started", "Signed Up"]
BROWSERS = [
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/126.0 Safari/537.36",
    "Mozilla/5.0 (iPhone; CPU iPhone OS 17_5 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like "
    "Gecko) Version/17.5 Mobile/15E148 Safari/604.1",
    "Mozilla/5.0 (Macintosh; Intel Mac OS X 14_5) AppleWebKit/605.1.15 (KHTML, like Gecko) "
    "Version/17.5 Safari/605.1.15",
]


# -- the workload ---------------------------------------------------------------------------------
def make_event(rng: random.Random, i: int) -> dict[str, Any]:
    """One clickstream event: 20-40 leaf fields, nested, with some type drift."""
    price: Any = rng.choice([rng.randint(1, 500), round(rng.uniform(1, 500), 2)])
    if rng.random() < 0.01:
        price = "free"
    event: dict[str, Any] = {
        "messageId": f"m-{i}",
        "type": "track",
        "event": rng.choice(EVENTS),
        "userId": f"u-{rng.randint(1, 50_000)}",
        "anonymousId": f"a-{rng.getrandbits(48):012x}",
        "timestamp": datetime.fromtimestamp(1_714_560_000 + i / 1000, UTC).isoformat(),
        "context": {
            "ip": f"81.2.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
            "locale": rng.choice(["en-US", "de-DE", "fr-FR", "nb-NO"]),
            "page": {
                "path": rng.choice(PAGES),
                "referrer": rng.choice(
                    ["", "https://news.example.com/", "https://search.example/"]
                ),
                "title": "headwater",
                "url": "https://shop.example.com" + rng.choice(PAGES),
            },
            "screen": {"width": rng.choice([390, 1280, 1920]), "height": rng.choice([844, 800])},
            "library": {"name": "analytics.js", "version": "5.2.1"},
            "campaign": {"source": rng.choice(["google", "newsletter"]), "medium": "cpc"},
        },
        "properties": {
            "price": price,
            "quantity": rng.randint(1, 5),
            "in_stock": rng.choice([True, False, 1]),
            "sku": f"SKU-{rng.randint(1, 9999):04d}",
            "category": rng.choice(["books", "games", "garden"]),
            "tags": rng.sample(["new", "sale", "gift", "eco"], k=rng.randint(0, 3)),
        },
    }
    extra = rng.randint(0, 12)
    for k in range(extra):
        event["properties"][f"attr_{k}"] = rng.choice([k, f"v{k}", k * 0.5])
    return event


def message(value: bytes, user_id: str, ip: str, event_id: str) -> Message:
    """The bus record the collector would write for one event, context in headers."""
    received = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    headers = (
        (ctx.TYPE, b"track"),
        (ctx.CONTENT_TYPE, b"application/json"),
        (ctx.SOURCE, b"web"),
        (ctx.EVENT_ID, event_id.encode()),
        (ctx.RECEIVED_AT, received.encode()),
        (ctx.CLIENT_IP, ip.encode()),
        (ctx.USER_AGENT, BROWSERS[hash(event_id) % len(BROWSERS)].encode()),
        (ctx.PROTOCOL, b"segment"),
    )
    return Message(value, key=user_id.encode(), headers=headers)


def messages(n: int, seed: int = 7) -> Iterator[Message]:
    rng = random.Random(seed)
    for i in range(n):
        event = make_event(rng, i)
        yield message(
            json.dumps(event).encode(), event["userId"], event["context"]["ip"], f"ev-{i}"
        )


def config_for(
    directory: Path,
    mode: str,
    destinations: Iterable[dict[str, Any]] = ({"id": "warehouse", "type": "duckdb"},),
    trigger_s: float = 1.0,
    bus: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config document (validate it with HeadwaterConfig, or write it for the CLI); ``bus``:
    its ``bus`` section (default: an embedded log in ``directory``)."""
    common = {"mode": mode, "trigger_interval_s": trigger_s}
    if bus is None:
        bus = {"embedded": {"durability": "never", "default_partitions": 2}}
    return {
        "data_dir": str(directory),
        "bus": bus,
        "pipeline": {"destinations": [{**common, **d} for d in destinations]},
    }


def kafka_bus(kafka: KafkaCluster) -> dict[str, Any]:
    """The ``bus`` section of a config on ``kafka``, topics of 2 partitions as on the log."""
    settings = {"bootstrap_servers": kafka.bootstrap_servers, "default_partitions": 2}
    return {"backend": "kafka", "kafka": settings}


def kafka_destination(dest: dict[str, Any], directory: Path, topic: str) -> dict[str, Any]:
    """``dest`` (DuckDB) writing into ``directory`` and reading ``topic`` by name: unlike the
    embedded logs, one per data dir, a broker's topics are shared by every run on it."""
    return {**dest, "path": str(directory / "duck.duckdb"), "topics": [topic]}


def from_label(bus: dict[str, Any] | None) -> str:
    """How a case names where it read: nothing for the embedded log (the default)."""
    return " from Kafka" if bus is not None and bus.get("backend") == "kafka" else ""


def fill_log(
    configs: Sequence[HeadwaterConfig], n: int, ndjson: Path | None = None, topic: str = TOPIC
) -> None:
    """Append the same ``n`` events to ``topic`` (2 partitions) on the bus of each of
    ``configs``; with ``ndjson``, also write their JSON there, a line each (the references'
    input: the very bytes headwater reads)."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(ndjson.open("wb")) if ndjson is not None else None
        buses = [stack.enter_context(open_bus(config)) for config in configs]
        for bus in buses:
            bus.create_topic(topic, 2)
        chunk: list[Message] = []
        for m in messages(n):
            chunk.append(m)
            if out is not None:
                out.write(m.value + b"\n")
            if len(chunk) == 1000:
                for bus in buses:
                    bus.append(topic, chunk).result()
                chunk = []
        for bus in buses:
            if chunk:
                bus.append(topic, chunk).result()
            bus.flush()


def fill_log_elsewhere(configs: Sequence[HeadwaterConfig], n: int, ndjson: Path | None) -> None:
    """``fill_log`` in a child process: what making a million events leaves in a heap is not
    the pipeline's memory, and this process is the measured driver."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import pipeline; "
        "from headwater.config.model import HeadwaterConfig as C; "
        "pipeline.fill_log([C.model_validate_json(c) for c in sys.argv[4:]], int(sys.argv[2]), "
        "Path(sys.argv[3]) if sys.argv[3] else None)"
    )
    here = str(Path(__file__).resolve().parent)
    command = [sys.executable, "-c", code, here, str(n), str(ndjson or "")]
    command += [config.model_dump_json() for config in configs]
    subprocess.run(command, check=True)


# -- reading what landed --------------------------------------------------------------------------
COUNT_LANDED = f"select count(*), count(distinct {ID_COLUMN}) from events"


def landed_duckdb(path: Path) -> dict[str, int]:
    import duckdb

    with duckdb.connect(str(path), read_only=True) as con:
        rows, ids = con.execute(COUNT_LANDED).fetchone()  # type: ignore[misc]
        columns = len(con.execute("describe events").fetchall())
    return {"rows": rows, "distinct_ids": ids, "columns": columns}


def landed_delta(table: Path, id_column: str = ID_COLUMN) -> dict[str, int]:
    """Rows, distinct ids, columns and versions of the Delta table at ``table``, read by
    delta-rs's own engine (``QueryBuilder``: the Arrow routes of deltalake 1.6.6 can abort the
    interpreter at its exit)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    dt = DeltaTable(str(table))
    sql = f'SELECT count(*) AS n, count(DISTINCT "{id_column}") AS ids FROM t'
    (row,) = pa.table(QueryBuilder().register("t", dt).execute(sql).read_all()).to_pylist()
    return {
        "rows": int(row["n"]),
        "distinct_ids": int(row["ids"]),
        "columns": len(dt.schema().fields),
        "versions": dt.version() + 1,  # version 0 (the table's creation) counts
    }


def landed_postgres(dsn: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(dsn) as con:
        rows, ids = con.execute(COUNT_LANDED).fetchone()  # type: ignore[misc]
        columns = con.execute(
            "select count(*) from information_schema.columns where table_name = 'events'"
        ).fetchone()[0]  # type: ignore[index]
    return {"rows": rows, "distinct_ids": ids, "columns": columns}


# -- the cases ------------------------------------------------------------------------------------
def warm_up(
    spark: Any,
    directory: Path,
    destinations: list[dict[str, Any]],
    bus: dict[str, Any] | None = None,
    topic: str = TOPIC,
    n: int = WARMUP_EVENTS,
) -> None:
    """A small run (``n`` events) of every destination measured, so the timed runs find Spark's
    code compiled and its JVM warm (a cold start is the fixed-cost case's business)."""
    from headwater.pipeline.runner import Pipeline

    config = HeadwaterConfig.model_validate(config_for(directory, "batch", destinations, bus=bus))
    names = ", ".join(d["id"] for d in destinations)
    progress(f"warm-up: {n:,} events into {names}{from_label(bus)}")
    fill_log([config], n, topic=topic)
    pipeline = Pipeline(config, spark)
    pipeline.run_once()
    for q in pipeline.queries:
        q.writer.close()


def run_batch(
    spark: Any,
    directory: Path,
    n: int,
    destination: dict[str, Any],
    *,
    bus: dict[str, Any] | None = None,
    exclude: Collection[int] = (),
) -> dict[str, Any]:
    """One batch run; ``bus``: the ``bus`` section it reads (default: the embedded log in
    ``directory``); ``exclude``: processes (a broker) left out of the peak RSS of the tree."""
    from headwater.pipeline.runner import Pipeline

    config = HeadwaterConfig.model_validate(config_for(directory, "batch", [destination], bus=bus))
    pipeline = Pipeline(config, spark)
    name = destination["type"] + from_label(bus)
    if destination["id"] == "shaped":
        name += " shaped"
    progress(f"batch mode: {n:,} events into {name} with Trigger.AvailableNow")
    with TreeRss(exclude=exclude) as rss:
        t0 = time.perf_counter()
        pipeline.run_once()
        seconds = time.perf_counter() - t0
    writer = pipeline.queries[0].writer
    writer.close()
    if destination["type"] == "duckdb":
        result = landed_duckdb(Path(destination["path"]))
    elif destination["type"] == "delta":
        result = landed_delta(Path(destination["path"]) / TABLE)
    else:
        result = landed_postgres(destination["dsn"])
    return {
        "destination": name,
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds,
        "peak_rss_bytes": rss.peak,
        "peak_pss_bytes": rss.peak_pss,
        "rss_at_peak": [[name, size] for name, size in rss.at_peak],
        **result,
        "exactly_once": result["rows"] == n and result["distinct_ids"] == n,
        "batches": getattr(writer, "batches", None),
        "phases_s": {k: round(v, 2) for k, v in getattr(writer, "phases", {}).items()},
    }


def sample_of(ndjson: Path, directory: Path, n: int) -> Path:
    """The first ``n`` lines of ``ndjson`` in ``directory``: a reference's warm-up input."""
    directory.mkdir(parents=True, exist_ok=True)
    sample = directory / "sample.ndjson"
    with ndjson.open("rb") as src, sample.open("wb") as dst:
        for _, line in zip(range(n), src, strict=False):
            dst.write(line)
    return sample


def run_naive(directory: Path, ndjson: Path, warmup_events: int) -> dict[str, Any] | None:
    """Reference 1 in its own process (bench/naive_pyspark.py)."""
    sample = sample_of(ndjson, directory, warmup_events)
    progress("reference 1: naive PySpark in its own process")
    command = [sys.executable, str(REPO / "bench" / "naive_pyspark.py"), "--input", str(ndjson)]
    command += ["--warmup", str(sample), "--database", str(directory / "naive.duckdb")]
    done = subprocess.run(command, stdout=subprocess.PIPE, env=spark_env(), check=False)
    if done.returncode != 0:
        progress(f"naive PySpark failed (exit {done.returncode})")
        return None
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


# -- reference 2: naive PySpark into Delta, in a child process of its own -------------------------
NAIVE_DELTA_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); import pipeline; "
    "pipeline.naive_delta_main(*sys.argv[2:])"
)
DELTA_SESSION = {  # what Delta Lake's documentation has a Spark session set
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def run_naive_delta(directory: Path, ndjson: Path, n: int, warmup_events: int) -> dict[str, Any]:
    """Reference 2: ``naive_delta_main`` in its own process on the ``n`` events of ``ndjson``;
    its timing and peak RSS, and what landed, read back with delta-rs. ``{"failed": why}``
    when it could not run."""
    from headwater.jvm.maven import DELTA_SPARK, ArtifactError, fetch

    try:
        fetch(DELTA_SPARK, quiet=False)  # here: a first fetch is not the reference's time
    except ArtifactError as e:
        progress(f"naive PySpark into Delta: no Delta Lake for Spark: {e}")
        return {"failed": f"no {DELTA_SPARK.coordinates} ({e.code})"}
    sample = sample_of(ndjson, directory, warmup_events)
    table = directory / TABLE
    progress("reference 2: naive PySpark into Delta Lake, in its own process")
    here = str(Path(__file__).resolve().parent)
    command = [sys.executable, "-c", NAIVE_DELTA_CHILD, here, str(ndjson), str(sample), str(table)]
    done = subprocess.run(command, stdout=subprocess.PIPE, env=spark_env(), check=False)
    if done.returncode != 0:
        progress(f"naive PySpark into Delta failed (exit {done.returncode})")
        return {"failed": f"exit {done.returncode}"}
    timing = json.loads(done.stdout.decode().strip().splitlines()[-1])
    landed = landed_delta(table, NAIVE_ID)
    return {
        "destination": "naive delta",
        "events": n,
        **timing,
        "events_per_s": n / timing["seconds"],
        **landed,
        "exactly_once": landed["rows"] == n and landed["distinct_ids"] == n,
    }


def naive_delta_load(spark: Any, source: Path, table: Path) -> None:
    """What a data engineer writes first: read with inference, flatten the structs as
    reference 1 does, append to a Delta table."""
    from pyspark.sql import functions as F

    from naive_pyspark import flat_columns

    frame = spark.read.json(str(source))
    columns = [
        F.col("`" + "`.`".join(path) + "`").alias(name) for path, name in flat_columns(frame.schema)
    ]
    frame.select(*columns).write.format("delta").mode("append").save(str(table))


def naive_delta_main(source: str, sample: str, table: str) -> None:
    """Reference 2's process: Spark ``local[2]`` with Delta Lake for Spark on ``spark.jars``,
    a warm-up on ``sample`` (into a table of its own), then ``source`` into ``table`` timed;
    prints one JSON object (seconds, peak RSS and PSS of its process tree)."""
    from pyspark.sql import SparkSession

    from headwater.jvm.maven import DELTA_SPARK, fetch

    progress("naive PySpark into Delta: starting Spark (local[2])")
    builder = SparkSession.builder.master("local[2]").appName("naive-delta")
    settings = {
        "spark.jars": ",".join(str(j) for j in fetch(DELTA_SPARK)),
        **DELTA_SESSION,
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    target = Path(table)
    try:
        progress("naive PySpark into Delta: warm-up on the sample")
        naive_delta_load(spark, Path(sample), target.parent / "warmup")
        progress("naive PySpark into Delta: the timed run")
        with TreeRss() as rss:
            t0 = time.perf_counter()
            naive_delta_load(spark, Path(source), target)
            seconds = time.perf_counter() - t0
    finally:
        spark.stop()
    peaks = {"peak_rss_bytes": rss.peak, "peak_pss_bytes": rss.peak_pss}
    print(json.dumps({"seconds": seconds, **peaks}))


def spark_env() -> dict[str, str]:
    """The environment for a child that starts Spark: loopback, and this venv's Python for the
    workers."""
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    return env


def run_fixed(directory: Path, n: int) -> dict[str, Any]:
    """``headwater pipeline --once`` as a user runs it: the CLI, a cold JVM, ``n`` events."""
    document = config_for(directory, "batch")
    config = HeadwaterConfig.model_validate(document)
    fill_log([config], n)
    path = directory / "headwater.yaml"
    path.write_text(json.dumps(document, indent=2))  # JSON is YAML
    command = [str(Path(sys.executable).parent / "headwater"), "pipeline", "--once"]
    command += ["--config", str(path)]
    progress(f"fixed cost: {shlex.join(command)} on {n:,} events")
    t0 = time.perf_counter()
    done = subprocess.run(
        command, env=spark_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False
    )
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        progress(done.stdout.decode(errors="replace")[-2000:])
    result = landed_duckdb(config.warehouse_path()) if done.returncode == 0 else {}
    facts = {"events": n, "seconds": seconds, "exit": done.returncode}
    return {**facts, "command": shlex.join(command), **result}


# -- stream mode ----------------------------------------------------------------------------------
class DuckDBRows:
    """The event ids of rows new in a DuckDB table since the last look."""

    def __init__(self, warehouse: Path) -> None:
        self._warehouse = warehouse
        self._last = -1  # the highest rowid seen

    def new_ids(self) -> list[str]:
        import duckdb

        try:
            with duckdb.connect(str(self._warehouse), read_only=False) as con:
                got = con.execute(POLL_SQL, [self._last]).fetchall()
        except duckdb.Error:
            return []
        for rowid, _ in got:
            self._last = max(self._last, rowid)
        return [eid for _, eid in got]


class DeltaRows:
    """The event ids of rows in Delta table versions committed since the last look: the ids
    in the data files the table's current version lists and the last one did not."""

    def __init__(self, table: Path) -> None:
        self._table_path = table
        self._table: Any = None  # a deltalake.DeltaTable once the table exists
        self._version = -1
        self._files: set[str] = set()

    def new_ids(self) -> list[str]:
        import pyarrow.parquet as pq
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError

        try:
            if self._table is None:
                self._table = DeltaTable(str(self._table_path))
            else:
                self._table.update_incremental()
            version = self._table.version()
            if version == self._version:
                return []
            files = set(self._table.file_uris()) - self._files
            ids = [
                eid
                for f in sorted(files)
                for eid in pq.read_table(f, columns=[ID_COLUMN]).column(ID_COLUMN).to_pylist()
            ]
        except (DeltaError, OSError):  # not created yet, or a file already compacted away
            return []
        self._version = version
        self._files |= files
        return ids


class StreamLoad:
    """Appends events to the log at a steady rate and watches their rows appear, through
    ``rows`` (``DuckDBRows`` or ``DeltaRows``).

    Payloads come from a pool made once (events vary, and making them is not what is measured:
    at 40k/s, building fresh events would be the bottleneck); each record gets its own event id
    and receive time."""

    POOL = 5_000

    def __init__(self, bus: Any, rows: DuckDBRows | DeltaRows) -> None:
        rng = random.Random(11)
        self._pool = [make_event(rng, i) for i in range(self.POOL)]
        self._pool_bytes = [json.dumps(e).encode() for e in self._pool]
        self._bus = bus
        self._rows = rows
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> StreamLoad:
        self._poller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._poller.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            got = self._rows.new_ids()
            now = time.time()
            for eid in got:
                self.seen.setdefault(eid, now)
            self._stop.wait(0.1)

    def step(self, rate: float, warmup_s: float, seconds: float, drain_s: float) -> dict[str, Any]:
        """``warmup_s`` then ``seconds`` at ``rate``; latencies of the measured events."""
        sent: dict[str, float] = {}
        t0 = time.time()
        measured_from, end = t0 + warmup_s, t0 + warmup_s + seconds
        i, behind = 0, 0
        tag = f"r{int(rate)}-{int(t0)}"
        while (now := time.time()) < end:
            due = int((now - t0) * rate) - i
            if due > 0:
                chunk = []
                for k in range(i, i + due):
                    event = self._pool[k % self.POOL]
                    value = self._pool_bytes[k % self.POOL]
                    eid = f"ev-{tag}-{k}"
                    chunk.append(message(value, event["userId"], event["context"]["ip"], eid))
                if now >= measured_from:
                    for k in range(i, i + due):
                        sent[f"ev-{tag}-{k}"] = now
                    behind = max(behind, due)
                self._bus.append(TOPIC, chunk).result()
                i += due
            time.sleep(0.01)
        deadline = time.time() + drain_s
        while any(e not in self.seen for e in sent) and time.time() < deadline:
            time.sleep(0.2)
        latencies = sorted(self.seen[e] - sent[e] for e in sent if e in self.seen)
        seen = len(latencies)
        return {
            "rate": rate,
            "warmup_s": warmup_s,
            "seconds": seconds,
            "sent": len(sent),
            "seen": seen,
            # the appender fell behind its schedule by more than half a second's events at once
            "appender_behind": behind > rate * 0.5,
            **{f"p{q}_s": percentile(latencies, q) if latencies else None for q in (50, 95, 99)},
        }


def sustained(step: dict[str, Any], p95_limit_s: float) -> bool:
    return (
        step["sent"] > 0
        and step["seen"] == step["sent"]
        and not step["appender_behind"]
        and step["p95_s"] is not None
        and step["p95_s"] < p95_limit_s
    )


def run_stream(
    spark: Any, directory: Path, args: argparse.Namespace, delta: bool = False
) -> dict[str, Any]:
    """Stream mode into DuckDB at ``args.rate``, then the ladder of doubling rates; with
    ``delta``, into a Delta destination at ``args.rate`` only."""
    from headwater.pipeline.runner import Pipeline

    lake = directory / "lake"
    if delta:
        dests = [{"id": "lake", "type": "delta", "path": str(lake)}]
        document = config_for(directory, "stream", dests, trigger_s=args.trigger_s)
    else:
        document = config_for(directory, "stream", trigger_s=args.trigger_s)
    config = HeadwaterConfig.model_validate(document)
    rows = DeltaRows(lake / TABLE) if delta else DuckDBRows(config.warehouse_path())
    with open_bus(config) as bus:
        bus.create_topic(TOPIC, 2)
    pipeline = Pipeline(config, spark)
    progress(
        f"stream mode{' into Delta' if delta else ''}: {args.rate:,.0f} events/s for "
        f"{args.stream_warmup_s:g} s of warm-up, then {args.stream_seconds:g} s measured, "
        f"trigger {args.trigger_s:g} s"
    )
    with open_bus(config) as bus, StreamLoad(bus, rows) as load:
        pipeline.start()
        try:
            steady = load.step(args.rate, args.stream_warmup_s, args.stream_seconds, args.drain_s)
            if delta:
                versions = landed_delta(lake / TABLE)["versions"]
                return {**steady, "destination": "delta", "versions": versions}
            return {**steady, **climb(load, steady, args)}
        finally:
            pipeline.stop()


def climb(load: StreamLoad, steady: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The ladder after the ``steady`` step: the rate doubles while each step is sustained."""
    steps = [steady]
    rate, started = args.rate, time.monotonic()
    step_cost = args.ladder_warmup_s + args.ladder_seconds + args.drain_s
    while (
        sustained(steps[-1], args.p95_limit_s)
        and rate * 2 <= args.max_rate
        and time.monotonic() - started + step_cost <= args.ladder_budget_s
    ):
        rate *= 2
        progress(f"stream ladder: {rate:,.0f} events/s")
        steps.append(load.step(rate, args.ladder_warmup_s, args.ladder_seconds, args.drain_s))
    passing = [s["rate"] for s in steps if sustained(s, args.p95_limit_s)]
    highest = max(passing) if passing else None  # the ladder stops at its first failing step
    last_failed = not sustained(steps[-1], args.p95_limit_s)
    return {
        "ladder": steps,
        "p95_limit_s": args.p95_limit_s,
        "highest_rate": highest,
        # False when the ladder stopped on a bound (max rate, budget) with every step passing
        "highest_is_limit": last_failed,
    }


def scratch_database(dsn: str) -> str:
    """A new empty database on the server of ``dsn``; its connection string."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    with psycopg.connect(dsn, autocommit=True) as con:
        con.execute("create database hw_warmup")
    return make_conninfo(dsn, dbname="hw_warmup")


# -- the run --------------------------------------------------------------------------------------
NUMBERS: tuple[tuple[str, type, float, str | None], ...] = (  # flag, type, default, help
    ("--events", int, 1_000_000, None),
    ("--fixed-events", int, 1_000, None),
    (
        "--warmup-events",
        int,
        WARMUP_EVENTS,
        "events of the batch warm-up run and of the naive references' warm-up sample",
    ),
    ("--rate", float, 5000.0, None),
    ("--stream-seconds", float, 30.0, None),
    ("--trigger-s", float, 1.0, None),
    (
        "--stream-warmup-s",
        float,
        30.0,
        "stream mode: seconds of load before the measured window (Spark compiles the query's "
        "code in its first micro-batches; a cold start is not the steady state)",
    ),
    ("--ladder-warmup-s", float, 10.0, None),
    ("--ladder-seconds", float, 15.0, None),
    ("--drain-s", float, 30.0, "after a window, how long its events may take to all be visible"),
    ("--max-rate", float, 160_000.0, None),
    ("--ladder-budget-s", float, 300.0, "no ladder step starts past this many seconds of ladder"),
    ("--p95-limit-s", float, 3.0, None),
)
SKIPS: tuple[tuple[str, str | None], ...] = (
    ("--skip-batch", "no batch nor naive"),
    ("--skip-postgres", None),
    ("--skip-naive", None),
    ("--skip-small-batches", "no second DuckDB run in micro-batches of a quarter of the events"),
    ("--skip-shaped", "no DuckDB run with functions, contracts and enrichments"),
    ("--skip-fixed", None),
    ("--skip-stream", None),
    ("--skip-delta", "no Delta Lake case: batch, naive PySpark into Delta, stream"),
    ("--skip-duckdb-stream", "stream mode into Delta only (no DuckDB stream, no ladder)"),
)


def main() -> None:
    parser = arguments(__doc__, markdown=False)
    for flag, kind, default, help_text in NUMBERS:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    for flag, help_text in SKIPS:
        parser.add_argument(flag, action="store_true", help=help_text)
    parser.add_argument(
        "--bus",
        choices=["embedded", "kafka"],
        default="embedded",
        help="kafka: the batch DuckDB case read from an Apache Kafka broker through Spark's "
        "Kafka connector, and in the same run from the embedded log (nothing else)",
    )
    args = parser.parse_args()
    if args.bus == "kafka":  # the comparison alone: the other cases read the embedded log only
        if args.skip_batch:
            parser.error("--bus kafka measures the batch mode: drop --skip-batch")
        args.skip_postgres = args.skip_naive = args.skip_small_batches = args.skip_shaped = True
        args.skip_fixed = args.skip_stream = args.skip_delta = True

    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import spark_session

    if not args.skip_batch and not args.skip_shaped:
        import shaping_sample  # beside this script: Spark's workers import it too

        shaping_sample.prepare_environment()
    root = bench_directory(args.dir, "bench-pipeline-")
    out: dict[str, Any] = run_facts(root)
    try:
        with (
            start_postgres()
            if not args.skip_batch and not args.skip_postgres
            else nullcontext() as pg,
            kafka_broker() if args.bus == "kafka" else nullcontext() as kafka,
        ):
            connector = " with Spark's Kafka connector" if kafka is not None else ""
            progress(f"starting Spark (local[2]){connector}")
            spark = spark_session(
                SparkConfig(master="local[2]"), app_name="headwater-bench", kafka=kafka is not None
            )
            if not args.skip_batch:
                duck = {"id": "duck", "type": "duckdb", "path": str(root / "batch" / "duck.duckdb")}
                lake = None
                if not args.skip_delta:
                    lake = {"id": "lake", "type": "delta", "path": str(root / "batch" / "lake")}
                dests = [duck]
                if pg is not None:
                    dests.append({"id": "pg", "type": "postgres", "dsn": pg.dsn})
                shaped = None
                if not args.skip_shaped:
                    shaped = shaping_sample.destination(
                        root, root / "batch" / "shaped.duckdb", EVENTS
                    )
                warm = [{**duck, "path": str(root / "warmup" / "duck.duckdb")}]
                if shaped is not None:
                    warm.append({**shaped, "path": str(root / "warmup" / "shaped.duckdb")})
                if lake is not None:
                    warm.append({**lake, "path": str(root / "warmup" / "lake")})
                if pg is not None:  # its own database: the measured run's table starts empty
                    warm.append({"id": "pg", "type": "postgres", "dsn": scratch_database(pg.dsn)})
                warm_up(spark, root / "warmup", warm, n=args.warmup_events)
                fill = [HeadwaterConfig.model_validate(config_for(root / "batch", "batch"))]
                ndjson: Path | None = root / "events.ndjson"
                broker: list[int] = []  # a child of this process, not part of the pipeline
                if kafka is not None:
                    bus = kafka_bus(kafka)
                    broker.append(kafka.process.pid)
                    from_kafka = kafka_destination(duck, root / "kafka", TOPIC)
                    warm_kafka = kafka_destination(duck, root / "warmup-kafka", WARMUP_TOPIC)
                    warm_up(
                        spark,
                        root / "warmup-kafka",
                        [warm_kafka],
                        bus,
                        WARMUP_TOPIC,
                        n=args.warmup_events,
                    )
                    kafka_config = config_for(root / "kafka", "batch", [from_kafka], bus=bus)
                    fill.append(HeadwaterConfig.model_validate(kafka_config))
                    ndjson = None  # no references to feed
                progress(
                    f"appending {args.events:,} events to the embedded log "
                    + (f"(and {ndjson.name})" if ndjson is not None else "and to Kafka")
                )
                fill_log_elsewhere(fill, args.events, ndjson)
                out["batch"] = run_batch(spark, root / "batch", args.events, duck, exclude=broker)
                if lake is not None:  # the same events into Delta, right after (same conditions)
                    out["delta"] = run_batch(spark, root / "batch", args.events, lake)
                if kafka is not None:  # the same events, the same query, read from Kafka
                    out["kafka"] = run_batch(
                        spark, root / "kafka", args.events, from_kafka, bus=bus, exclude=broker
                    )
                    out["broker"] = broker_figures(kafka)
                if shaped is not None:  # the same events, shaped
                    out["shaped"] = run_batch(spark, root / "batch", args.events, shaped)
                if not args.skip_small_batches:  # the same events, micro-batches of 1/4 the size
                    small = {
                        **duck,
                        "id": "duck_small",
                        "path": str(root / "batch" / "small.duckdb"),
                        "max_records_per_trigger": max(args.events // 4, 1),
                    }
                    out["small_batches"] = run_batch(spark, root / "batch", args.events, small)
                if pg is not None:
                    out["postgres"] = run_batch(spark, root / "batch", args.events, dests[1])
                if not args.skip_naive and ndjson is not None:
                    out["naive"] = run_naive(root / "naive", ndjson, args.warmup_events)
                    if not args.skip_delta:
                        out["naive_delta"] = run_naive_delta(
                            root / "naive-delta", ndjson, args.events, args.warmup_events
                        )
        if not args.skip_fixed:
            out["fixed"] = run_fixed(root / "fixed", args.fixed_events)
        if not args.skip_stream:
            if not args.skip_duckdb_stream:
                out["stream"] = run_stream(spark, root / "stream", args)
            if not args.skip_delta:
                out["stream_delta"] = run_stream(spark, root / "stream-delta", args, delta=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    out["targets"] = targets(out)
    if args.format == "json":
        emit_json(out)
        return
    report(out)


GB = 1_000_000_000


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 8's targets, each with the figure measured and met or not (None: not measured)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, figure: str, met: bool) -> None:
        rows.append({"target": target, "figure": figure, "met": met})

    b, p, n = out.get("batch"), out.get("postgres"), out.get("naive")
    small, k = out.get("small_batches"), out.get("kafka")
    if b:
        add(
            "batch -> DuckDB >= 60,000 events/s",
            fmt_number(b["events_per_s"]),
            b["events_per_s"] >= 60_000,
        )
        if n:
            ratio = b["events_per_s"] / n["events_per_s"]
            add("batch -> DuckDB >= the naive PySpark script", f"{ratio:.2f}x naive", ratio >= 1)
    if b and k:
        ratio = k["events_per_s"] / b["events_per_s"]
        add(
            f"batch -> DuckDB from Kafka (Spark's connector) >= {KAFKA_TARGET:g}x the embedded "
            "log (within 20%)",
            f"{ratio:.2f}x ({fmt_number(k['events_per_s'])} vs "
            f"{fmt_number(b['events_per_s'])} events/s)",
            ratio >= KAFKA_TARGET,
        )
    sh = out.get("shaped")
    if b and sh:
        ratio = sh["events_per_s"] / b["events_per_s"]
        add(
            "shaped -> DuckDB (functions, contracts, enrichments) >= 0.7x the plain DuckDB "
            "destination and >= 50,000 events/s",
            f"{ratio:.2f}x ({fmt_number(sh['events_per_s'])} vs "
            f"{fmt_number(b['events_per_s'])} events/s)",
            ratio >= 0.7 and sh["events_per_s"] >= 50_000,
        )
        add(
            f"peak RSS of the process tree <= 2.2 GB (shaped, {sh['events']:,} events)",
            f"{sh['peak_rss_bytes'] / GB:.2f} GB",
            sh["peak_rss_bytes"] <= 2.2 * GB,
        )
        add(
            "every shaped event landed exactly once",
            f"{sh['rows']:,} rows, {sh['distinct_ids']:,} ids",
            sh["exactly_once"],
        )
    add_delta_targets(out, add)
    if p:
        add(
            "batch -> PostgreSQL >= 40,000 events/s",
            fmt_number(p["events_per_s"]),
            p["events_per_s"] >= 40_000,
        )
    for case in (b, k, p):
        if case:
            add(
                f"peak RSS of the process tree <= 2 GB ({case['destination']}, "
                f"{case['events']:,} events)",
                f"{case['peak_rss_bytes'] / GB:.2f} GB",
                case["peak_rss_bytes"] <= 2 * GB,
            )
            add(
                f"every event landed exactly once ({case['destination']})",
                f"{case['rows']:,} rows, {case['distinct_ids']:,} ids",
                case["exactly_once"],
            )
    if b and small:
        add(
            f"peak RSS not growing with batch size ({b['batches']} micro-batch(es) vs "
            f"{small['batches']}, within 10%)",
            f"{b['peak_rss_bytes'] / GB:.2f} GB vs {small['peak_rss_bytes'] / GB:.2f} GB",
            b["peak_rss_bytes"] <= small["peak_rss_bytes"] * 1.1,
        )
    f = out.get("fixed")
    if f:
        add(
            f"headwater pipeline --once on {f['events']:,} events <= 15 s",
            f"{f['seconds']:.1f} s" + ("" if f["exit"] == 0 else f" (exit {f['exit']})"),
            f["exit"] == 0 and f["seconds"] <= 15 and f.get("rows") == f["events"],
        )
    s = out.get("stream")
    if s:
        add(
            f"stream at {s['rate']:,.0f} events/s: p95 <= 3 s",
            "-" if s["p95_s"] is None else f"{s['p95_s']:.2f} s ({s['seen']:,}/{s['sent']:,} seen)",
            s["p95_s"] is not None and s["p95_s"] <= 3 and s["seen"] == s["sent"],
        )
    return rows


def add_delta_targets(out: dict[str, Any], add: Callable[[str, str, bool], None]) -> None:
    """The Delta destination's targets (batch against DuckDB in the same run and against
    reference 2, memory, exactly once; stream p95)."""
    b, d, nd = out.get("batch"), out.get("delta"), out.get("naive_delta")
    if d:
        if b:
            ratio = d["events_per_s"] / b["events_per_s"]
            add(
                f"batch -> Delta >= {DELTA_TARGET:g}x the DuckDB destination (same run)",
                f"{ratio:.2f}x ({fmt_number(d['events_per_s'])} vs "
                f"{fmt_number(b['events_per_s'])} events/s)",
                ratio >= DELTA_TARGET,
            )
        if nd and "events_per_s" in nd:
            ratio = d["events_per_s"] / nd["events_per_s"]
            add(
                f"batch -> Delta >= {DELTA_NAIVE_TARGET:g}x the naive PySpark Delta write",
                f"{ratio:.2f}x ({fmt_number(d['events_per_s'])} vs "
                f"{fmt_number(nd['events_per_s'])} events/s)",
                ratio >= DELTA_NAIVE_TARGET,
            )
        elif nd:
            add(
                f"batch -> Delta >= {DELTA_NAIVE_TARGET:g}x the naive PySpark Delta write",
                f"reference 2 did not run: {nd['failed']}",
                False,
            )
        add(
            f"peak RSS of the process tree <= {DELTA_RSS_GB:g} GB (delta, {d['events']:,} events)",
            f"{d['peak_rss_bytes'] / GB:.2f} GB",
            d["peak_rss_bytes"] <= DELTA_RSS_GB * GB,
        )
        add(
            "every event landed exactly once (delta)",
            f"{d['rows']:,} rows, {d['distinct_ids']:,} ids, {d['versions']} versions",
            d["exactly_once"],
        )
    s = out.get("stream_delta")
    if s:
        add(
            f"stream -> Delta at {s['rate']:,.0f} events/s: p95 <= {DELTA_P95_S:g} s",
            "-" if s["p95_s"] is None else f"{s['p95_s']:.2f} s ({s['seen']:,}/{s['sent']:,} seen)",
            s["p95_s"] is not None and s["p95_s"] <= DELTA_P95_S and s["seen"] == s["sent"],
        )


def report(out: dict[str, Any]) -> None:
    print(f"command: {out['command']}")
    print(f"machine: {out['machine']}")
    table: list[list[object]] = []
    for key, name in (
        ("batch", "headwater batch -> DuckDB"),
        ("kafka", "headwater batch -> DuckDB, from Kafka (Spark's connector)"),
        ("small_batches", "headwater batch -> DuckDB, 1/4-size batches"),
        ("postgres", "headwater batch -> PostgreSQL"),
        ("naive", "naive PySpark -> DuckDB (own process)"),
        ("delta", "headwater batch -> Delta (delta-rs)"),
        ("naive_delta", "naive PySpark -> Delta (own process, delta-spark)"),
    ):
        c = out.get(key)
        if not c or "events_per_s" not in c:
            continue
        peaks = [c.get(f"peak_{kind}_bytes") for kind in ("rss", "pss")]
        landed = ""
        if "rows" in c:
            landed = f"{c['rows']:,} rows, {c['columns']} columns"
        if "versions" in c:
            landed += f", {c['versions']} version" + ("s" if c["versions"] != 1 else "")
        if "exactly_once" in c:
            landed += ", exactly once" if c["exactly_once"] else ", NOT exactly once"
        mib = [None if peak is None else peak / 2**20 for peak in peaks]
        table.append([name, c["events_per_s"], c["seconds"], *mib, landed])
    if table:
        headers = ["case", "events/s", "seconds", "peak RSS MiB", "peak PSS MiB", "landed"]
        print(print_table(headers, table))
    b, k = out.get("batch"), out.get("kafka")
    if b and out.get("naive"):
        print(f"headwater DuckDB / naive: {b['events_per_s'] / out['naive']['events_per_s']:.2f}x")
    d, nd = out.get("delta"), out.get("naive_delta")
    if d and b:
        print(f"headwater Delta / headwater DuckDB: {d['events_per_s'] / b['events_per_s']:.2f}x")
    if d and nd and "events_per_s" in nd:
        print(f"headwater Delta / naive Delta: {d['events_per_s'] / nd['events_per_s']:.2f}x")
    if nd and "failed" in nd:
        print(f"naive PySpark -> Delta did not run: {nd['failed']}")
    if b and k:
        print(
            "headwater DuckDB from Kafka / from the embedded log: "
            f"{k['events_per_s'] / b['events_per_s']:.2f}x"
        )
    broker = out.get("broker")
    if broker:
        peak = broker["peak_rss_bytes"]
        print(
            f"Kafka broker: Apache Kafka {broker['kafka_version']}, {broker['brokers']} broker "
            f"(KRaft) on loopback, JVM {' '.join(broker['jvm_options'])}; a process of its own, "
            "not in the peak RSS above; its peak RSS (VmHWM, warm-up, fill and both runs): "
            + ("-" if peak is None else f"{peak / 2**20:,.0f} MiB")
        )
    keys = ("batch", "shaped", "kafka", "postgres", "delta")
    cases = [c for c in (out.get(key) for key in keys) if c]
    for c in cases:
        if c.get("phases_s"):
            print(
                f"where the {c['destination']} batch time goes (s, summed over "
                f"{c['batches']} micro-batches): "
                + ", ".join(f"{k} {v:.1f}" for k, v in c["phases_s"].items())
            )
    for c in cases:
        if c.get("rss_at_peak"):
            print(
                f"who held the {c['destination']} peak (RSS MiB): "
                + ", ".join(f"{n} {size / 2**20:,.0f}" for n, size in c["rss_at_peak"])
            )
    f = out.get("fixed")
    if f:
        print(
            f"fixed cost: {f['command']} on {f['events']:,} events: {f['seconds']:.1f} s wall "
            f"(exit {f['exit']}, {f.get('rows', 0):,} rows)"
        )
    s = out.get("stream")
    if s:
        steps = [
            [
                f"{x['rate']:,.0f}",
                f"{x['warmup_s']:g}+{x['seconds']:g}",
                f"{x['seen']:,}/{x['sent']:,}",
                *("-" if x[k] is None else f"{x[k]:.2f}" for k in ("p50_s", "p95_s", "p99_s")),
                "yes" if x["appender_behind"] else "",
            ]
            for x in s["ladder"]
        ]
        print("stream mode, receive -> row visible (seconds):")
        headers = ["events/s", "warm-up+measured s", "seen/sent", "p50", "p95", "p99"]
        print(print_table([*headers, "appender behind"], steps))
        highest = s["highest_rate"]
        bound = "" if s["highest_is_limit"] else " (the ladder stopped on --max-rate or its budget)"
        print(
            f"highest steady rate with p95 < {s['p95_limit_s']:g} s: "
            + ("none of the rates tried" if highest is None else f"{highest:,.0f} events/s")
            + bound
        )
    sd = out.get("stream_delta")
    if sd:
        print(
            f"stream mode into Delta at {sd['rate']:,.0f} events/s ({sd['warmup_s']:g}+"
            f"{sd['seconds']:g} s), receive -> committed version read: "
            + ", ".join(
                f"{q} " + ("-" if sd[f"{q}_s"] is None else f"{sd[f'{q}_s']:.2f} s")
                for q in ("p50", "p95", "p99")
            )
            + f"; {sd['seen']:,}/{sd['sent']:,} seen, {sd['versions']} table versions"
        )
    print("targets (issue 8" + (", and the Kafka bus's" if k else "") + "):")
    for t in out["targets"]:
        print(f"  {'met   ' if t['met'] else 'MISSED'}  {t['target']}: {t['figure']}")


if __name__ == "__main__":
    sys.exit(main())
