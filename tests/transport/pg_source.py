"""Helpers of the PostgreSQL reader tests: a scratch source database, a reader on its own thread
over an embedded log, and the messages the log holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.transport.config import PostgresReaderConfig
from headwater.transport.message import Change, Mode, decode
from headwater.transport.postgres.reader import PostgresReader

_FAILED: list[BaseException] = []  # the error of the reader ``running`` runs, if it failed


def execute(dsn: str, *statements: str, params: Any = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for s in statements:
            c.execute(s, params)


def slot_of(dsn: str) -> str:
    """The test reader's slot: slots are per cluster, and each test has its own database."""
    return f"s_{dsn.rsplit('/', 1)[1]}"


def reader_config(dsn: str, **fields: Any) -> PostgresReaderConfig:
    body: dict[str, Any] = {
        "id": "src",
        "type": "postgres",
        "dsn": dsn,
        "tables": r"public\..*",
        "heartbeat_s": 0.5,
        "linger_ms": 5,
        "partitions": 1,  # one order to assert on; test_partitions checks several
        "slot": slot_of(dsn),
    }
    body.update(fields)
    return PostgresReaderConfig.model_validate(body)


@contextmanager
def running(
    config: PostgresReaderConfig, bus: EmbeddedBus, state_dir: Path
) -> Iterator[PostgresReader]:
    """The reader running on a thread; stopped (and its errors raised) on exit."""
    reader = PostgresReader(config, bus, state_dir)
    stop = threading.Event()
    errors = _FAILED
    errors.clear()

    def target() -> None:
        try:
            reader.run(stop)
        except BaseException as e:  # raised again on the test's thread
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield reader
        if errors:
            raise errors[0]
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the reader did not stop within 30 s"
    if errors:
        raise errors[0]


def messages(bus: EmbeddedBus, prefix: str = "cdc.src.") -> list[tuple[Change, Mode]]:
    """Every transport message on the reader's topics, topic by topic, in log order."""
    out = []
    for info in bus.topics():
        if not info.name.startswith(prefix):
            continue
        for p in range(info.partitions):
            low, high = bus.watermarks(info.name, p)
            offset = low
            while offset < high:
                records = bus.read(info.name, p, offset, max_records=10_000)
                out.extend(decode(r) for r in records)
                offset = records[-1].offset + 1
    return out


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``check()``'s first truthy value; fails naming ``what`` at the deadline, or at once with
    the error of a running reader that failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if _FAILED:
            raise AssertionError(f"the reader failed while waiting for {what}") from _FAILED[0]
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def slot_confirmed(dsn: str, slot: str) -> int:
    """The slot's confirmed flush LSN as an integer (0 when none)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "select confirmed_flush_lsn - '0/0' from pg_replication_slots where slot_name = %s",
            (slot,),
        ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def wait_caught_up(dsn: str, slot: str, timeout: float) -> None:
    """Wait until the reader of ``slot`` acknowledged everything written to the WAL so far."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("select pg_logical_emit_message(false, 'end', '')")  # a last position
        row = c.execute("select pg_current_wal_lsn() - '0/0'").fetchone()
    assert row is not None
    end = int(row[0])
    wait_until("the reader caught up", lambda: slot_confirmed(dsn, slot) >= end, timeout)


def drop_slots(dsn: str) -> None:
    """Drop the replication slots of ``dsn``'s database (a cluster has few)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots "
            "where database = current_database() and not active"
        )
