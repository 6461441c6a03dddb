"""The files reader against the embedded log: JSON lines, CSV and Parquet rows land once, in order
per file; appended lines are picked up and a partial line waits for its newline; bad lines are
counted and skipped; a restart resumes without duplicates, also when the state file is behind the
log; and a reader SIGKILLed again and again while it appends leaves every row exactly once."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.transport import reader_harness as harness
from tests.transport.reader_harness import (
    BUS_CONFIG,
    LAUNCHERS,
    Killed,
    dies_on_save,
    kill,
    read_all,
    start_child,
    wait_until,
)

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.transport.config import FilesReaderConfig
from headwater.transport.files.reader import FilesReader, json_row, plain
from headwater.transport.message import Change, Mode, Op, decode
from headwater.transport.reader import read_json, read_status, write_json

READER = "files"


# -- helpers ----------------------------------------------------------------------------------


def make_config(directory: Path, fmt: str = "jsonl", **fields: Any) -> FilesReaderConfig:
    body = {"id": READER, "type": "files", "path": directory, "format": fmt, "poll_s": 0.02}
    return FilesReaderConfig.model_validate({**body, **fields})


def log_changes(bus: EmbeddedBus) -> dict[str, list[Change]]:
    """The reader's changes on the log by namespace, in log order; every namespace must be in one
    partition."""
    out: dict[str, list[Change]] = {}
    where: dict[str, tuple[str, int]] = {}
    for info in bus.topics():
        if not info.name.startswith(f"cdc.{READER}."):
            continue
        for partition in range(info.partitions):
            for record in read_all(bus, info.name, partition):
                change, mode = decode(record)
                assert mode is Mode.SYNC
                assert where.setdefault(change.namespace, (info.name, partition)) == (
                    info.name,
                    partition,
                ), f"{change.namespace} is spread over partitions"
                out.setdefault(change.namespace, []).append(change)
    return out


def rows(bus: EmbeddedBus) -> dict[str, list[dict[str, Any] | None]]:
    return {ns: [c.data for c in changes] for ns, changes in log_changes(bus).items()}


class Running(harness.Running):
    """A files reader on a thread, which can also wait for its polls."""

    reader: FilesReader

    def polled(self, times: int = 2) -> None:
        """Wait until the reader has looked at its files ``times`` more times."""
        target = self.reader.passes + times
        wait_until(lambda: self.reader.passes >= target or self.error is not None, "a poll")
        assert self.error is None, self.error


@contextmanager
def running(config: FilesReaderConfig, bus: EmbeddedBus, state: Path) -> Iterator[Running]:
    run = Running(FilesReader(config, bus, state))
    try:
        yield run
    finally:
        run.stop()


def write_lines(path: Path, lines: list[str], mode: str = "a") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as f:
        f.write("".join(lines))


def jsonl(objects: list[dict[str, Any]]) -> list[str]:
    return [orjson.dumps(o).decode() + "\n" for o in objects]


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    with EmbeddedBus(tmp_path / "log", BUS_CONFIG) as b:
        yield b


@pytest.fixture
def src(tmp_path: Path) -> Path:
    directory = tmp_path / "in"
    directory.mkdir()
    return directory


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


# -- pure functions ---------------------------------------------------------------------------


def test_json_row_takes_objects_only() -> None:
    assert json_row(b'{"a": 1}\r') == {"a": 1}
    assert json_row(b"  ") is None
    for line, says in [(b"[1]", "an array"), (b"7", "a number"), (b"{", "not JSON")]:
        with pytest.raises(ValueError, match=says):
            json_row(line)


def test_plain_gives_json_values() -> None:
    from decimal import Decimal

    value = {"d": Decimal("1.50"), "b": b"\x00\xff", "l": [Decimal("2")], "n": None}
    assert plain(value) == {"d": "1.50", "b": "AP8=", "l": ["2"], "n": None}


# -- formats ----------------------------------------------------------------------------------


def test_jsonl_rows_land_once_in_order(bus: EmbeddedBus, src: Path, state: Path) -> None:
    write_lines(src / "a.jsonl", jsonl([{"n": i} for i in range(500)]))
    write_lines(src / "sub" / "b.jsonl", jsonl([{"m": i, "s": "é"} for i in range(3)]))
    write_lines(src / ".hidden.jsonl", jsonl([{"x": 1}]))
    config = make_config(src, glob="**/*.jsonl", batch_records=64)
    with running(config, bus, state) as run:
        wait_until(lambda: sum(map(len, rows(bus).values())) >= 503, "503 rows")
        run.polled()
    assert rows(bus) == {
        "a.jsonl": [{"n": i} for i in range(500)],
        "sub/b.jsonl": [{"m": i, "s": "é"} for i in range(3)],
    }
    first = log_changes(bus)["sub/b.jsonl"][0]
    assert first.op is Op.INSERT and first.key is None and first.ts_ms > 0
    assert first.position == f"sub/b.jsonl:{len(jsonl([{'m': 0, 's': 'é'}])[0].encode())}"
    assert log_changes(bus)["a.jsonl"][-1].position == f"a.jsonl:{(src / 'a.jsonl').stat().st_size}"
    status = read_status(state)
    assert status["files"] == 2 and status["bad_lines"] == 0 and status["running"] is False
    assert status["namespaces"]["a.jsonl"] == {
        "phase": "sync",
        "position": f"a.jsonl:{(src / 'a.jsonl').stat().st_size}",
        "lines": 500,
        "bad_lines": 0,
    }


def test_csv_header_names_values_as_text(bus: EmbeddedBus, src: Path, state: Path) -> None:
    write_lines(src / "c.csv", ["\ufeffid,name,note\n", '1,Ann,"a, b"\n', '2,Bob,"two\nlines"\n'])
    with running(make_config(src, "csv"), bus, state) as run:
        wait_until(lambda: len(rows(bus).get("c.csv", [])) == 2, "2 rows")
        write_lines(src / "c.csv", ["3,Cy,\n", '4,Di,"open\n'])  # the last row is not whole
        wait_until(lambda: len(rows(bus)["c.csv"]) == 3, "the appended row")
        run.polled()
        assert len(rows(bus)["c.csv"]) == 3
        write_lines(src / "c.csv", ['quote"\n'])
        wait_until(lambda: len(rows(bus)["c.csv"]) == 4, "the completed row")
    assert rows(bus)["c.csv"] == [
        {"id": "1", "name": "Ann", "note": "a, b"},
        {"id": "2", "name": "Bob", "note": "two\nlines"},
        {"id": "3", "name": "Cy", "note": ""},
        {"id": "4", "name": "Di", "note": "open\nquote"},
    ]
    assert log_changes(bus)["c.csv"][-1].position == f"c.csv:{(src / 'c.csv').stat().st_size}"
    assert read_status(state)["namespaces"]["c.csv"]["lines"] == 7


def test_parquet_read_once_when_whole(bus: EmbeddedBus, src: Path, state: Path) -> None:
    from decimal import Decimal

    table = pa.table(
        {
            "id": pa.array(range(10), pa.int64()),
            "price": pa.array([Decimal(f"{i}.25") for i in range(10)], pa.decimal128(8, 2)),
            "blob": pa.array([bytes([i]) for i in range(10)], pa.binary()),
        }
    )
    pq.write_table(table, src / "p.parquet", row_group_size=3)
    (src / "partial.parquet").write_bytes(b"PAR1 not yet whole")
    with running(make_config(src, "parquet", batch_records=4), bus, state) as run:
        wait_until(lambda: len(rows(bus).get("p.parquet", [])) == 10, "10 rows")
        run.polled(3)
    assert rows(bus)["p.parquet"] == [
        {"id": i, "price": f"{i}.25", "blob": plain(bytes([i]))} for i in range(10)
    ]
    assert [c.position for c in log_changes(bus)["p.parquet"]] == [
        f"p.parquet:{i}" for i in range(1, 11)
    ]
    assert read_json(state / "state.json")["files"]["p.parquet"]["done"] is True


def test_parquet_resumes_after_its_position(bus: EmbeddedBus, src: Path, state: Path) -> None:
    pq.write_table(pa.table({"id": list(range(10))}), src / "p.parquet", row_group_size=3)
    write_json(state / "state.json", {"files": {"p.parquet": {"offset": 4, "lines": 4}}})
    with running(make_config(src, "parquet"), bus, state) as run:
        wait_until(lambda: len(rows(bus).get("p.parquet", [])) == 6, "6 rows")
        run.polled()
    assert rows(bus)["p.parquet"] == [{"id": i} for i in range(4, 10)]


# -- following files ----------------------------------------------------------------------------


def test_appended_lines_and_new_files(bus: EmbeddedBus, src: Path, state: Path) -> None:
    path = src / "a.jsonl"
    write_lines(path, ['{"n": 0}\n', '{"n": 1}'])  # the last line has no newline yet
    with running(make_config(src), bus, state) as run:
        wait_until(lambda: rows(bus).get("a.jsonl") == [{"n": 0}], "the first line")
        run.polled(3)
        assert rows(bus)["a.jsonl"] == [{"n": 0}], "a partial line was read"
        write_lines(path, ["\n", '{"n": 2}\n'])
        write_lines(src / "b.jsonl", jsonl([{"b": 1}]))
        wait_until(lambda: len(rows(bus)["a.jsonl"]) == 3 and "b.jsonl" in rows(bus), "more")
    assert rows(bus) == {"a.jsonl": [{"n": 0}, {"n": 1}, {"n": 2}], "b.jsonl": [{"b": 1}]}


def test_bad_lines_counted_and_skipped(
    bus: EmbeddedBus, src: Path, state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "headwater.transport.files.reader")
    write_lines(src / "j.jsonl", ['{"n": 1}\n', "not json\n", "\n", "[1, 2]\n", '{"n": 2}\n'])
    write_lines(src / "c.csv", ["a,b\n", "1,2\n", "3\n", '4,"x"y\n', "5,6\n"])
    with running(make_config(src, glob="*.jsonl"), bus, state) as run:
        wait_until(lambda: len(rows(bus).get("j.jsonl", [])) == 2, "the good lines")
        run.polled()
    with running(make_config(src, "csv", id="csv", glob="*.csv"), bus, state / "csv") as run:
        wait_until(lambda: run.reader.changes == 2, "the good rows")
        run.polled()
    assert rows(bus)["j.jsonl"] == [{"n": 1}, {"n": 2}]
    status = read_status(state)
    assert status["bad_lines"] == 2 and status["namespaces"]["j.jsonl"]["bad_lines"] == 2
    assert read_status(state / "csv")["bad_lines"] == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("j.jsonl line 2 is not JSON" in m for m in messages), messages
    assert any("j.jsonl line 4 is an array, not a JSON object" in m for m in messages)
    assert any("c.csv line 3 has 1 fields where the header has 2" in m for m in messages)
    assert any("c.csv line 4" in m for m in messages), messages


# -- resuming ---------------------------------------------------------------------------------


def test_restart_resumes_without_duplicates(bus: EmbeddedBus, src: Path, state: Path) -> None:
    path = src / "a.jsonl"
    write_lines(path, jsonl([{"n": i} for i in range(100)]))
    config = make_config(src, batch_records=10)
    with running(config, bus, state):
        wait_until(lambda: len(rows(bus).get("a.jsonl", [])) == 100, "100 rows")
    write_lines(path, jsonl([{"n": i} for i in range(100, 150)]))
    with running(config, bus, state) as run:
        wait_until(lambda: len(rows(bus)["a.jsonl"]) >= 150, "150 rows")
        run.polled()
    assert rows(bus)["a.jsonl"] == [{"n": i} for i in range(150)]
    assert read_status(state)["namespaces"]["a.jsonl"]["lines"] == 150


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_state_behind_the_log_gives_no_duplicate(
    fmt: str, bus: EmbeddedBus, src: Path, state: Path
) -> None:
    """A reader killed after a durable append but before saving its state: on start it takes
    the position from the log."""
    name = f"a.{fmt}"
    if fmt == "jsonl":
        write_lines(src / name, jsonl([{"n": str(i)} for i in range(30)]))
    elif fmt == "csv":
        write_lines(src / name, ["n\n", *(f"{i}\n" for i in range(30))])
    else:
        pq.write_table(pa.table({"n": [str(i) for i in range(30)]}), src / name)
    config = make_config(src, fmt, batch_records=7)
    reader = FilesReader(config, bus, state)
    dies_on_save(reader, 3)  # on start, then after the first two batches
    run = Running(reader)
    wait_until(lambda: run.error is not None, "the reader to die")
    with pytest.raises(Killed):
        run.stop()
    saved = read_json(state / "state.json")["files"][name]
    on_log = log_changes(bus)[name]
    assert len(on_log) == 21 and saved["offset"] < int(on_log[-1].position.rpartition(":")[2])
    if fmt != "parquet":
        write_lines(src / name, jsonl([{"n": "30"}]) if fmt == "jsonl" else ["30\n"])
    total = 30 if fmt == "parquet" else 31
    with running(config, bus, state) as run:
        wait_until(lambda: sum(map(len, rows(bus).values())) >= total, "every row")
        run.polled(3)
    assert rows(bus) == {name: [{"n": str(i)} for i in range(total)]}
    assert read_json(state / "state.json")["files"][name]["lines"] == total + (fmt == "csv")


# -- SIGKILL ----------------------------------------------------------------------------------


def _progress(state: Path) -> int:
    try:
        files = read_json(state / "state.json").get("files", {})
    except ValueError:
        return 0
    return sum(f["offset"] for f in files.values())


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigkill_while_appending_loses_and_repeats_nothing(
    launcher: str, tmp_path: Path, src: Path
) -> None:
    """The reader in a child process, SIGKILLed five times while it appends (lines are added
    and files made between runs), then left to read everything: the log holds every line
    once, in order per file."""
    rng = random.Random(12)
    data = tmp_path / "data"
    state = data / "transport" / READER
    config = make_config(src, batch_records=150)
    written: dict[str, int] = {}

    def add_lines(name: str, count: int) -> None:
        start = written.get(name, 0)
        lines = jsonl([{"f": name, "i": i, "pad": "x" * 60} for i in range(start, start + count)])
        write_lines(src / name, lines)
        written[name] = start + count

    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        add_lines(name, 6000)
    kills = 0
    for round_ in range(5):
        child = start_child(launcher, data, config)
        try:
            floor = _progress(state)
            target = floor + rng.randint(20_000, 200_000)
            wait_until(lambda t=target: _progress(state) >= t, f"progress in round {round_}")
        finally:
            kill(child)
        kills += 1
        add_lines(rng.choice(["a.jsonl", "b.jsonl", "c.jsonl"]), 2000)
        add_lines(f"new{round_}.jsonl", 500)
    total = sum((src / name).stat().st_size for name in written)
    child = start_child(launcher, data, config)
    try:
        wait_until(lambda: _progress(state) == total, "the last run to read everything", 120)
    finally:
        kill(child)
    assert kills >= 3
    with EmbeddedBus(data / "log", BUS_CONFIG) as bus:
        found = rows(bus)
    assert set(found) == set(written)
    for name, count in written.items():
        assert found[name] == [{"f": name, "i": i, "pad": "x" * 60} for i in range(count)], name
