"""Benchmark of the PostgreSQL CDC reader (issue 12): changes/s from a logical replication slot
onto the log, against ``pg_recvlogical`` streaming the same changes to /dev/null in the same run.

Run from the repository root::

    .venv/bin/python bench/transport.py                   # 200,000 changes a scenario
    .venv/bin/python bench/transport.py --quick           # 20,000 changes, a smoke run
    .venv/bin/python bench/transport.py --format json     # the figures as JSON on stdout
    .venv/bin/python bench/transport.py --profile         # and py-spy on one more reader run
    .venv/bin/python bench/transport.py --no-mirror       # the reader alone: no Spark, no DuckDB
    .venv/bin/python bench/transport.py --dsn postgresql://user@host/db   # a server of yours

The server: by default a throwaway PostgreSQL 15 cluster on loopback
(``headwater.testing.postgres``: ``wal_level=logical`` and, as for the tests, ``fsync=off``,
``synchronous_commit=off``, ``full_page_writes=off``); ``--dsn`` names a server of your own
(``wal_level=logical``, two free replication slots, three with ``--profile``), where the
benchmark makes and drops its table ``bench_transport_rows``, publication ``bench_transport``
and slots ``bench_transport_*``.

Two scenarios, each over one table of ~200-byte rows (a bigint key, text, numeric,
timestamptz, jsonb) that is not vacuumed during the run:

* ``insert``: ``--changes`` rows inserted in transactions of ``--txn-rows``;
* ``mix``: every inserted row then updated (70%: a numeric column) or deleted (30%), in
  transactions of ``--txn-rows``.

Each scenario makes its replication slots (``pgoutput``) before its changes are written, and the
consumers start only once every change is in the WAL, so each reads the same backlog at full
speed, one after the other, while nothing else is written:

1. the reference: ``pg_recvlogical --start`` from its slot, ``pgoutput`` protocol 1 over the
   publication, to /dev/null, with ``--endpos`` just before the last transaction's commit: it
   exits when it receives that commit. Changes/s = changes / (start to exit), its start and
   connection included.
2. headwater: ``PostgresReader`` (``snapshot: never``, the reader's default batching) in a child
   process, onto an embedded log (durability ``always``: each batch fdatasync'd) in a temporary
   directory under ``./data`` (or ``--dir``). Changes/s = changes / (start to the slot's
   confirmed LSN passing the last commit), its start and connection included: the reader
   confirms an LSN only once the log holds every change before it durably (the slot is polled
   every 10 ms). The log is then checked: it holds every change once (plus the table's schema
   message, one per partition).

Also reported, as cores (CPU seconds / elapsed) and as microseconds a change: the CPU of the
reader's thread and how long it waited, runnable, for a CPU (``/proc``'s schedstat: other work
on the machine shows there), of its process's other threads (the log's writer and syncer), and
of the server's walsender that decodes for each consumer (a local server only); the machine's
CPU use; the reader process's and ``pg_recvlogical``'s peak RSS (VmHWM). ``--profile``
runs the reader once more over the insert backlog (from a third slot) under py-spy and prints
where its thread spends its time; that run is not a measured one.

3. the DuckDB mirror: once both scenarios' logs are written (the readers no longer run),
   a pipeline destination with ``apply: upsert`` (``mode: batch``, the default
   ``max_records_per_trigger``) applies each scenario's log to one DuckDB file, the insert
   scenario's first: the mix's changes land on the table its inserts built (a destination a
   scenario, as each log starts at offset 0). Spark (``local[2]``) runs in this process, is
   started and warmed by a run over the first records of the insert log into a DuckDB file of
   its own beforehand: neither its start nor that run is in a figure. Changes/s = changes /
   ``Pipeline.run_once`` (Trigger.AvailableNow: start of the query to its end). End to end =
   changes / (reader seconds + mirror seconds), against ``pg_recvlogical``: the two run one
   after the other here, never overlapped. The mirror is then checked against the source table
   as it stood after the scenario: rows, sum of the key and sum of ``amount`` (updated by the
   mix) equal on both sides. Also: where each micro-batch's seconds go (timers put around the
   writer's steps in this process: Spark's jobs, the table's DDL, each apply statement, the
   commit), the CPU of the process tree (this process, Spark's JVM, its Python workers) and
   its peak RSS, summed over the tree, during the mirror's runs. ``--no-mirror`` leaves it out.

Target (issue 12): >= 20,000 changes/s onto the log, and the ratio to ``pg_recvlogical``
written down. This is not a test: it always exits 0 unless it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    CLOCK_TICKS,
    MB,
    ProcessSample,
    TreeRss,
    bench_directory,
    emit_json,
    find_py_spy,
    machine_busy_between,
    machine_info,
    parse_py_spy_raw,
    peak_rss,
    print_table,
    progress,
    sample_process,
)
from headwater.testing.proc_tree import tree_pids
from headwater.transport.postgres.reader import lsn_text

TABLE = "bench_transport_rows"
PUBLICATION = "bench_transport"
SLOT_PREFIX = "bench_transport_"
TARGET_PER_S = 20_000
POLL_S = 0.01  # how often a condition is polled (a slot's LSN, a child's exit)
PY_SPY_RATE = 250  # py-spy samples a second
UPDATE_SHARE = 7  # of every 10 rows of the mix, 7 are updated and 3 deleted
SPARK_MASTER = "local[2]"  # the mirror's Spark, as a headwater process's default
WARMUP_RECORDS = 500  # records a partition of the insert log copied for Spark's warm-up run

CREATE_TABLE = f"""
create table {TABLE} (
    id bigint primary key,
    account text not null,
    amount numeric(12, 2) not null,
    status text not null,
    created_at timestamptz not null,
    attrs jsonb not null,
    note text not null
) with (autovacuum_enabled = false)"""

INSERT_ROWS = f"""
insert into {TABLE}
select g,
       'acct-' || lpad((g %% 1000003)::text, 8, '0'),
       round(((g * 7919) %% 1000000) / 100.0, 2),
       (array['new', 'paid', 'shipped', 'refunded'])[1 + g %% 4],
       timestamptz '2026-01-01 00:00:00+00' + g * interval '37 seconds',
       jsonb_build_object('sku', 'sku-' || (g %% 5000), 'qty', 1 + g %% 9,
                          'channel', (array['web', 'app', 'store'])[1 + g %% 3],
                          'gift', g %% 7 = 0),
       md5(g::text) || ' ' || md5((g + 1)::text)
from generate_series(%s::bigint, %s::bigint) g"""

UPDATE_ROWS = (
    f"update {TABLE} set amount = amount + 1 "
    f"where id between %s and %s and id %% 10 < {UPDATE_SHARE}"
)
DELETE_ROWS = f"delete from {TABLE} where id between %s and %s and id %% 10 >= {UPDATE_SHARE}"
# the same on the source and the mirror: the rows, the keys, and the column the mix updates
CHECKSUM = f"select count(*), coalesce(sum(id), 0), coalesce(sum(amount), 0) from {TABLE}"


# -- the source database ----------------------------------------------------------------------
class Source:
    """The benchmark's table, publication and slots on the server, and its workloads."""

    def __init__(self, dsn: str) -> None:
        import psycopg

        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)

    def one(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def prepare(self) -> None:
        level = self.one("show wal_level")
        if level != "logical":
            raise SystemExit(f"the server runs with wal_level={level}; logical is needed")
        self.cleanup()
        self.conn.execute(CREATE_TABLE)
        self.conn.execute(f"create publication {PUBLICATION} for table {TABLE}")

    def cleanup(self) -> None:
        """Drop the benchmark's slots (those not in use), publication and table."""
        self.conn.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
            "where slot_name like %s and not active",
            (SLOT_PREFIX + "%",),
        )
        self.conn.execute(f"drop publication if exists {PUBLICATION}")
        self.conn.execute(f"drop table if exists {TABLE}")

    def create_slot(self, name: str) -> None:
        self.conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))

    def drop_slot(self, name: str) -> None:
        self.conn.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
            "where slot_name = %s and not active",
            (name,),
        )

    def slot(self, name: str) -> tuple[int, int | None]:
        """The slot's confirmed flush LSN (as an integer) and the pid of its walsender."""
        row = self.conn.execute(
            "select confirmed_flush_lsn - '0/0', active_pid from pg_replication_slots "
            "where slot_name = %s",
            (name,),
        ).fetchone()
        if row is None:
            raise RuntimeError(f"replication slot {name} is gone")
        return int(row[0] or 0), row[1]

    def insert(self, first: int, n: int, txn_rows: int) -> tuple[int, int]:
        """Insert rows ``first`` .. ``first + n - 1``; (changes, endpos): endpos is the WAL
        insert position just before the last transaction's commit."""
        end = 0
        for at in range(first, first + n, txn_rows):
            last = min(at + txn_rows, first + n) - 1
            with self.conn.transaction():
                self.conn.execute(INSERT_ROWS, (at, last))
                end = self.one("select pg_current_wal_insert_lsn() - '0/0'")
        return n, int(end)

    def mix(self, first: int, n: int, txn_rows: int) -> tuple[int, int, int]:
        """Update or delete rows ``first`` .. ``first + n - 1``; (updates, deletes, endpos)."""
        updates = deletes = end = 0
        for at in range(first, first + n, txn_rows):
            last = min(at + txn_rows, first + n) - 1
            with self.conn.transaction():
                updates += self.conn.execute(UPDATE_ROWS, (at, last)).rowcount
                deletes += self.conn.execute(DELETE_ROWS, (at, last)).rowcount
                end = self.one("select pg_current_wal_insert_lsn() - '0/0'")
        return updates, deletes, int(end)

    def wait_flushed(self, timeout: float = 60.0) -> None:
        """Wait until the WAL written so far is flushed (walsenders decode only that far)."""
        target = int(self.one("select pg_current_wal_insert_lsn() - '0/0'"))
        poll_until(
            "the WAL to be flushed",
            lambda: int(self.one("select pg_current_wal_flush_lsn() - '0/0'")) >= target,
            timeout,
        )

    def row_bytes(self) -> tuple[float, float]:
        """Average bytes of a row: its text form (what pgoutput sends) and as stored."""
        row = self.conn.execute(
            f"select avg(octet_length(t::text)), avg(pg_column_size(t.*)) from {TABLE} t"
        ).fetchone()
        return float(row[0] or 0), float(row[1] or 0)

    def checksum(self) -> Checksum:
        return Checksum.of(self.conn.execute(CHECKSUM).fetchone())

    def settings(self) -> dict[str, str]:
        names = ("server_version", "fsync", "synchronous_commit", "full_page_writes")
        return {n: str(self.one(f"show {n}")) for n in names}

    def close(self) -> None:
        self.conn.close()


def run_queue_s(pid: int, tid: int) -> float | None:
    """Seconds thread ``tid`` of ``pid`` has waited, runnable, for a CPU (schedstat)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def poll_until(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_S)


# -- child processes --------------------------------------------------------------------------
def reap(proc: subprocess.Popen[bytes], timeout: float) -> resource.struct_rusage | None:
    """Wait up to ``timeout`` for ``proc`` to exit; its resource use, or None if it still runs."""
    if proc.returncode is not None:
        return None
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaped either way."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    if reap(proc, timeout) is None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        reap(proc, 10.0)


class Lines:
    """JSON lines a child writes on its stdout, each read with a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._buffer = b""
        self._eof = False

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next line's object; None when none came within ``timeout`` (0: only look)."""
        deadline = time.monotonic() + timeout
        while True:
            if b"\n" in self._buffer:
                line, _, self._buffer = self._buffer.partition(b"\n")
                message: dict[str, Any] = json.loads(line)
                if "error" in message:
                    raise RuntimeError(f"the reader failed: {message['error']}")
                return message
            if self._eof:
                raise RuntimeError("the reader process exited early (its stderr is above)")
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(left, 0.0))
            if ready:
                chunk = os.read(self._fd, 65536)
                self._buffer += chunk
                self._eof = not chunk
            elif left <= 0:
                return None

    def expect(self, key: str, timeout: float) -> dict[str, Any]:
        message = self.next(timeout)
        if message is None:
            raise TimeoutError(f"the reader process did not say {key!r} within {timeout:.0f} s")
        if key not in message:
            raise RuntimeError(f"the reader process said {message}, not {key!r}")
        return message


# -- the reader's process (``--role reader``) -------------------------------------------------
def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def reader_main(spec_path: Path) -> None:
    """Run a PostgresReader over an embedded log: "go" on stdin starts it, "stop" (or EOF, or
    SIGTERM) stops it; then the log's record count goes to stdout."""
    from headwater.bus.embedded.backend import EmbeddedBus
    from headwater.transport.config import PostgresReaderConfig
    from headwater.transport.postgres.reader import PostgresReader

    def interrupted(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    spec = json.loads(spec_path.read_text())
    config = PostgresReaderConfig.model_validate(spec["config"])
    bus = EmbeddedBus(Path(spec["log"]))
    reader = PostgresReader(config, bus, Path(spec["state"]))
    stop = threading.Event()
    tids: list[int] = []

    def target() -> None:
        tids.append(threading.get_native_id())
        try:
            reader.run(stop)
        except BaseException as e:
            say({"error": f"{type(e).__name__}: {e}"})

    thread = threading.Thread(target=target, name="hw-reader", daemon=True)
    try:
        say({"ready": True})
        if sys.stdin.readline().strip() != "go":
            return
        thread.start()
        while not tids:
            time.sleep(0.001)
        say({"started": True, "reader_tid": tids[0]})
        sys.stdin.readline()  # "stop", or EOF
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(60)
        records, partitions = 0, 0
        for info in bus.topics():
            for p in range(info.partitions):
                low, high = bus.watermarks(info.name, p)
                records += high - low
                partitions += 1
        bus.close()
        say({"done": True, "changes": reader.changes, "records": records, "partitions": partitions})


# -- the runs ---------------------------------------------------------------------------------
@dataclass
class Run:
    """One consumer reading one scenario's backlog."""

    scenario: str
    consumer: str
    changes: int
    seconds: float
    client_cpu_s: float  # the consumer's process, every thread
    walsender_cpu_s: float | None  # the server process decoding for it (None: not readable)
    machine_busy: float  # share of all the machine's CPUs busy during the run
    peak_rss_bytes: int | None
    reader_thread_cpu_s: float | None = None  # headwater: the reader's thread alone
    reader_thread_waiting_s: float | None = None  # runnable, waiting for a CPU (schedstat)
    log_records: int | None = None
    reference_per_s: float | None = None

    @property
    def per_s(self) -> float:
        return self.changes / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ratio(self) -> float | None:
        return self.per_s / self.reference_per_s if self.reference_per_s else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changes_per_s": self.per_s, "ratio_to_reference": self.ratio}


@dataclass
class Scenario:
    name: str
    changes: int
    detail: str
    endpos: int
    slots: dict[str, str]  # consumer -> slot
    workload_s: float
    runs: list[Run] = field(default_factory=list)
    profile: list[dict[str, Any]] = field(default_factory=list)
    log: Path | None = None  # the reader's log, kept for the mirror
    source: Checksum | None = None  # the source table after the scenario
    mirror: dict[str, Any] | None = None


class WalsenderCpu:
    """The CPU time of the walsender serving ``slot``, read from /proc while it runs (it exits
    with its client). None when its process cannot be read (a server on another machine)."""

    def __init__(self, source: Source, slot: str) -> None:
        self._source = source
        self._slot = slot
        self.pid: int | None = None
        self.cpu_s: float | None = None

    def poll(self) -> int:
        """Sample; the slot's confirmed LSN."""
        confirmed, pid = self._source.slot(self._slot)
        if pid is not None:
            self.pid = pid
        if self.pid is not None and os.path.exists(f"/proc/{self.pid}/stat"):
            cpu = sample_process(self.pid).cpu_s
            self.cpu_s = max(cpu, self.cpu_s or 0.0)
        return confirmed


def pg_recvlogical_path() -> str:
    from headwater.testing.postgres import PostgresStartError, postgres_bindir

    with contextlib.suppress(PostgresStartError):
        candidate = postgres_bindir() / "pg_recvlogical"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("pg_recvlogical")
    if not found:
        raise SystemExit("pg_recvlogical not found (apt-get install postgresql-client-15)")
    return found


def run_reference(source: Source, scenario: Scenario, timeout: float) -> Run:
    """pg_recvlogical from its slot to /dev/null until the last commit."""
    slot = scenario.slots["pg_recvlogical"]
    command = [pg_recvlogical_path(), "--dbname", source.dsn, "--slot", slot, "--start"]
    command += ["--option", "proto_version=1", "--option", f"publication_names={PUBLICATION}"]
    command += ["--file", "/dev/null", "--no-loop", "--endpos", lsn_text(scenario.endpos)]
    walsender = WalsenderCpu(source, slot)
    before = sample_process(os.getpid())  # for the machine's jiffies
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        usage = None
        peak = 0
        while usage is None:
            walsender.poll()
            peak = max(peak, peak_rss(proc.pid) or 0)  # VmHWM: ru_maxrss counts the fork
            usage = reap(proc, 0)
            if usage is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pg_recvlogical did not finish within {timeout:.0f} s")
                time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        after = sample_process(os.getpid())
    finally:
        stop_process(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"pg_recvlogical exited with {proc.returncode}")
    return Run(
        scenario=scenario.name,
        consumer="pg_recvlogical -> /dev/null",
        changes=scenario.changes,
        seconds=seconds,
        client_cpu_s=usage.ru_utime + usage.ru_stime,
        walsender_cpu_s=walsender.cpu_s,
        machine_busy=machine_busy_between(before, after),
        peak_rss_bytes=peak or None,
    )


def run_reader(
    source: Source,
    scenario: Scenario,
    slot: str,
    directory: Path,
    timeout: float,
    py_spy: str | None = None,
    log: Path | None = None,
) -> tuple[Run, str]:
    """headwater's PostgresReader in a child process from ``slot`` onto an embedded log (at
    ``log``, kept; else a temporary one) until the slot confirms the last commit; (the run,
    py-spy's raw samples or "")."""
    work = bench_directory(directory, f"reader-{scenario.name}-")
    spec = {
        "config": {
            "id": "bench",
            "type": "postgres",
            "dsn": source.dsn,
            "tables": [f"public.{TABLE}"],
            "slot": slot,
            "publication": PUBLICATION,
            "snapshot": "never",
        },
        "log": str(log or work / "log"),
        "state": str(work / "state"),
    }
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, __file__, "--role", "reader", "--spec", str(spec_path)]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spy: subprocess.Popen[bytes] | None = None
    samples = work / "py-spy.txt"
    try:
        assert proc.stdin is not None
        lines = Lines(proc)
        lines.expect("ready", 60)
        if py_spy:
            spy = start_py_spy(py_spy, proc.pid, samples)
        walsender = WalsenderCpu(source, slot)
        first: ProcessSample = sample_process(proc.pid)
        started = time.perf_counter()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        tid = int(lines.expect("started", 60)["reader_tid"])
        queued = run_queue_s(proc.pid, tid)
        deadline = time.monotonic() + timeout
        while walsender.poll() <= scenario.endpos:
            lines.next(0)  # raises if the reader failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"the reader did not confirm the end within {timeout:.0f} s")
            time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        last = sample_process(proc.pid)
        waited = run_queue_s(proc.pid, tid)
        peak = peak_rss(proc.pid)
        walsender.poll()
        proc.stdin.write(b"stop\n")
        proc.stdin.flush()
        done = lines.expect("done", 90)
        reap(proc, 60)
        raw = finish_py_spy(spy, samples) if spy else ""
    finally:
        stop_process(proc)
        if spy is not None:
            stop_process(spy)
        shutil.rmtree(work, ignore_errors=True)
    if done["changes"] != scenario.changes:
        raise RuntimeError(f"the reader counted {done['changes']} changes, not {scenario.changes}")
    expected = scenario.changes + done["partitions"]  # and one schema message per partition
    if done["records"] != expected:
        raise RuntimeError(f"the log holds {done['records']} records, not {expected}")
    reader_cpu = last.threads.get(tid, ("", 0.0))[1] - first.threads.get(tid, ("", 0.0))[1]
    run = Run(
        scenario=scenario.name,
        consumer="headwater reader -> log (durable)",
        changes=scenario.changes,
        seconds=seconds,
        client_cpu_s=last.cpu_s - first.cpu_s,
        walsender_cpu_s=walsender.cpu_s,
        machine_busy=machine_busy_between(first, last),
        peak_rss_bytes=peak,
        reader_thread_cpu_s=reader_cpu,
        reader_thread_waiting_s=None if waited is None or queued is None else waited - queued,
        log_records=done["records"],
    )
    return run, raw


def start_py_spy(executable: str, pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` (running threads only) until it exits."""
    command = [executable, "record", "--pid", str(pid), "--rate", str(PY_SPY_RATE), "--threads"]
    command += ["--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def finish_py_spy(spy: subprocess.Popen[bytes], out: Path) -> str:
    """py-spy's samples once the process it sampled has exited."""
    if reap(spy, 30) is None:
        with contextlib.suppress(ProcessLookupError):
            spy.send_signal(signal.SIGINT)  # it writes what it has on SIGINT
        reap(spy, 10)
    return out.read_text() if out.exists() else ""


# -- the DuckDB mirror ------------------------------------------------------------------------
@dataclass(frozen=True)
class Checksum:
    """A table's rows, the sum of its key and the sum of ``amount`` (which the mix updates):
    equal on both sides when the mirror holds the source's inserts, updates and deletes."""

    rows: int
    key_sum: int
    amount_sum: Decimal

    @classmethod
    def of(cls, row: Sequence[Any] | None) -> Checksum:
        rows, keys, amount = row or (0, 0, 0)
        return cls(int(rows), int(keys), Decimal(amount))

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "key_sum": self.key_sum, "amount_sum": str(self.amount_sum)}


def mirror_config(data_dir: Path, log: Path, dest_id: str, duckdb: Path) -> Any:
    """A pipeline with one DuckDB mirror destination reading ``log``."""
    from headwater.config.model import HeadwaterConfig

    destination = {"id": dest_id, "type": "duckdb", "path": str(duckdb)}
    destination |= {"apply": "upsert", "mode": "batch"}
    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(data_dir),
            "bus": {"embedded": {"path": str(log)}},
            "pipeline": {"spark": {"master": SPARK_MASTER}, "destinations": [destination]},
        }
    )


def mirror_checksum(duckdb_path: Path) -> Checksum:
    import duckdb

    with duckdb.connect(str(duckdb_path), read_only=True) as con:
        return Checksum.of(con.execute(CHECKSUM).fetchone())


def copy_head(log: Path, into: Path, n: int) -> int:
    """The first ``n`` records of each partition of ``log`` appended to a new log at ``into``
    (schema messages first, as the reader wrote them); how many."""
    from headwater.bus.embedded.backend import EmbeddedBus
    from headwater.bus.records import Message

    copied = 0
    source, target = EmbeddedBus(log, read_only=True), EmbeddedBus(into)
    try:
        for info in source.topics():
            target.create_topic(info.name, info.partitions)
            for p in range(info.partitions):
                records = source.read(info.name, p, 0, max_records=n)
                messages = [
                    Message(r.value, r.key, r.headers, r.timestamp, partition=p) for r in records
                ]
                if messages:
                    target.append(info.name, messages).result(60)
                copied += len(messages)
    finally:
        source.close()
        target.close()
    return copied


def tree_cpu(root: int, exclude: Collection[int]) -> dict[int, float]:
    """CPU seconds of each process of the tree (its own and its reaped children's)."""
    out = {}
    for pid in tree_pids(root, exclude):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = sum(int(x) for x in fields[11:15]) / CLOCK_TICKS
    return out


def _statement(sql: str) -> str:
    """Which step of an apply a statement is (``headwater.transport.apply``)."""
    if "read_parquet" in sql:
        return "load"
    if "ON CONFLICT" in sql:
        return "upsert"
    if sql.startswith("DELETE FROM") and "EXISTS" in sql:
        return "delete"
    if "'truncate'" in sql:
        return "truncate check"
    return "other"  # the ledger, the staged table's drop


class MirrorProbe:
    """Where each micro-batch of the mirror spends its seconds: timers put around the writer's
    steps (in this process, while the probe is entered). Per batch: ``seconds`` (the writer's
    call), ``writer_s`` (its own figure, as its log line), ``spark`` (Spark's jobs: the batch's
    ranges, then the tasks that read the log and stage the changes as Parquet; each apart in
    ``spark_jobs``), ``ddl`` (the table made or widened), ``apply`` (the transaction), and
    within it ``load`` (the staged Parquet into a temporary table), ``truncate check``,
    ``delete``, ``upsert``, ``commit`` and ``other`` (the ledger, the staged files removed);
    outside it ``ledger check`` (the batch done before?) and ``schemas file`` (saved). And
    across them, ``connects`` and ``connect``: the DuckDB file opened (once per call of the
    destination: it lets the file go after each) and the seconds that took."""

    STEPS = ("spark", "ddl", "load", "truncate check", "delete", "upsert", "commit", "other")

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.query_start_s = 0.0  # Pipeline._start: the source's frame, the query started
        self.untimed: list[str] = []  # methods to time that are not there
        self._batch: dict[str, Any] | None = None
        self._in_apply = False
        self._undo: list[Callable[[], None]] = []

    def _add(self, step: str, seconds: float) -> None:
        if self._batch is not None:
            self._batch[step] = self._batch.get(step, 0.0) + seconds

    def _patch(self, cls: type, name: str, wrap: Callable[[Any], Any]) -> None:
        if not hasattr(cls, name):  # renamed in src/: that step goes untimed, said in the JSON
            self.untimed.append(f"{cls.__name__}.{name}")
            return
        own = name in cls.__dict__
        original = getattr(cls, name)
        setattr(cls, name, wrap(original))

        def undo() -> None:
            if own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)

        self._undo.append(undo)

    def _timed(self, step: str, apply_only: bool = False) -> Callable[[Any], Any]:
        def wrap(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if apply_only and not self._in_apply:
                    return original(*args, **kwargs)
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self._add(step, time.perf_counter() - started)

            return timed

        return wrap

    def __enter__(self) -> MirrorProbe:
        try:  # PySpark 4: the DataFrame of a classic (not Connect) session
            from pyspark.sql.classic.dataframe import DataFrame
        except ImportError:
            from pyspark.sql import DataFrame  # type: ignore[assignment]

        from headwater.destinations.duckdb.client import DuckDBDestination, DuckDBSession
        from headwater.destinations.sql import SqlDestination
        from headwater.pipeline.runner import Pipeline
        from headwater.transport.mirror import MirrorWriter, Schemas

        probe = self

        def batch(original: Any) -> Any:
            def call(writer: MirrorWriter, df: Any, batch_id: int) -> None:
                probe._batch = {"batch": batch_id}
                started = time.perf_counter()
                try:
                    original(writer, df, batch_id)
                finally:
                    done = probe._batch
                    probe._batch = None
                    done["seconds"] = time.perf_counter() - started
                    done["at"] = started  # perf_counter: made relative by the caller
                    last = writer.last
                    if last is not None and last.batch_id == batch_id:
                        done |= {"changes": last.changes, "writer_s": last.seconds}
                    probe.batches.append(done)

            return call

        def apply(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                probe._in_apply = True
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    probe._in_apply = False
                    probe._add("apply", time.perf_counter() - started)

            return call

        def execute(original: Any) -> Any:
            def call(session: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
                if not probe._in_apply:
                    return original(session, sql, params)
                started = time.perf_counter()
                try:
                    return original(session, sql, params)
                finally:
                    probe._add(_statement(sql), time.perf_counter() - started)

            return call

        def connect(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    probe._add("connect", time.perf_counter() - started)
                    probe._add("connects", 1)

            return call

        def start(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    probe.query_start_s += time.perf_counter() - started

            return call

        self._patch(Pipeline, "_start", start)
        self._patch(MirrorWriter, "__call__", batch)

        def collect(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - started
                    probe._add("spark", seconds)
                    if probe._batch is not None:
                        probe._batch.setdefault("spark_jobs", []).append(seconds)

            return call

        self._patch(DataFrame, "collect", collect)
        self._patch(SqlDestination, "ensure_mirror", self._timed("ddl"))
        self._patch(SqlDestination, "committed", self._timed("ledger check"))
        self._patch(Schemas, "save", self._timed("schemas file"))
        self._patch(DuckDBDestination, "_connect", connect)
        self._patch(SqlDestination, "apply_changes", apply)
        self._patch(DuckDBSession, "execute", execute)
        self._patch(DuckDBSession, "commit", self._timed("commit", apply_only=True))
        self._patch(DuckDBDestination, "discard_staged", self._timed("other", apply_only=True))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()


def start_spark() -> Any:
    from headwater.pipeline.config import SparkConfig
    from headwater.pipeline.spark import spark_session

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return spark_session(SparkConfig(master=SPARK_MASTER), app_name="headwater-bench-transport")


@contextlib.contextmanager
def pipeline_of(spark: Any, config: Any) -> Iterator[Any]:
    """The config's pipeline; its writers closed after."""
    from headwater.pipeline.runner import Pipeline

    pipeline = Pipeline(config, spark)
    try:
        yield pipeline
    finally:
        for q in pipeline.queries:
            q.writer.close()


def warm_up_spark(spark: Any, log: Path, directory: Path) -> dict[str, Any]:
    """A mirror run over the first records of ``log`` (copied to a log of its own) into a
    DuckDB file of its own: Spark's code compiled, its Python workers started."""
    started = time.perf_counter()
    copied = copy_head(log, directory / "log", WARMUP_RECORDS)
    config = mirror_config(directory, directory / "log", "warmup", directory / "warmup.duckdb")
    with pipeline_of(spark, config) as pipeline:
        pipeline.run_once()
    return {"records": copied, "seconds": time.perf_counter() - started}


def run_mirror(
    spark: Any,
    scenario: Scenario,
    directory: Path,
    duckdb_path: Path,
    exclude: Collection[int],
) -> dict[str, Any]:
    """The scenario's log applied to the mirror in ``duckdb_path`` (which holds what the
    scenarios before it applied); the figures, checked against the source's checksum."""
    assert scenario.log is not None and scenario.source is not None
    config = mirror_config(directory, scenario.log, f"mirror-{scenario.name}", duckdb_path)
    root = os.getpid()
    before, cpu_before = sample_process(root), tree_cpu(root, exclude)
    with (
        pipeline_of(spark, config) as pipeline,
        TreeRss(exclude=exclude) as rss,
        MirrorProbe() as probe,
    ):
        started = time.perf_counter()
        pipeline.run_once()
        seconds = time.perf_counter() - started
    writer = pipeline.queries[0].writer
    after, cpu_after = sample_process(root), tree_cpu(root, exclude)
    mirror = mirror_checksum(duckdb_path)
    reader = next(r for r in scenario.runs if r.reader_thread_cpu_s is not None)
    reference = next(r for r in scenario.runs if r.reader_thread_cpu_s is None)
    end_to_end_s = reader.seconds + seconds
    end_to_end = scenario.changes / end_to_end_s
    in_batches = sum(b["seconds"] for b in probe.batches)
    for b in probe.batches:
        b["at"] -= started  # seconds into run_once
    first, last = probe.batches[:1], probe.batches[-1:]
    return {
        "changes": scenario.changes,
        "seconds": seconds,
        "changes_per_s": scenario.changes / seconds,
        "batches": probe.batches,
        "outside_batches_s": seconds - in_batches,
        "before_first_batch_s": first[0]["at"] if first else seconds,
        "query_start_s": probe.query_start_s,
        "untimed": probe.untimed,
        "after_last_batch_s": seconds - last[0]["at"] - last[0]["seconds"] if last else 0.0,
        "applied": writer.written,
        "failed": writer.failed_events,
        "tree_cpu_s": sum(cpu - cpu_before.get(pid, 0.0) for pid, cpu in cpu_after.items()),
        "machine_busy": machine_busy_between(before, after),
        "peak_rss_bytes": rss.peak,
        "peak_pss_bytes": rss.peak_pss,
        "rss_at_peak": [[name, size] for name, size in rss.at_peak],
        "source": scenario.source.as_dict(),
        "mirror": mirror.as_dict(),
        "equal": mirror == scenario.source and writer.written == scenario.changes,
        "end_to_end_s": end_to_end_s,
        "end_to_end_per_s": end_to_end,
        "end_to_end_ratio": end_to_end / reference.per_s if reference.per_s else None,
    }


def mirror_scenarios(
    scenarios: Sequence[Scenario], directory: Path, exclude: Collection[int]
) -> dict[str, Any]:
    """Start and warm Spark, then apply each scenario's log in order to one DuckDB mirror."""
    progress(f"mirror: starting Spark ({SPARK_MASTER})")
    started = time.perf_counter()
    spark = start_spark()
    spark_s = time.perf_counter() - started
    try:
        assert scenarios and scenarios[0].log is not None
        progress(f"mirror: warming Spark up over the first {WARMUP_RECORDS} records a partition")
        warm = warm_up_spark(spark, scenarios[0].log, directory / "mirror-warmup")
        duckdb_path = directory / "mirror" / "mirror.duckdb"
        for s in scenarios:
            progress(f"{s.name}: the DuckDB mirror over {s.changes:,} changes")
            s.mirror = run_mirror(spark, s, directory / "mirror", duckdb_path, exclude)
            if not s.mirror["equal"]:
                progress(f"{s.name}: the mirror differs from the source: {s.mirror}")
    finally:
        spark.stop()
    return {"master": SPARK_MASTER, "start_s": spark_s, "warmup": warm}


# -- a whole run ------------------------------------------------------------------------------
def measure(
    args: argparse.Namespace, dsn: str, directory: Path, exclude: Collection[int] = ()
) -> dict[str, Any]:
    """Both scenarios, then (unless ``--no-mirror``) the DuckDB mirror over their logs;
    ``exclude``: processes left out of the mirror's process tree (the server)."""
    n, txn_rows = args.changes, args.txn_rows
    timeout = 120 + n / 1000  # at worst 1,000 changes/s, and the start
    py_spy = find_py_spy() if args.profile else None
    if args.profile and not py_spy:
        progress("--profile: py-spy not found; no profile")
    source = Source(dsn)
    scenarios: list[Scenario] = []
    row_text = row_stored = 0.0
    spark: dict[str, Any] | None = None
    try:
        source.prepare()
        settings = source.settings()
        for name in ("insert", "mix"):
            slots = {
                "pg_recvlogical": f"{SLOT_PREFIX}{name}_ref",
                "headwater": f"{SLOT_PREFIX}{name}_hw",
            }
            if py_spy and name == "insert":
                slots["profile"] = f"{SLOT_PREFIX}{name}_profile"
            for slot in slots.values():
                source.create_slot(slot)
            started = time.perf_counter()
            if name == "insert":
                progress(f"insert: {n:,} rows in transactions of {txn_rows:,}")
                changes, endpos = source.insert(1, n, txn_rows)
                detail = f"{n:,} inserts"
            else:
                progress(f"mix: updating or deleting the {n:,} rows, transactions of {txn_rows:,}")
                updates, deletes, endpos = source.mix(1, n, txn_rows)
                changes = updates + deletes
                detail = f"{updates:,} updates, {deletes:,} deletes"
            source.wait_flushed()
            scenario = Scenario(name, changes, detail, endpos, slots, time.perf_counter() - started)
            scenarios.append(scenario)
            if name == "insert":
                row_text, row_stored = source.row_bytes()
            try:
                progress(f"{name}: pg_recvlogical over {changes:,} changes")
                reference = run_reference(source, scenario, timeout)
                scenario.runs.append(reference)
                progress(f"{name}: headwater's reader over {changes:,} changes")
                if not args.no_mirror:
                    scenario.log = directory / f"log-{name}"
                run, _ = run_reader(
                    source, scenario, slots["headwater"], directory, timeout, log=scenario.log
                )
                run.reference_per_s = reference.per_s
                scenario.runs.append(run)
                if "profile" in slots and py_spy:
                    progress(f"{name}: the reader once more, under py-spy (not measured)")
                    _, raw = run_reader(
                        source, scenario, slots["profile"], directory, timeout, py_spy
                    )
                    scenario.profile = profile_summary(raw)
            finally:
                for slot in slots.values():
                    source.drop_slot(slot)
            scenario.source = source.checksum()  # the table as the scenario left it
        if not args.no_mirror:
            spark = mirror_scenarios(scenarios, directory, exclude)
    finally:
        with contextlib.suppress(Exception):
            source.cleanup()
        source.close()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(directory),
        "server": {"dsn_given": bool(args.dsn), **settings},
        "workload": {
            "changes": n,
            "txn_rows": txn_rows,
            "row_text_bytes": row_text,
            "row_stored_bytes": row_stored,
            "update_share": UPDATE_SHARE / 10,
        },
        "scenarios": [
            {
                "name": s.name,
                "changes": s.changes,
                "detail": s.detail,
                "workload_s": s.workload_s,
                "runs": [r.as_dict() for r in s.runs],
                "profile": s.profile,
                "mirror": s.mirror,
            }
            for s in scenarios
        ],
        "spark": spark,
        "end_to_end_duckdb": {
            s.name: {
                "changes_per_s": s.mirror["end_to_end_per_s"],
                "ratio_to_reference": s.mirror["end_to_end_ratio"],
                "mirror_equal": s.mirror["equal"],
            }
            for s in scenarios
            if s.mirror is not None
        }
        or None,
        "target_per_s": TARGET_PER_S,
    }


def profile_summary(raw: str, n: int = 8) -> list[dict[str, Any]]:
    """Per thread of the reader's process that ran (most samples first): the functions most
    often running, and those most often on the stack (the threads' and this script's own
    frames left out)."""
    out = []
    for t in parse_py_spy_raw(raw, 50):
        if not t.leaves:
            continue
        inclusive = [(f, c) for f, c in t.inclusive if not _scaffolding(f)]
        out.append(
            {
                "thread": t.thread,
                "samples": t.samples,
                "self": [{"function": f, "samples": c} for f, c in t.leaves[:n]],
                "inclusive": [{"function": f, "samples": c} for f, c in inclusive[:n]],
            }
        )
    return out


def _scaffolding(function: str) -> bool:
    return "(threading.py" in function or f"({Path(__file__).name}" in function


# -- output -----------------------------------------------------------------------------------
def _cores(cpu_s: float | None, seconds: float) -> str:
    return "-" if cpu_s is None or seconds <= 0 else f"{cpu_s / seconds:.2f}"


def report(result: dict[str, Any], markdown: bool) -> str:
    workload = result["workload"]
    server = result["server"]
    machine = result["machine"]
    rows = []
    for s in result["scenarios"]:
        for r in s["runs"]:
            ratio = r["ratio_to_reference"]
            rows.append(
                [
                    s["name"],
                    r["consumer"],
                    f"{r['changes_per_s']:,.0f}",
                    "1.00" if ratio is None else f"{ratio:.2f}",
                    f"{r['seconds']:.2f}",
                    _cores(r["client_cpu_s"], r["seconds"]),
                    _cores(r["reader_thread_cpu_s"], r["seconds"]),
                    _cores(r["walsender_cpu_s"], r["seconds"]),
                    f"{r['machine_busy'] * 100:.0f}%",
                    "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / MB:.0f}",
                ]
            )
        rows += mirror_rows(s)
    headers = [
        "scenario",
        "consumer",
        "changes/s",
        "x pg_recvlogical",
        "seconds",
        "client cores",
        "reader thread",
        "walsender",
        "machine busy",
        "peak RSS MB",
    ]
    if server["dsn_given"]:
        where = f"PostgreSQL {server['server_version']} at --dsn"
    else:
        where = f"throwaway PostgreSQL {server['server_version']} (headwater.testing.postgres)"
    durability = (
        f"fsync={server['fsync']}, synchronous_commit={server['synchronous_commit']}, "
        f"full_page_writes={server['full_page_writes']}"
    )
    out = [
        f"{where}: {durability}",
        f"{machine['cpus']} CPUs ({machine['cpu_model']}), log on "
        f"{machine['filesystem']['type']} at {machine['directory']}",
        f"{workload['changes']:,} rows of ~{workload['row_text_bytes']:.0f} bytes as text "
        f"({workload['row_stored_bytes']:.0f} stored), transactions of {workload['txn_rows']:,}; "
        + "; ".join(f"{s['name']}: {s['detail']}" for s in result["scenarios"]),
        "",
        print_table(headers, rows, markdown=markdown),
        "",
        "cores = CPU seconds / elapsed: client = the consumer's process (for headwater every "
        "thread: the reader's and the log's), walsender = the server process decoding for it.",
    ]
    out += mirror_report(result, markdown)
    out += where_the_time_goes(result)
    busy = [r["machine_busy"] for s in result["scenarios"] for r in s["runs"]]
    busy += [s["mirror"]["machine_busy"] for s in result["scenarios"] if s["mirror"]]
    if busy and max(busy) > 0.9:
        out.append(
            f"The machine's CPUs were up to {max(busy):.0%} busy during the runs: other work "
            "shared them, so these figures are lower than on a quiet machine."
        )
    for s in result["scenarios"]:
        hw = next((r for r in s["runs"] if r["reader_thread_cpu_s"] is not None), None)
        if hw is None:
            continue
        verdict = "met" if hw["changes_per_s"] >= result["target_per_s"] else "missed"
        out.append(
            f"target >= {result['target_per_s']:,} changes/s onto the log, {s['name']}: "
            f"{hw['changes_per_s']:,.0f} ({verdict})"
        )
    for s in result["scenarios"]:
        for t in s["profile"][:3]:
            out += ["", f"py-spy, {s['name']}, thread {t['thread']}: {t['samples']} samples"]
            out.append(
                print_table(
                    ["running (self)", "samples", "share"],
                    [
                        [f["function"], f["samples"], f"{f['samples'] / t['samples']:.0%}"]
                        for f in t["self"]
                    ],
                    markdown=markdown,
                )
            )
            out.append(
                print_table(
                    ["on the stack (inclusive)", "samples", "share"],
                    [
                        [f["function"], f["samples"], f"{f['samples'] / t['samples']:.0%}"]
                        for f in t["inclusive"]
                    ],
                    markdown=markdown,
                )
            )
    return "\n".join(out)


def mirror_rows(s: dict[str, Any]) -> list[list[str]]:
    """The scenario's rows of the main table for the DuckDB mirror: its apply, end to end."""
    m = s["mirror"]
    if m is None:
        return []
    ratio = m["end_to_end_ratio"]
    return [
        [
            s["name"],
            "mirror: log -> DuckDB (Spark)",
            f"{m['changes_per_s']:,.0f}",
            "-",
            f"{m['seconds']:.2f}",
            _cores(m["tree_cpu_s"], m["seconds"]),
            "-",
            "-",
            f"{m['machine_busy'] * 100:.0f}%",
            f"{m['peak_rss_bytes'] / MB:.0f}",
        ],
        [
            s["name"],
            "end to end: reader + mirror",
            f"{m['end_to_end_per_s']:,.0f}",
            "-" if ratio is None else f"{ratio:.2f}",
            f"{m['end_to_end_s']:.2f}",
            *["-"] * 5,
        ],
    ]


def mirror_report(result: dict[str, Any], markdown: bool) -> list[str]:
    """The mirror's notes, its checks against the source, where its batches' seconds go and
    what held its memory."""
    spark = result["spark"]
    mirrored = [s for s in result["scenarios"] if s["mirror"]]
    if spark is None or not mirrored:
        return ["End to end into the DuckDB mirror: not measured (--no-mirror)."]
    out = [
        f"mirror: a pipeline destination (duckdb, apply: upsert, mode: batch, run_once) over each "
        f"scenario's log, insert then mix into one DuckDB file; Spark {spark['master']} in this "
        f"process, started ({spark['start_s']:.1f} s) and warmed by a run over "
        f"{spark['warmup']['records']:,} records ({spark['warmup']['seconds']:.1f} s) "
        "beforehand: neither is in a figure. Its client cores and peak RSS: the whole process "
        "tree (this process, Spark's JVM, its Python workers). End to end = changes / (reader s "
        "+ mirror s), one after the other.",
    ]
    for s in mirrored:
        m = s["mirror"]
        src, dst = m["source"], m["mirror"]
        out.append(
            f"{s['name']}: mirror equal: {'yes' if m['equal'] else 'no'} (rows {dst['rows']:,} / "
            f"source {src['rows']:,}; sum(id) {dst['key_sum']:,} / {src['key_sum']:,}; "
            f"sum(amount) {dst['amount_sum']} / {src['amount_sum']}; applied {m['applied']:,} "
            f"of {m['changes']:,} changes, {m['failed']} failed)"
        )
    out += ["", "Mirror batches (seconds; the steps timed around the writer's calls):", ""]
    steps = MirrorProbe.STEPS
    rows: list[list[str]] = []
    notes: list[str] = []
    for s in mirrored:
        m = s["mirror"]
        for b in m["batches"]:
            timed = sum(b.get(k, 0.0) for k in ("spark", "ddl", "apply"))
            rows.append(
                [
                    f"{s['name']} {b['batch']}",
                    f"{b.get('changes', 0):,}",
                    f"{b['seconds']:.2f}",
                    *[f"{b[k]:.2f}" if k in b else "-" for k in steps],
                    f"{b['seconds'] - timed:.2f}",
                ]
            )
        rows.append(
            [f"{s['name']} query", "", f"{m['outside_batches_s']:.2f}", *[""] * (len(steps) + 1)]
        )
        notes.append(
            f"{s['name']}: run_once {m['seconds']:.2f} s, of which {m['before_first_batch_s']:.2f}"
            f" before the first batch ({m['query_start_s']:.2f} starting the query: the source's "
            f"frame, writeStream.start; the rest Spark planning the first micro-batch) and "
            f"{m['after_last_batch_s']:.2f} after the last"
        )
    out.append(
        print_table(["batch", "changes", "seconds", *steps, "rest"], rows, markdown=markdown)
    )
    out += [""]
    out.append(
        "spark = Spark's jobs (the batch's ranges; the tasks reading the log and staging the "
        "changes as Parquet); ddl = the table made or widened; load .. commit = the apply's "
        "transaction: the staged Parquet read into a temporary table, the truncate checks, "
        "the deletes, the upsert, the commit (other: the ledger, the staged files removed); "
        "rest = the writer's call outside those (the ledger check, the schemas file); query = "
        "run_once's seconds outside any batch (the query's start, offsets, its checkpoint)."
    )
    for s in mirrored:
        for b in s["mirror"]["batches"]:
            out.append(
                f"{s['name']} batch {b['batch']}: rest includes the ledger check "
                f"{b.get('ledger check', 0.0):.2f} s and the schemas file "
                f"{b.get('schemas file', 0.0):.2f} s; Spark's jobs "
                + " + ".join(f"{x:.2f}" for x in b.get("spark_jobs", []))
                + f" s; the DuckDB file opened {b.get('connects', 0):.0f} times, "
                f"{b.get('connect', 0.0):.2f} s in all (within ledger check, ddl and apply)"
            )
    out += notes
    for s in mirrored:
        m = s["mirror"]
        out.append(
            f"{s['name']}: peak RSS of the tree {m['peak_rss_bytes'] / MB:.0f} MB "
            f"(PSS {m['peak_pss_bytes'] / MB:.0f}), MB: {rss_groups(m['rss_at_peak'])}"
        )
    return out


def rss_groups(at_peak: Sequence[Sequence[Any]]) -> str:
    """The processes at the peak by kind: how many, their RSS summed, largest first."""
    groups: dict[str, list[int]] = {}
    for name, size in at_peak:
        if name == "java":
            kind = "Spark's JVM"
        elif Path(__file__).name in name:
            kind = "this process"
        elif name.endswith("pyspark.worker"):
            kind = "Python workers"
        elif "pyspark.sql" in name:  # pyspark.sql.worker.*, the streaming source's runner
            kind = "Python data source workers"
        else:
            kind = name
        count_size = groups.setdefault(kind, [0, 0])
        count_size[0] += 1
        count_size[1] += size
    ranked = sorted(groups.items(), key=lambda g: -g[1][1])
    return ", ".join(
        f"{kind}{f' x{n}' if n > 1 else ''} {size / MB:.0f}" for kind, (n, size) in ranked
    )


def where_the_time_goes(result: dict[str, Any]) -> list[str]:
    """Per scenario, microseconds of CPU and of wall time a change, per process."""

    def us(seconds: float | None, changes: int) -> str:
        return "-" if seconds is None else f"{seconds / changes * 1e6:.1f}"

    out = ["", "Where the time goes (microseconds a change):"]
    for s in result["scenarios"]:
        runs = {("hw" if r["reader_thread_cpu_s"] is not None else "ref"): r for r in s["runs"]}
        ref, hw = runs.get("ref"), runs.get("hw")
        parts = []
        if hw is not None:
            n = hw["changes"]
            others = hw["client_cpu_s"] - hw["reader_thread_cpu_s"]
            parts.append(
                f"headwater {us(hw['seconds'], n)} elapsed: reader thread "
                f"{us(hw['reader_thread_cpu_s'], n)} CPU and "
                f"{us(hw['reader_thread_waiting_s'], n)} waiting for a CPU, its process's other "
                f"threads (the log) {us(others, n)} CPU, walsender {us(hw['walsender_cpu_s'], n)}"
            )
        if ref is not None:
            n = ref["changes"]
            parts.append(
                f"pg_recvlogical {us(ref['seconds'], n)} elapsed: its process "
                f"{us(ref['client_cpu_s'], n)} CPU (its start included), walsender "
                f"{us(ref['walsender_cpu_s'], n)}"
            )
        out.append(f"  {s['name']}: " + "; ".join(parts))
    return out


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["reader"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--changes", type=int, default=None, help="changes a scenario (default 200,000)"
    )
    parser.add_argument("--quick", action="store_true", help="20,000 changes a scenario")
    parser.add_argument("--txn-rows", type=int, default=1000, help="rows per transaction")
    parser.add_argument("--dsn", default=None, help="a server of yours (default: a throwaway one)")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy on one more reader run (insert)"
    )
    parser.add_argument(
        "--no-mirror", action="store_true", help="leave the DuckDB mirror (and Spark) out"
    )
    parser.add_argument(
        "--format", choices=("text", "markdown", "json"), default="text", help="output format"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="parent of the temporary directory (./data)"
    )
    args = parser.parse_args(argv)
    if args.changes is None:
        args.changes = 20_000 if args.quick else 200_000
    if args.changes < 1 or args.txn_rows < 1:
        parser.error("--changes and --txn-rows must be at least 1")
    return args


@contextlib.contextmanager
def _server(dsn: str | None) -> Iterator[tuple[str, list[int]]]:
    """The server's DSN, and its postmaster's pid when it runs here."""
    if dsn:
        yield dsn, []
        return
    from headwater.testing.postgres import start_postgres

    progress("starting a throwaway PostgreSQL (fsync off, as for the tests)")
    with start_postgres() as pg:
        yield pg.dsn, [pg.pid]


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "reader":
        reader_main(args.spec)
        return 0
    signal.signal(signal.SIGTERM, _terminated)  # clean up as on Ctrl-C
    directory = bench_directory(args.dir, "bench-transport-")
    started = time.perf_counter()
    try:
        with _server(args.dsn) as (dsn, server):
            result = measure(args, dsn, directory, server)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    if args.format == "json":
        emit_json(result)
    else:
        print(report(result, markdown=args.format == "markdown"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
