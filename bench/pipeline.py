"""Benchmark of the pipeline: clickstream events on the embedded log into DuckDB.

Run from the repository root (dlt is a bench-only dependency: ``pip install -e '.[bench]'``)::

    .venv/bin/python bench/pipeline.py                 # 1M events; several minutes
    .venv/bin/python bench/pipeline.py --events 200000 --stream-seconds 20   # a smaller run
    .venv/bin/python bench/pipeline.py --skip-batch --stream-seconds 60   # stream latency only
    .venv/bin/python bench/pipeline.py --format json

What it measures, in one run, on this machine (Spark ``local[2]``):

1. **Batch mode.** ``--events`` realistic clickstream events (nested objects, 20-40 fields,
   some type drift: a price that is an integer, a float or text; a flag that is a boolean or a
   number) are appended to an embedded log (topic ``events-track``, 2 partitions, with the
   context headers the collector writes). Then the DuckDB destination's query runs with
   ``Trigger.AvailableNow`` (``headwater pipeline --once`` in-process) until every event is a
   row. Figures: events/s (wall time of the run, Spark already started), the peak RSS of the
   whole process tree (driver, JVM, Python workers), and the rows and columns that landed.
2. **The reference.** The same events (the same JSON values) loaded into a fresh DuckDB file by
   ``dlt`` (``dlt.pipeline(destination="duckdb").run(...)``), which also flattens, types and
   evolves the schema; events/s, and headwater / dlt as a ratio.
3. **Stream mode latency.** The destination in ``mode: stream`` (trigger every
   ``--trigger-s``) while this script appends events at a steady ``--rate`` (default 5k/s):
   ``--stream-warmup-s`` of load first (Spark compiles the query's code during its first
   micro-batches, which takes ~15 s here and is not the steady state), then
   ``--stream-seconds`` measured; a poller finds each measured event's row in DuckDB and
   records append time -> row visible. p50/p95/p99.

Targets (issue 4): >= 100k events/s in batch mode, >= 3x dlt, stream p95 <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import (
    bench_directory,
    emit_json,
    fmt_number,
    machine_info,
    percentile,
    print_table,
    progress,
)
from headwater.bus import Message, open_bus
from headwater.bus import context as ctx
from headwater.config.model import HeadwaterConfig

TOPIC = "events-track"
# new rows since the last poll (rows are only appended, so rowids grow; a rowid filter is cheap)
POLL_SQL = "select rowid, eventn_ctx_event_id from events where rowid > ?"
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


def messages(n: int, seed: int = 7) -> Iterator[tuple[dict[str, Any], Message]]:
    rng = random.Random(seed)
    for i in range(n):
        event = make_event(rng, i)
        received = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        headers = (
            (ctx.TYPE, b"track"),
            (ctx.CONTENT_TYPE, b"application/json"),
            (ctx.SOURCE, b"web"),
            (ctx.EVENT_ID, f"ev-{i}".encode()),
            (ctx.RECEIVED_AT, received.encode()),
            (ctx.CLIENT_IP, event["context"]["ip"].encode()),
            (ctx.USER_AGENT, BROWSERS[i % len(BROWSERS)].encode()),
            (ctx.PROTOCOL, b"segment"),
        )
        yield (
            event,
            Message(json.dumps(event).encode(), key=event["userId"].encode(), headers=headers),
        )


def config_for(directory: Path, mode: str, trigger_s: float = 1.0) -> HeadwaterConfig:
    return HeadwaterConfig.model_validate(
        {
            "data_dir": directory,
            "bus": {"embedded": {"durability": "never", "default_partitions": 2}},
            "pipeline": {
                "destinations": [
                    {
                        "id": "warehouse",
                        "type": "duckdb",
                        "mode": mode,
                        "trigger_interval_s": trigger_s,
                        "max_records_per_trigger": 250_000,
                    }
                ]
            },
        }
    )


def fill_log(config: HeadwaterConfig, n: int) -> list[dict[str, Any]]:
    values: list[dict[str, Any]] = []
    with open_bus(config) as bus:
        bus.create_topic(TOPIC, 2)
        chunk: list[Message] = []
        for event, message in messages(n):
            values.append(event)
            chunk.append(message)
            if len(chunk) == 1000:
                bus.append(TOPIC, chunk).result()
                chunk = []
        if chunk:
            bus.append(TOPIC, chunk).result()
        bus.flush()
    return values


# -- memory of the process tree -------------------------------------------------------------------
class TreeRss:
    """Samples the summed RSS of this process and all its descendants, keeping the peak."""

    def __init__(self, interval: float = 0.2) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._interval = interval

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, tree_rss(os.getpid()))


def tree_rss(root: int) -> int:
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/statm") as f:
                pages = int(f.read().split()[1])
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


# -- the cases ------------------------------------------------------------------------------------
def run_batch(spark: Any, directory: Path, n: int) -> dict[str, Any]:
    from headwater.pipeline.runner import Pipeline

    config = config_for(directory, "batch")
    progress(f"appending {n:,} events to the embedded log")
    fill_log(config, n)
    pipeline = Pipeline(config, spark)
    progress("batch mode: the DuckDB destination with Trigger.AvailableNow")
    with TreeRss() as rss:
        t0 = time.perf_counter()
        pipeline.run_once()
        seconds = time.perf_counter() - t0
    writer = pipeline.queries[0].writer
    writer.close()
    import duckdb

    with duckdb.connect(str(config.warehouse_path()), read_only=True) as con:
        rows = con.execute("select count(*) from events").fetchone()[0]  # type: ignore[index]
        columns = len(con.execute("describe events").fetchall())
    return {
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds,
        "peak_rss_bytes": rss.peak,
        "rows": rows,
        "columns": columns,
        "batches": writer.batches,
        "phases_s": {k: round(v, 2) for k, v in writer.phases.items()},
    }


def run_dlt(directory: Path, values: list[dict[str, Any]]) -> dict[str, Any] | None:
    try:
        import dlt
    except ImportError:
        progress("dlt is not installed (pip install -e '.[bench]'): no reference")
        return None
    progress(f"reference: dlt loading {len(values):,} events into DuckDB")
    os.environ["DLT_DATA_DIR"] = str(directory / "dlt-home")
    os.environ["RUNTIME__LOG_LEVEL"] = "WARNING"
    pipe = dlt.pipeline(
        pipeline_name="bench",
        destination=dlt.destinations.duckdb(str(directory / "dlt.duckdb")),
        dataset_name="bench",
        pipelines_dir=str(directory / "dlt-pipelines"),
    )
    t0 = time.perf_counter()
    pipe.run(values, table_name="events")
    seconds = time.perf_counter() - t0
    return {"events": len(values), "seconds": seconds, "events_per_s": len(values) / seconds}


def run_stream(
    spark: Any, directory: Path, rate: float, seconds: float, trigger_s: float, warmup_s: float
) -> dict[str, Any]:
    import duckdb

    from headwater.pipeline.runner import Pipeline

    config = config_for(directory, "stream", trigger_s)
    with open_bus(config) as bus:
        bus.create_topic(TOPIC, 2)
    pipeline = Pipeline(config, spark)
    sent: dict[str, float] = {}
    seen: dict[str, float] = {}
    progress(
        f"stream mode: {rate:,.0f} events/s for {warmup_s:g} s of warm-up, then {seconds:g} s "
        f"measured, trigger {trigger_s:g} s"
    )
    with open_bus(config) as bus:
        pipeline.start()
        stop = threading.Event()

        def poll() -> None:
            last = -1
            while not stop.is_set():
                try:
                    with duckdb.connect(str(config.warehouse_path()), read_only=False) as con:
                        got = con.execute(POLL_SQL, [last]).fetchall()
                except duckdb.Error:
                    got = []
                now = time.time()
                for rowid, eid in got:
                    seen.setdefault(eid, now)
                    last = max(last, rowid)
                stop.wait(0.1)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        source = messages(int(rate * (seconds + warmup_s)) + 1, seed=11)
        t0 = time.time()
        measured_from = t0 + warmup_s
        i = 0
        while time.time() - t0 < seconds + warmup_s:
            due = int((time.time() - t0) * rate) - i
            chunk = []
            for _ in range(max(0, due)):
                _event, message = next(source)
                chunk.append(message)
            if chunk:
                now = time.time()
                if now >= measured_from:
                    for m in chunk:
                        sent[dict(m.headers)[ctx.EVENT_ID].decode()] = now
                bus.append(TOPIC, chunk).result()
                i += len(chunk)
            time.sleep(0.01)
        deadline = time.time() + 60
        while any(e not in seen for e in sent) and time.time() < deadline:
            time.sleep(0.5)
        stop.set()
        poller.join()
        pipeline.stop()
    latencies = sorted(seen[e] - sent[e] for e in sent if e in seen)
    return {
        "rate": rate,
        "seconds": seconds,
        "warmup_s": warmup_s,
        "sent": len(sent),
        "seen": sum(1 for e in sent if e in seen),
        "p50_s": percentile(latencies, 50) if latencies else None,
        "p95_s": percentile(latencies, 95) if latencies else None,
        "p99_s": percentile(latencies, 99) if latencies else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=5000.0)
    parser.add_argument("--stream-seconds", type=float, default=30.0)
    parser.add_argument("--trigger-s", type=float, default=1.0)
    parser.add_argument(
        "--stream-warmup-s",
        type=float,
        default=30.0,
        help="stream mode: seconds of load before the measured window (Spark compiles the "
        "query's code in its first micro-batches; a cold start is not the steady state)",
    )
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--skip-dlt", action="store_true")
    parser.add_argument("--skip-stream", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()

    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import spark_session

    root = bench_directory(args.dir, "bench-pipeline-")
    out: dict[str, Any] = {"machine": machine_info(root)}
    try:
        progress("starting Spark (local[2])")
        spark = spark_session(SparkConfig(master="local[2]"), app_name="headwater-bench")
        if not args.skip_batch:
            out["batch"] = run_batch(spark, root / "batch", args.events)
            values = [e for e, _ in messages(args.events)] if not args.skip_dlt else []
            out["dlt"] = None if args.skip_dlt else run_dlt(root / "dlt", values)
            del values
        if not args.skip_stream:
            out["stream"] = run_stream(
                spark,
                root / "stream",
                args.rate,
                args.stream_seconds,
                args.trigger_s,
                args.stream_warmup_s,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.format == "json":
        emit_json(out)
        return
    report(out)


def report(out: dict[str, Any]) -> None:
    print(f"machine: {out['machine']}")
    b = out.get("batch")
    d = out.get("dlt")
    s = out.get("stream")
    targets = []
    if b:
        rows = [
            [
                "headwater batch (DuckDB)",
                fmt_number(b["events_per_s"]),
                f"{b['seconds']:.1f}",
                f"{b['peak_rss_bytes'] / 2**20:,.0f}",
                f"{b['rows']:,} rows, {b['columns']} columns, {b['batches']} micro-batches",
            ]
        ]
        print(
            "where the batch time goes (seconds, summed over micro-batches): "
            + ", ".join(f"{k} {v:.1f}" for k, v in b["phases_s"].items())
        )
        if d:
            rows.append(
                ["dlt (DuckDB)", fmt_number(d["events_per_s"]), f"{d['seconds']:.1f}", "-", ""]
            )
        print(print_table(["case", "events/s", "seconds", "peak RSS MiB", "landed"], rows))
        targets.append(
            ("batch >= 100k events/s", b["events_per_s"] >= 100_000, fmt_number(b["events_per_s"]))
        )
        if d:
            ratio = b["events_per_s"] / d["events_per_s"]
            print(f"headwater / dlt: {ratio:.2f}x")
            targets.append(("batch >= 3x dlt", ratio >= 3, f"{ratio:.2f}x"))
    if s:
        print(
            f"stream mode at {s['rate']:,.0f} events/s, {s['seconds']:g} s measured after "
            f"{s['warmup_s']:g} s of warm-up: {s['seen']:,} of {s['sent']:,} rows seen; receive "
            f"-> visible p50 {s['p50_s']:.2f} s, p95 {s['p95_s']:.2f} s, p99 {s['p99_s']:.2f} s"
        )
        if s["p95_s"] is not None:
            targets.append(("stream p95 <= 5 s", s["p95_s"] <= 5, f"{s['p95_s']:.2f} s"))
    for name, ok, got in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {got}")


if __name__ == "__main__":
    sys.exit(main())
