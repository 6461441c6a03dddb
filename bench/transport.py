"""Benchmark of the PostgreSQL CDC reader (issue 12): changes/s from a logical replication slot
onto the log, against ``pg_recvlogical`` streaming the same changes to /dev/null in the same run.

Run from the repository root::

    .venv/bin/python bench/transport.py                   # 200,000 changes a scenario
    .venv/bin/python bench/transport.py --quick           # 20,000 changes, a smoke run
    .venv/bin/python bench/transport.py --format json     # the figures as JSON on stdout
    .venv/bin/python bench/transport.py --profile         # and py-spy on one more reader run
    .venv/bin/python bench/transport.py --dsn postgresql://user@host/db   # a server of yours

The server: a throwaway PostgreSQL 15 on loopback (``headwater.testing.postgres``: logical WAL,
``fsync``, ``synchronous_commit`` and ``full_page_writes`` off, as for the tests), or yours at
``--dsn`` (logical WAL, two free slots, three with ``--profile``), where the benchmark makes and
drops table ``bench_transport_rows``, publication ``bench_transport``, slots
``bench_transport_*``.

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

Also reported, as cores and as microseconds a change: the reader thread's CPU and its wait
for a CPU (schedstat), its process's other threads (the log's), the walsender decoding for each
consumer (a local server only), the machine; peak RSS (VmHWM) of both consumers. ``--profile``
runs the reader once more (a third slot, not measured) under py-spy.

Target (issue 12): >= 20,000 changes/s onto the log, and the ratio to ``pg_recvlogical``
written down. This is not a test: it always exits 0 unless it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    MB,
    ChildLines,
    ProcessSample,
    arguments,
    bench_directory,
    find_py_spy,
    machine_busy_between,
    output,
    parse_py_spy_raw,
    peak_rss,
    print_table,
    progress,
    py_spy_samples,
    run_facts,
    sample_process,
    say,
    scratch_directory,
    start_py_spy,
)
from headwater.transport.postgres.reader import lsn_text

TABLE = "bench_transport_rows"
PUBLICATION = "bench_transport"
SLOT_PREFIX = "bench_transport_"
TARGET_PER_S = 20_000
POLL_S = 0.01  # how often a condition is polled (a slot's LSN, a child's exit)
PY_SPY_RATE = 250  # py-spy samples a second
UPDATE_SHARE = 7  # of every 10 rows of the mix, 7 are updated and 3 deleted
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

    def in_transactions(self, first: int, n: int, txn_rows: int, *sql: str) -> list[int]:
        """Run each of ``sql`` over rows ``first`` .. ``first + n - 1``, ``txn_rows`` rows a
        transaction: the rows each statement changed, then endpos (the WAL insert position
        just before the last transaction's commit)."""
        counts, end = [0] * len(sql), 0
        for at in range(first, first + n, txn_rows):
            last = min(at + txn_rows, first + n) - 1
            with self.conn.transaction():
                for i, statement in enumerate(sql):
                    counts[i] += self.conn.execute(statement, (at, last)).rowcount
                end = self.one("select pg_current_wal_insert_lsn() - '0/0'")
        return [*counts, int(end)]

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


# -- the reader's process (``--role reader``) -------------------------------------------------
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
) -> tuple[Run, str]:
    """headwater's PostgresReader in a child process from ``slot`` onto a temporary embedded log
    until the slot confirms the last commit; (the run,
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
        "log": str(work / "log"),
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
        lines = ChildLines(proc)
        lines.expect("ready", 60)
        if py_spy:
            spy = start_py_spy(py_spy, proc.pid, samples, rate=PY_SPY_RATE)
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
        raw = py_spy_samples(spy, samples, 30) if spy else ""
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


# -- a whole run ------------------------------------------------------------------------------
def measure(args: argparse.Namespace, dsn: str, directory: Path) -> dict[str, Any]:
    """Both scenarios: each one's changes, then its consumers over them."""
    n, txn_rows = args.changes, args.txn_rows
    timeout = 120 + n / 1000  # at worst 1,000 changes/s, and the start
    py_spy = find_py_spy() if args.profile else None
    if args.profile and not py_spy:
        progress("--profile: py-spy not found; no profile")
    source = Source(dsn)
    scenarios: list[Scenario] = []
    row_text = row_stored = 0.0
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
                changes, endpos = source.in_transactions(1, n, txn_rows, INSERT_ROWS)
                detail = f"{n:,} inserts"
            else:
                progress(f"mix: updating or deleting the {n:,} rows, transactions of {txn_rows:,}")
                updates, deletes, endpos = source.in_transactions(
                    1, n, txn_rows, UPDATE_ROWS, DELETE_ROWS
                )
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
                run, _ = run_reader(source, scenario, slots["headwater"], directory, timeout)
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
    finally:
        with contextlib.suppress(Exception):
            source.cleanup()
        source.close()
    return {
        **run_facts(directory),
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
            }
            for s in scenarios
        ],
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
CORES = ("client_cpu_s", "reader_thread_cpu_s", "walsender_cpu_s")  # a run's CPU, as cores


def _cores(cpu_s: float | None, seconds: float) -> str:
    return "-" if cpu_s is None or seconds <= 0 else f"{cpu_s / seconds:.2f}"


def report(result: dict[str, Any], markdown: bool) -> str:
    workload = result["workload"]
    server = result["server"]
    machine = result["machine"]
    headers = ["scenario", "consumer", "changes/s", "x pg_recvlogical", "seconds"]
    headers += ["client cores", "reader thread", "walsender", "machine busy", "peak RSS MB"]
    rows = [
        [
            s["name"],
            r["consumer"],
            f"{r['changes_per_s']:,.0f}",
            "1.00" if r["ratio_to_reference"] is None else f"{r['ratio_to_reference']:.2f}",
            f"{r['seconds']:.2f}",
            *(_cores(r[k], r["seconds"]) for k in CORES),
            f"{r['machine_busy'] * 100:.0f}%",
            "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / MB:.0f}",
        ]
        for s in result["scenarios"]
        for r in s["runs"]
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
    out += where_the_time_goes(result)
    busy = [r["machine_busy"] for s in result["scenarios"] for r in s["runs"]]
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
            for key, title in (("self", "running (self)"), ("inclusive", "on the stack")):
                rows = [[f["function"], f["samples"], f["samples"] / t["samples"]] for f in t[key]]
                share = [[f, n, f"{x:.0%}"] for f, n, x in rows]
                out.append(print_table([title, "samples", "share"], share, markdown=markdown))
    return "\n".join(out)


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
    parser = arguments(__doc__, quick="20,000 changes a scenario", keep=False)
    parser.add_argument("--role", choices=["reader"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--changes", type=int, default=None, help="changes a scenario (default 200,000)"
    )
    parser.add_argument("--txn-rows", type=int, default=1000, help="rows per transaction")
    parser.add_argument("--dsn", default=None, help="a server of yours (default: a throwaway one)")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy on one more reader run (insert)"
    )
    args = parser.parse_args(argv)
    if args.changes is None:
        args.changes = 20_000 if args.quick else 200_000
    if args.changes < 1 or args.txn_rows < 1:
        parser.error("--changes and --txn-rows must be at least 1")
    return args


@contextlib.contextmanager
def _server(dsn: str | None) -> Iterator[str]:
    """The server's DSN: ``dsn``, or a throwaway server's."""
    if dsn:
        yield dsn
        return
    from headwater.testing.postgres import start_postgres

    progress("starting a throwaway PostgreSQL (fsync off, as for the tests)")
    with start_postgres() as pg:
        yield pg.dsn


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "reader":
        reader_main(args.spec)
        return 0
    signal.signal(signal.SIGTERM, _terminated)  # clean up as on Ctrl-C
    started = time.perf_counter()
    with scratch_directory(args.dir, "bench-transport-") as directory, _server(args.dsn) as dsn:
        result = measure(args, dsn, directory)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    output(args.format, lambda: result, lambda markdown: report(result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
