"""Benchmark of the Spark source's read path: the embedded log read into Arrow record batches in
the layout of Spark's Kafka source, without Spark.

Run from the repository root::

    .venv/bin/python bench/source.py                   # 1M events, about a minute
    .venv/bin/python bench/source.py --events 200000   # quicker
    .venv/bin/python bench/source.py --format json     # the same figures as JSON on stdout

What it measures, in one run, on ``--events`` clickstream events (``bench/pipeline.py``'s: JSON
values of ~700 bytes, a user id key, the collector's 8 context headers; a pool of distinct
events repeated) appended ``--batch-records`` at a time (the collector appends a request's events
together) to one partition of an embedded log in a temporary directory, then read back whole
through a read-only bus, as the Spark source's tasks do, with the files in the page cache:

* the reference, the source's old path: ``bus.read(max_records=8192)``, which builds a Python
  ``Record`` per record, then ``headwater.bus.arrow.to_record_batch`` over them;
* ``bus.read_arrow(max_records=32768)``, the columnar decode the source uses now, which builds
  Arrow batches of up to 16,384 rows from consecutive stored batches smaller than 1 MiB (and a
  larger one alone);
* the same with every stored batch built alone (``ALONE_BYTES`` = 0), to show what building
  several together is worth for stored batches of ``--batch-records`` records;
* the floor: ``os.pread`` of the segment files in 1 MiB reads, nothing decoded, no checksums.

Each path reads the whole partition ``--passes`` times, the paths taking turns; the best pass
counts. MB/s is the
segment files' bytes over the time. This is not a test: it always exits 0 unless it fails.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from _common import MB, bench_directory, emit_json, machine_info, print_table, progress
from headwater.bus.arrow import ARROW_SCHEMA, to_record_batch
from headwater.bus.embedded import arrow as log_arrow
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from pipeline import messages

TOPIC = "events-track"
POOL = 20_000  # distinct events, repeated up to --events
READ_CHUNK = 8_192  # the old source's records per read
ARROW_CHUNK = 32_768  # the source's records per read_arrow (read_range's CHUNK)
FILE_CHUNK = 1 << 20


@dataclass
class Figure:
    path: str
    records: int
    seconds: float  # the best pass
    log_bytes: int
    arrow_batches: int
    reference_seconds: float = 0.0

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def mb_s(self) -> float:
        return self.log_bytes / self.seconds / MB

    @property
    def us_per_record(self) -> float:
        return self.seconds / self.records * 1e6

    @property
    def ratio(self) -> float:
        return self.reference_seconds / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "records_per_s": self.records_per_s,
            "mb_s": self.mb_s,
            "us_per_record": self.us_per_record,
            "ratio_to_reference": self.ratio,
        }


# -- the log ------------------------------------------------------------------------------
def fill(directory: Path, events: int, batch_records: int) -> None:
    """Append ``events`` events to partition 0 of ``TOPIC``, ``batch_records`` per append."""
    pool = [m._replace(partition=0) for m in itertools.islice(messages(POOL), POOL)]
    stream = itertools.islice(itertools.cycle(pool), events)
    config = EmbeddedBusConfig(durability="never", default_partitions=1)
    with EmbeddedBus(directory, config) as bus:
        bus.create_topic(TOPIC, 1)
        while chunk := list(itertools.islice(stream, batch_records)):
            bus.append(TOPIC, chunk).result()


def segment_files(directory: Path) -> list[Path]:
    return sorted((directory / "topics" / TOPIC / "0").glob("*.log"))


# -- the paths ----------------------------------------------------------------------------
def read_records(bus: EmbeddedBus) -> Iterator[pa.RecordBatch]:
    """The reference: records, then Arrow (the source before ``read_arrow``)."""
    offset, end = bus.watermarks(TOPIC, 0)
    while offset < end:
        records = bus.read(TOPIC, 0, offset, max_records=READ_CHUNK)
        yield to_record_batch(records)
        offset = records[-1].offset + 1


def read_arrow(bus: EmbeddedBus) -> Iterator[pa.RecordBatch]:
    """``read_arrow`` as the source's ``read_range`` calls it."""
    offset, end = bus.watermarks(TOPIC, 0)
    while offset < end:
        batches = bus.read_arrow(TOPIC, 0, offset, end, max_records=ARROW_CHUNK)
        yield from batches
        offset = batches[-1]["offset"][-1].as_py() + 1


def read_arrow_alone(bus: EmbeddedBus) -> Iterator[pa.RecordBatch]:
    """``read_arrow`` with every stored batch built alone (zero-copy), none together."""
    alone_from = log_arrow.ALONE_BYTES
    log_arrow.ALONE_BYTES = 0
    try:
        yield from read_arrow(bus)
    finally:
        log_arrow.ALONE_BYTES = alone_from


def read_files(files: Sequence[Path]) -> Iterator[int]:
    """The floor: the segment files' bytes, read and dropped."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while data := os.pread(fd, FILE_CHUNK, at):
                at += len(data)
                yield len(data)
        finally:
            os.close(fd)


ReadPath = tuple[str, Callable[[], Iterator[Any]]]


def best_passes(paths: Sequence[ReadPath], passes: int) -> list[tuple[float, int]]:
    """Per path, the fastest of ``passes`` runs and how many items a run yields. The paths take
    turns, a pass each, so that a slow spell of the machine or the memory one path leaves
    behind does not weigh on one path only."""
    best = [float("inf")] * len(paths)
    items = [0] * len(paths)
    for n in range(passes):
        progress(f"pass {n + 1} of {passes}")
        for i, (_, run) in enumerate(paths):
            started = time.perf_counter()
            items[i] = sum(1 for _ in run())
            best[i] = min(best[i], time.perf_counter() - started)
    return list(zip(best, items, strict=True))


def check_equal(bus: EmbeddedBus, events: int) -> None:
    """The two paths give the same table (on the first 100,000 records, to keep it short)."""
    n = min(events, 100_000)
    new = pa.Table.from_batches(bus.read_arrow(TOPIC, 0, 0, n, max_records=n), ARROW_SCHEMA)
    old = pa.Table.from_batches(itertools.islice(read_records(bus), -(-n // READ_CHUNK)))
    if not new.equals(old.slice(0, n)):
        raise SystemExit("read_arrow and read + to_record_batch disagree")


def measure(directory: Path, events: int, passes: int) -> list[Figure]:
    files = segment_files(directory)
    log_bytes = sum(p.stat().st_size for p in files)
    figures = []
    with EmbeddedBus(directory, EmbeddedBusConfig(), read_only=True) as bus:
        check_equal(bus, events)
        paths: list[ReadPath] = [
            ("read + to_record_batch (reference)", lambda: read_records(bus)),
            ("read_arrow", lambda: read_arrow(bus)),
            ("read_arrow, every stored batch alone", lambda: read_arrow_alone(bus)),
            ("os.pread of the files (floor)", lambda: read_files(files)),
        ]
        for (name, _), (seconds, items) in zip(paths, best_passes(paths, passes), strict=True):
            batches = 0 if name.startswith("os.pread") else items
            figures.append(Figure(name, events, seconds, log_bytes, batches))
    for figure in figures:
        figure.reference_seconds = figures[0].seconds
    return figures


# -- output -------------------------------------------------------------------------------
def report(args: argparse.Namespace, figures: Sequence[Figure], markdown: bool) -> str:
    rows = [
        [
            f.path,
            f.records_per_s,
            f.mb_s,
            f.us_per_record,
            f"{f.arrow_batches:,}" if f.arrow_batches else "-",
            f"{f.ratio:.2f}x",
        ]
        for f in figures
    ]
    headers = ["path", "records/s", "MB/s", "us/record", "Arrow batches", "x reference"]
    log_mb = figures[0].log_bytes / MB
    return "\n".join(
        [
            f"{args.events:,} events, {args.batch_records} per stored batch, one partition, "
            f"{log_mb:,.0f} MB of segment files (page cache), best of {args.passes} passes:",
            print_table(headers, rows, markdown=markdown),
        ]
    )


def to_json(args: argparse.Namespace, directory: Path, figures: Sequence[Figure]) -> Any:
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(directory),
        "workload": {
            "events": args.events,
            "batch_records": args.batch_records,
            "passes": args.passes,
        },
        "figures": [f.as_dict() for f in figures],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events on the log")
    parser.add_argument(
        "--batch-records", type=int, default=1000, help="events per append (stored batch)"
    )
    parser.add_argument("--passes", type=int, default=3, help="reads of the whole log per path")
    parser.add_argument(
        "--format", choices=("text", "markdown", "json"), default="text", help="output format"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="parent of the temporary directory (./data)"
    )
    return parser.parse_args(argv)


@contextmanager
def _directory(parent: Path | None) -> Iterator[Path]:
    directory = bench_directory(parent, "bench-source-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with _directory(args.dir) as directory:
        progress(f"appending {args.events:,} events to {directory}")
        started = time.perf_counter()
        fill(directory, args.events, args.batch_records)
        progress(f"appended in {time.perf_counter() - started:.1f} s")
        figures = measure(directory, args.events, args.passes)
        if args.format == "json":
            emit_json(to_json(args, directory, figures))
        else:
            print(report(args, figures, markdown=args.format == "markdown"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
