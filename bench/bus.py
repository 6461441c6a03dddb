"""Benchmark of the bus: the embedded commit log against the raw disk.

Run from the repository root::

    .venv/bin/python bench/bus.py                 # the full run, about 2 minutes
    .venv/bin/python bench/bus.py --quick         # a smoke run, under 40 s
    .venv/bin/python bench/bus.py --format json   # the same figures as JSON on stdout

What it measures, all in one run and in one temporary directory (under ``./data`` or ``--dir``,
so the log and the disk reference share a filesystem):

* the raw disk: sequential writes of 1 MiB blocks each followed by fdatasync (the reference that
  the ratios use), writes of log-batch-sized chunks with one fdatasync every N chunks where N is
  what group commit achieved (a "mirror" of the log's own I/O pattern);
* the embedded log: records/s and MB/s of 200-byte records in batches of 100 appended by 64
  appenders (the target's count), under ``always`` and ``never`` (no fdatasync: the ceiling of
  the appenders' and the writer's CPU): 64 asyncio tasks awaiting
  ``asyncio.wrap_future(bus.append(...))`` as the collector does; 64 tasks in two processes
  through the collector's link (each process's appends of a loop turn merged, up to 256 KiB,
  each still answered once durable), each append encoded by its appender as the collector's
  workers do, and under ``always`` each process's batch encoded once (the cheapest appenders);
  then reading a topic back.

Targets: ``always`` appends with 64 appenders reach at least 50% of the raw disk MB/s, and reads
reach at least 1M records/s. A miss is profiled with py-spy (``$PY_SPY``, next to this Python
or on ``PATH``). This is not a test: it exits 0 unless it fails. The Kafka bus is measured by
``bench/pipeline.py --bus kafka`` and ``bench/collector.py --bus kafka``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, ClassVar

import uvloop

from _common import (
    MB,
    PY_SPY_MISSING,
    Meter,
    MiB,
    Steal,
    Target,
    ThreadSamples,
    arguments,
    find_py_spy,
    fmt_number,
    machine_info,
    machine_line,
    output,
    percentile,
    print_table,
    progress,
    py_spy_record,
    run_facts,
    sample_process,
    scratch_directory,
)
from headwater.bus.base import Bus
from headwater.bus.embedded import format as log_format
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.embedded.segment import Segment
from headwater.bus.errors import BusUnavailable
from headwater.bus.records import Message

RECORD_BYTES = 200
BATCH_RECORDS = 100
POLICIES = ("always", "never")
READ_MAX_RECORDS = 10_000
APPENDERS = 64  # the target's count
APPEND_TARGET = 0.5  # of the raw disk MB/s
READ_TARGET = 1_000_000  # records/s
LARGE_BLOCK = MiB
PY_SPY_SLACK_S = 1.5
PY_SPY_RATE = 200


# -- results ------------------------------------------------------------------------------------
class Figure:
    """A dataclass of figures whose JSON is its fields and the properties ``JSON`` names (JSON
    key: property)."""

    JSON: ClassVar[tuple[str, ...]] = ()  # "key" or "key:property"

    def as_dict(self) -> dict[str, Any]:
        pairs = [name.partition(":")[::2] for name in self.JSON]
        named = {key: getattr(self, name or key) for key, name in pairs}
        return {**asdict(self), **named}  # type: ignore[call-overload]


class RecordsFigure(Figure):
    """Figures of ``records`` moved in ``seconds``."""

    records: int
    seconds: float

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def payload_mb_s(self) -> float:
        return self.records * RECORD_BYTES / self.seconds / MB


@dataclass
class AppendFigure(RecordsFigure):
    policy: str
    appenders: int
    # "asyncio", "link" (appender processes, as the collector's workers: each append
    # encoded in the appender) or "link-once" (the same, each process's batch encoded once)
    mode: str
    partitions: int
    seconds: float
    appends: int
    records: int
    batch_disk_bytes: int
    fsyncs: int | None
    latency_p50_ms: float
    latency_p99_ms: float
    process_cores: float
    machine_busy: float
    refused: int = 0
    backend: str = "embedded"  # the only one measured here
    ratio_to_raw: float | None = None
    ratio_to_mirror: float | None = None

    @property
    def case(self) -> str:
        if self.mode.startswith("link"):
            workers = f"{self.appenders} tasks in {LINK_PROCESSES} processes via the link"
            workers += ", encoded once" if self.mode == "link-once" else ""
        else:
            workers = f"{self.appenders} task" + ("s" if self.appenders > 1 else "")
        return f"{self.backend} {self.policy} {workers} {self.partitions}p"

    @property
    def disk_mb_s(self) -> float:
        return self.appends * self.batch_disk_bytes / self.seconds / MB

    @property
    def appends_per_fsync(self) -> float | None:
        return self.appends / self.fsyncs if self.fsyncs else None

    JSON = ("case", "records_per_s", "payload_mb_s", "disk_mb_s", "appends_per_fsync")


@dataclass
class ReadFigure(RecordsFigure):
    topic: str
    records: int
    seconds: float
    passes: int
    whole_topic: bool
    process_cores: float
    backend: str = "embedded"  # the only one measured here

    JSON = ("records_per_s", "mb_s:payload_mb_s")


@dataclass
class DiskFigure(Figure):
    name: str
    chunk_bytes: int
    chunks_per_fsync: int
    volume_bytes: int
    seconds: list[float]  # one per repetition
    fsyncs: int

    @property
    def mb_s(self) -> float:
        return self.volume_bytes / median(self.seconds) / MB

    @property
    def fsyncs_per_s(self) -> float:
        return self.fsyncs / median(self.seconds)

    JSON = ("mb_s", "fsyncs_per_s")


@dataclass
class Profile:
    what: str
    unit: str
    records_per_op: int
    note: str = ""
    py_spy: list[ThreadSamples] = field(default_factory=list)  # --gil: who holds the GIL
    py_spy_seconds: int = 0
    py_spy_rate: int = PY_SPY_RATE
    py_spy_ops_per_s: float = 0.0  # appends or read calls per second while py-spy sampled

    def py_spy_us_per_op(self, samples: int) -> float:
        """Microseconds of GIL time per operation that ``samples`` stand for."""
        ops = self.py_spy_ops_per_s * self.py_spy_seconds
        return samples / self.py_spy_rate / ops * 1e6 if ops else float("nan")


# -- counting fdatasync calls of the log ------------------------------------------------------
class SyncCounter:
    """Counts ``Segment.sync`` calls (one fdatasync each) by wrapping the method."""

    def __init__(self) -> None:
        self.count = 0
        self._original: Callable[[Segment], None] = Segment.sync

    def __enter__(self) -> SyncCounter:
        original = self._original

        def counting_sync(segment: Segment) -> None:
            self.count += 1
            original(segment)

        Segment.sync = counting_sync  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Segment.sync = self._original  # type: ignore[method-assign]


# -- the workload ---------------------------------------------------------------------------------
def make_batch() -> list[Message]:
    """100 distinct 200-byte values, no key and no headers."""
    return [Message(os.urandom(RECORD_BYTES)) for _ in range(BATCH_RECORDS)]


def batch_disk_bytes(batch: Sequence[Message]) -> int:
    """The size of one batch as the embedded log writes it (header + columns + values)."""
    return len(log_format.frame(log_format.encode(batch, 0), 0))


@dataclass
class Window:
    appends: int
    latencies: list[float]
    fsyncs: int | None
    meter: Meter
    refused: int  # appends refused with BusUnavailable (backpressure) and retried


BACKPRESSURE_PAUSE_S = 0.001


async def _appends_until(
    end: float, append: Callable[[], Awaitable[object]]
) -> tuple[int, list[float], int]:
    """One appender: ``append`` again and again until ``end``; the appends acked in time,
    their latencies, and how many were refused (then retried after a pause, as a client
    would)."""
    done = refused = 0
    latencies: list[float] = []
    while (t0 := time.perf_counter()) < end:
        try:
            await append()
        except BusUnavailable:  # the log's write queue is full: back off
            refused += 1
            await asyncio.sleep(BACKPRESSURE_PAUSE_S)
            continue
        t1 = time.perf_counter()
        if t1 <= end:
            done += 1
            latencies.append(t1 - t0)
    return done, latencies, refused


async def _append_tasks(
    bus: Bus,
    topic: str,
    batch: list[Message],
    appenders: int,
    seconds: float,
    syncs: SyncCounter | None,
) -> Window:
    """``appenders`` asyncio tasks appending for ``seconds``; counts appends acked in time."""
    meter = Meter()
    start = time.perf_counter()
    end = start + seconds
    meter.start()
    fsync0 = syncs.count if syncs else 0

    def appender() -> Awaitable[tuple[int, list[float], int]]:
        return _appends_until(end, lambda: asyncio.wrap_future(bus.append(topic, batch)))

    async def stopwatch() -> int | None:
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        meter.stop()
        return (syncs.count - fsync0) if syncs else None

    *outcomes, fsyncs = await asyncio.gather(*(appender() for _ in range(appenders)), stopwatch())
    return _window(outcomes, fsyncs, meter)


LINK_PROCESSES = 2  # appender processes in the "link" mode, as the collector's workers


def _append_processes(
    bus: Bus,
    topic: str,
    batch: list[Message],
    appenders: int,
    seconds: float,
    syncs: SyncCounter | None,
    *,
    once: bool = False,
) -> tuple[Window, float]:
    """``appenders`` asyncio tasks spread over ``LINK_PROCESSES`` forked processes, each
    appending through its link to this process's log exactly as the collector's intake
    workers do (``collector.link`` and ``collector.host``: the batch encoded in the appender's
    process, its body in the shared ring, the log's writer here). ``once``: each process
    encodes its batch once and appends those bytes every time, so that the appenders cost as
    little CPU as they can (the raw disk reference has no producer at all). Returns the window
    and the appender processes' CPU cores over it."""
    from headwater.collector.host import LogHost
    from headwater.collector.limits import Connections
    from headwater.collector.ring import shared_mapping

    host = LogHost(bus, Connections(1, 1))
    children: list[tuple[int, int]] = []  # (pid, fd of its result pipe)
    go_r, go_w = os.pipe()
    for i in range(LINK_PROCESSES):
        tasks = appenders // LINK_PROCESSES + (i < appenders % LINK_PROCESSES)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ring = shared_mapping()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the appender process
            code = 1
            try:
                ours.close()
                os.close(out_r)
                os.read(go_r, 1)
                result = uvloop.run(
                    _link_appender(theirs, ring, topic, batch, tasks, seconds, once)
                )
                data = memoryview(json.dumps(result).encode())
                while data:  # a pipe takes at most its buffer per write
                    data = data[os.write(out_w, data) :]
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        os.close(out_w)
        host.attach(i, ours, ring)
        children.append((pid, out_r))
    meter = Meter()
    fsync0 = syncs.count if syncs else 0
    pids = [pid for pid, _ in children]
    cpu0 = sum(sample_process(p).cpu_s for p in pids)
    meter.start()
    os.write(go_w, b"x" * LINK_PROCESSES)
    outcomes: list[tuple[int, list[float], int]] = []
    for _, fd in children:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        os.close(fd)
        done, latencies, refused = json.loads(b"".join(chunks))
        outcomes.append((done, latencies, refused))
    meter.stop()
    cpu = sum(sample_process(p).cpu_s for p in pids) - cpu0
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(go_r)
    os.close(go_w)
    fsyncs = (syncs.count - fsync0) if syncs else None
    host.close()
    return _window(outcomes, fsyncs, meter), cpu / meter.wall_s


async def _link_appender(
    sock: socket.socket,
    ring: Any,
    topic: str,
    batch: list[Message],
    tasks: int,
    seconds: float,
    once: bool,
) -> tuple[int, list[float], int]:
    from headwater.collector.link import Link
    from headwater.collector.ring import Ring

    link = await Link.connect(sock, list, Ring(ring))
    end = time.perf_counter() + seconds

    encoded = log_format.encode(batch, time.time_ns() // 1_000_000) if once else None

    def append() -> Awaitable[list[int]]:
        body = encoded or log_format.encode(batch, time.time_ns() // 1_000_000)
        return link.append([(topic, 0, body)])

    results = await asyncio.gather(*(_appends_until(end, append) for _ in range(tasks)))
    link.close()
    done, latencies, refused = zip(*results, strict=True)
    return sum(done), [x for lats in latencies for x in lats], sum(refused)


def _window(
    outcomes: Sequence[tuple[int, list[float], int]], fsyncs: int | None, meter: Meter
) -> Window:
    latencies = sorted(x for _, lats, _ in outcomes for x in lats)
    appends = sum(n for n, _, _ in outcomes)
    return Window(appends, latencies, fsyncs, meter, sum(r for _, _, r in outcomes))


def measure_appends(
    bus: Bus,
    *,
    policy: str,
    appenders: int,
    mode: str,
    partitions: int,
    seconds: float,
    warmup: float,
    batch: list[Message],
    disk_bytes: int,
    syncs: SyncCounter | None = None,
) -> tuple[AppendFigure, str]:
    """One append case on a fresh topic; returns the figure and the topic's name."""
    topic = re.sub(r"[^A-Za-z0-9._-]", "-", f"bench-{policy}-{appenders}-{mode}-{partitions}p")
    bus.create_topic(topic, partitions)

    os.sync()  # start from a quiet disk: no writeback of earlier cases in this window

    appender_cores = [0.0]

    def run(span: float) -> Window:
        if mode.startswith("link"):
            window, appender_cores[0] = _append_processes(
                bus, topic, batch, appenders, span, syncs, once=mode == "link-once"
            )
            return window
        return uvloop.run(_append_tasks(bus, topic, batch, appenders, span, syncs))

    run(warmup)
    window = run(seconds)
    figure = AppendFigure(
        policy=policy,
        appenders=appenders,
        mode=mode,
        partitions=partitions,
        seconds=window.meter.wall_s,
        appends=window.appends,
        records=window.appends * BATCH_RECORDS,
        batch_disk_bytes=disk_bytes,
        fsyncs=window.fsyncs,
        latency_p50_ms=percentile(window.latencies, 50) * 1000,
        latency_p99_ms=percentile(window.latencies, 99) * 1000,
        process_cores=window.meter.process_cores + appender_cores[0],
        machine_busy=window.meter.machine_busy,
        refused=window.refused,
    )
    progress(
        f"  {figure.case}: {fmt_number(figure.records_per_s)} records/s, "
        f"{fmt_number(figure.payload_mb_s)} MB/s, p99 {fmt_number(figure.latency_p99_ms)} ms"
    )
    return figure, topic


def read_topic(
    bus: Bus, topic: str, partition: int, *, min_seconds: float, max_seconds: float
) -> tuple[int, int, bool]:
    """Read a partition from its start with ``read(..., max_records=10000)``, whole passes until
    ``min_seconds`` have passed (stopping at ``max_seconds``). Returns (records, read calls,
    whether every pass read the whole partition)."""
    low, high = bus.watermarks(topic, partition)
    start = time.perf_counter()
    records = calls = 0
    while True:
        offset = low
        while offset < high:
            got = bus.read(topic, partition, offset, max_records=READ_MAX_RECORDS)
            calls += 1
            if not got:
                break
            records += len(got)
            offset = got[-1].offset + 1
            if time.perf_counter() - start > max_seconds:
                return records, calls, False
        if time.perf_counter() - start >= min_seconds:
            return records, calls, True


def measure_read(bus: Bus, topic: str, *, min_seconds: float, max_seconds: float) -> ReadFigure:
    os.sync()  # no writeback of the appends competing with the read
    meter = Meter()
    meter.start()
    records, _, whole = read_topic(bus, topic, 0, min_seconds=min_seconds, max_seconds=max_seconds)
    meter.stop()
    low, high = bus.watermarks(topic, 0)
    figure = ReadFigure(
        topic=topic,
        records=records,
        seconds=meter.wall_s,
        passes=max(1, records // max(1, high - low)),
        whole_topic=whole,
        process_cores=meter.process_cores,
    )
    progress(
        f"  read {topic}: {fmt_number(figure.records_per_s)} records/s "
        f"({fmt_number(float(records))} records in {meter.wall_s:.2f} s)"
    )
    return figure


# -- the raw disk -------------------------------------------------------------------------------
def disk_sequential(
    directory: Path, name: str, chunk: int, every: int, volume: int, reps: int
) -> DiskFigure:
    """Append ``volume`` bytes in ``chunk``-byte writes to a new file, fdatasync after every
    ``every`` writes (and at the end); the median of ``reps`` repetitions after one discarded
    warm-up. (On this VM the first pass is several times slower: its page cache comes from
    memory the guest has not touched yet, or has handed back to the host through the balloon
    device's free page reporting, and the first touch of such memory is slow. The passes after
    it reuse the pages the one before freed.)"""
    data = os.urandom(chunk)
    count = max(1, volume // chunk)
    times: list[float] = []
    fsyncs = 0
    for rep in range(reps + 1):
        path = directory / f"disk-{rep}.dat"
        os.sync()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        fsyncs = 0
        try:
            t0 = time.perf_counter()
            for i in range(1, count + 1):
                os.write(fd, data)
                if i % every == 0 or i == count:
                    os.fdatasync(fd)
                    fsyncs += 1
            if rep:
                times.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            path.unlink()
    figure = DiskFigure(name, chunk, every, count * chunk, times, fsyncs)
    progress(f"  disk {name}: {fmt_number(figure.mb_s)} MB/s")
    return figure


# -- profiling a miss ---------------------------------------------------------------------
def profile_appends(
    directory: Path, seconds: float, batch: list[Message], disk_bytes: int, py_spy: str | None
) -> Profile:
    """Profile the ``always`` 64-appender case with py-spy ``--gil`` (who holds the GIL)."""
    result = Profile(
        "append: embedded always, 64 asyncio tasks, 1 partition", "append", BATCH_RECORDS
    )
    if not _can_profile(result, py_spy):
        return result
    progress("profiling embedded always, 64 asyncio appenders with py-spy --gil")
    result.py_spy_seconds = max(1, round(seconds))
    config = EmbeddedBusConfig(durability="always", default_partitions=1)
    os.sync()
    with (
        EmbeddedBus(directory / "profile", config) as bus,
        py_spy_record(py_spy, result.py_spy_seconds, rate=PY_SPY_RATE) as result.py_spy,
    ):
        # outlasts py-spy, so that every sample is of the workload
        figure, _ = measure_appends(
            bus,
            policy="always",
            appenders=APPENDERS,
            mode="asyncio",
            partitions=1,
            seconds=result.py_spy_seconds + PY_SPY_SLACK_S,
            warmup=0.2,
            batch=batch,
            disk_bytes=disk_bytes,
        )
    result.py_spy_ops_per_s = figure.appends / figure.seconds
    shutil.rmtree(directory / "profile", ignore_errors=True)
    return result


def profile_reads(bus: Bus, topic: str, seconds: float, py_spy: str | None) -> Profile:
    """Profile reads of ``topic`` with py-spy ``--gil``."""
    result = Profile(
        f"read: embedded, {topic}, read(max_records={READ_MAX_RECORDS})", "read call", 0
    )
    if not _can_profile(result, py_spy):
        return result
    progress(f"profiling reads of {topic} with py-spy --gil")
    result.py_spy_seconds = max(1, round(seconds))
    with py_spy_record(py_spy, result.py_spy_seconds, rate=PY_SPY_RATE) as result.py_spy:
        t0 = time.perf_counter()
        span = result.py_spy_seconds + PY_SPY_SLACK_S
        records, calls, _ = read_topic(bus, topic, 0, min_seconds=span, max_seconds=60)
        result.py_spy_ops_per_s = calls / (time.perf_counter() - t0)
    result.records_per_op = records // max(1, calls)
    return result


def _can_profile(result: Profile, py_spy: str | None) -> bool:
    if py_spy is None:
        result.note = PY_SPY_MISSING
        progress(result.note)
    return py_spy is not None


# -- the phases -----------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    directory: Path
    seconds: float
    warmup: float
    reps: int
    batch: list[Message]
    disk_bytes: int
    appends: list[AppendFigure] = field(default_factory=list)
    reads: list[ReadFigure] = field(default_factory=list)
    disk: list[DiskFigure] = field(default_factory=list)
    raw: DiskFigure | None = None
    targets: list[Target] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    steal: Steal = field(default_factory=Steal)


def embedded_phase(run: Run) -> None:
    read_topic_name = ""
    for policy in POLICIES:
        progress(f"embedded log, durability {policy}")
        config = EmbeddedBusConfig(durability=policy, default_partitions=1)
        directory = run.directory / f"log-{policy}"
        with SyncCounter() as syncs, EmbeddedBus(directory, config) as bus:
            modes = ["asyncio", "link"]  # never: the appenders' ceiling
            if policy == "always":  # the log's durable path with the cheapest appenders
                modes.append("link-once")
            for mode in modes:
                figure, topic = measure_appends(
                    bus,
                    policy=policy,
                    appenders=APPENDERS,
                    mode=mode,
                    partitions=1,
                    seconds=run.seconds,
                    warmup=run.warmup,
                    batch=run.batch,
                    disk_bytes=run.disk_bytes,
                    syncs=syncs,
                )
                run.appends.append(figure)
                if (policy, mode) == ("never", "asyncio"):
                    read_topic_name = topic
            if policy == "never":
                progress("embedded log, reading a topic back")
                s = run.seconds
                figure = measure_read(bus, read_topic_name, min_seconds=s, max_seconds=s * 4)
                run.reads.append(figure)
                if run.args.profile == "always" or (
                    run.args.profile == "auto" and figure.records_per_s < READ_TARGET
                ):
                    run.profiles.append(
                        profile_reads(bus, read_topic_name, run.seconds, find_py_spy())
                    )
        if policy != "never":  # keep the space in check; the read needs the last one
            shutil.rmtree(directory, ignore_errors=True)


def disk_phase(run: Run) -> None:
    """The raw disk, after the log runs so each mirror can copy the I/O pattern of its case."""
    progress("raw disk reference")
    directory = run.directory / "disk"
    directory.mkdir()
    primary = _primary(run)
    volume = min(max(primary.appends * run.disk_bytes if primary else 0, 64 * MiB), 1 << 30)
    run.raw = disk_sequential(
        directory, "1 MiB write + fdatasync", LARGE_BLOCK, 1, volume, run.reps
    )
    run.disk.append(run.raw)
    if primary is not None:  # the log's I/O pattern in its asyncio case
        every = max(1, round(primary.appends_per_fsync or 1))
        mirror = disk_sequential(
            directory,
            f"{run.disk_bytes} B chunks, fdatasync every {every} (mirror of {primary.appenders})",
            run.disk_bytes,
            every,
            min(max(primary.appends * run.disk_bytes, 16 * MiB), 1 << 30),
            run.reps,
        )
        run.disk.append(mirror)
        primary.ratio_to_mirror = primary.disk_mb_s / mirror.mb_s
    for figure in run.appends:
        figure.ratio_to_raw = figure.payload_mb_s / run.raw.mb_s


def _primary(run: Run) -> AppendFigure | None:
    """The ``always`` case of 64 asyncio tasks in this process."""
    return next((f for f in run.appends if (f.policy, f.mode) == ("always", "asyncio")), None)


def _link_cases(run: Run) -> str:
    """The link cases beside the best one: each append encoded by its appender (as the
    collector's intake workers do) under ``always``, and the link cases without any fdatasync
    (``never``): what the appenders and the log's writer reach on this machine's cores when
    durability costs nothing."""
    out = ""
    for f in run.appends:
        if not f.mode.startswith("link") or not f.ratio_to_raw:
            continue
        if f.policy == "always" and f.mode == "link":
            out += (
                f"; each append encoded in its appender, as the collector's workers do: "
                f"{fmt_number(f.payload_mb_s)} MB/s ({f.ratio_to_raw:.1%})"
            )
        elif f.policy == "never":
            out += (
                f"; with no fdatasync at all (never), {f.mode}: "
                f"{fmt_number(f.payload_mb_s)} MB/s ({f.ratio_to_raw:.1%})"
            )
    return out


def check_targets(run: Run) -> None:
    primary = _primary(run)
    if primary is not None and run.raw is not None:
        durable = (f for f in run.appends if f.policy == "always")
        best = max(durable, key=lambda f: f.payload_mb_s)
        run.targets.append(
            Target(
                f"durable appends (always, 64 appenders, 1 partition; best: {best.case})",
                best.payload_mb_s,
                APPEND_TARGET * run.raw.mb_s,
                "MB/s",
                f"{best.payload_mb_s / run.raw.mb_s:.1%} of the raw disk's "
                f"{fmt_number(run.raw.mb_s)} MB/s (target 50%); 64 asyncio tasks in this "
                f"process: {fmt_number(primary.payload_mb_s)} MB/s ({primary.ratio_to_raw:.1%})"
                + _link_cases(run),
            )
        )
    for r in run.reads[:1]:
        run.targets.append(
            Target(
                "reads (embedded, read(max_records=10000) over one partition)",
                r.records_per_s,
                READ_TARGET,
                "records/s",
                f"{fmt_number(float(r.records))} records, page cache warm",
            )
        )


# -- output ---------------------------------------------------------------------------------------
def append_rows(run: Run) -> tuple[list[str], list[list[object]]]:
    headers = ["case", "records/s", "MB/s", "x raw", "x mirror", "fsync/s", "appends/fsync"]
    headers += ["p50 ms", "p99 ms", "cores", "machine"]
    rows: list[list[object]] = []
    for f in run.appends:
        fsyncs_per_s: float | str | None = None
        if f.fsyncs is not None:
            fsyncs_per_s = f.fsyncs / f.seconds if f.fsyncs else "0"
        rows.append(
            [
                f.case,
                f.records_per_s,
                f.payload_mb_s,
                f"{f.ratio_to_raw:.1%}" if f.ratio_to_raw is not None else None,
                f"{f.ratio_to_mirror:.1%}" if f.ratio_to_mirror is not None else None,
                fsyncs_per_s,
                f.appends_per_fsync,
                f.latency_p50_ms,
                f.latency_p99_ms,
                f.process_cores,
                f"{f.machine_busy:.0%}",
            ]
        )
    return headers, rows


def report(run: Run, markdown: bool = False) -> str:
    out = [
        machine_line(machine_info(run.directory)),
        f"workload: {RECORD_BYTES}-byte records (no key, no headers) in batches of "
        f"{BATCH_RECORDS} ({run.disk_bytes} bytes per batch on disk); {run.seconds:g} s per "
        f"case after {run.warmup:g} s of warm-up; the load generator runs in this process, on "
        "the same 2 cores as the log",
        run.steal.line(),
        "",
        f"raw disk (same filesystem, median of {run.reps} run{'s' if run.reps > 1 else ''}):",
    ]
    disk_rows: list[list[object]] = [
        [d.name, d.mb_s, d.fsyncs_per_s, f"{d.volume_bytes / MiB:.0f} MiB"] for d in run.disk
    ]
    out.append(
        print_table(["reference", "MB/s", "fsync/s", "volume"], disk_rows, markdown=markdown)
    )
    out += [
        "",
        "appends (MB/s = record payload, 200 B x records/s; x raw = that / the raw disk's "
        "1 MiB + fdatasync MB/s; x mirror = bytes the log wrote / the mirror of its pattern; "
        "cores = CPU of this process; machine = all CPUs busy):",
    ]
    headers, rows = append_rows(run)
    out.append(print_table(headers, rows, markdown=markdown))
    out += [
        f"  {f.case}: {f.refused} appends refused by backpressure (BusUnavailable) and retried"
        for f in run.appends
        if f.refused
    ]
    out += ["", "reads:"]
    read_rows: list[list[object]] = [
        [
            f"{r.backend} {r.topic}",
            r.records_per_s,
            r.payload_mb_s,
            f"{r.records:,}",
            "yes" if r.whole_topic else "no (time cap)",
            r.process_cores,
        ]
        for r in run.reads
    ]
    headers = ["topic", "records/s", "MB/s", "records read", "whole topic", "cores"]
    out.append(print_table(headers, read_rows, markdown=markdown))
    out += ["", "targets:"]
    out += [f"  {t.verdict()}" for t in run.targets]
    for profile in run.profiles:
        out += ["", *profile_lines(profile)]
    return "\n".join(out)


def profile_lines(profile: Profile) -> list[str]:
    unit = profile.unit
    out = [f"where the time goes: {profile.what}"] + [f"  {profile.note}"] * bool(profile.note)
    ticks = profile.py_spy_seconds * profile.py_spy_rate
    if profile.py_spy:
        out.append(
            f"  py-spy --gil, {profile.py_spy_seconds} s at {profile.py_spy_rate} Hz, "
            f"{fmt_number(profile.py_spy_ops_per_s)} {unit}s/s while sampling ("
            f"{profile.records_per_op} records each). Share of time each thread held the GIL, "
            f"and its innermost frames with ~us of GIL per {unit}:"
        )
    for samples in profile.py_spy:
        share = samples.samples / ticks if ticks else float("nan")
        us = profile.py_spy_us_per_op(samples.samples)
        out.append(
            f"  thread {samples.thread}: held the GIL {share:.0%} of the time, "
            f"~{fmt_number(us)} us per {unit}"
        )
        for function, count in samples.leaves[:8]:
            us = profile.py_spy_us_per_op(count)
            out.append(f"    {count / samples.samples:6.1%}  ~{fmt_number(us)} us  {function}")
    return out


def to_json(run: Run) -> dict[str, Any]:
    return {
        **run_facts(run.directory),
        "steal_share": run.steal.share(),
        "workload": {
            "record_bytes": RECORD_BYTES,
            "batch_records": BATCH_RECORDS,
            "batch_disk_bytes": run.disk_bytes,
            "seconds_per_case": run.seconds,
            "warmup_s": run.warmup,
        },
        "raw_disk": [d.as_dict() for d in run.disk],
        "raw_disk_reference_mb_s": run.raw.mb_s if run.raw else None,
        "appends": [f.as_dict() for f in run.appends],
        "reads": [r.as_dict() for r in run.reads],
        "targets": [t.as_json() for t in run.targets],
        "profiles": [asdict(p) for p in run.profiles],
    }


# -- main ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__, quick="a short run, under 40 s", profile="the target cases")
    parser.add_argument(
        "--seconds", type=float, default=None, help="seconds per case (default 3, --quick 1)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    started = time.perf_counter()
    with scratch_directory(args.dir, "bench-bus-", keep=args.keep) as directory:
        batch = make_batch()
        run = Run(
            args=args,
            directory=directory,
            seconds=seconds,
            warmup=min(0.5, seconds / 4),
            reps=1 if args.quick else 3,
            batch=batch,
            disk_bytes=batch_disk_bytes(batch),
        )
        progress(f"benchmark directory {directory}")
        embedded_phase(run)
        disk_phase(run)
        check_targets(run)
        misses_append = any(not t.passed and t.name.startswith("durable") for t in run.targets)
        if args.profile == "always" or (args.profile == "auto" and misses_append):
            run.profiles.insert(
                0,
                profile_appends(directory, seconds, batch, run.disk_bytes, find_py_spy()),
            )
        progress(f"done in {time.perf_counter() - started:.0f} s")
        output(args.format, lambda: to_json(run), lambda markdown: report(run, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
