"""``read_range``, a Spark task's read, without Spark: Arrow batches of exactly the range's
records over ``bus.read_arrow``, and a start that retention deleted read from the low watermark
with a warning."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from headwater.bus import open_bus
from headwater.bus.arrow import ARROW_SCHEMA
from headwater.bus.records import Message, TopicPartition
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.source import reader
from headwater.pipeline.source.offsets import Range


@pytest.fixture(autouse=True)
def _close_buses() -> Iterator[None]:
    """Close the read-only buses ``read_range`` opened in this process (it keeps them)."""
    yield
    with reader._buses_lock:
        for bus in reader._buses.values():
            bus.close()
        reader._buses.clear()


def _config(tmp_path: Path) -> HeadwaterConfig:
    embedded = {
        "default_partitions": 1,
        "segment_bytes": 4096,
        "retention": {"bytes": 8192, "respect_writers": False},
    }
    return HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path), "bus": {"backend": "embedded", "embedded": embedded}}
    )


def _read(config: HeadwaterConfig, start: int, end: int) -> pa.Table:
    part = reader.LogRange(config.model_dump_json(), Range("t", 0, start, end))
    batches = list(reader.read_range(part))
    assert all(b.schema == ARROW_SCHEMA and b.num_rows for b in batches)
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)


def _fill(config: HeadwaterConfig, n: int) -> None:
    with open_bus(config) as bus:
        for start in range(0, n, 20):
            batch = [
                Message(b"r%d" % i, headers=(("i", b"%d" % i),)) for i in range(start, start + 20)
            ]
            bus.append("t", batch).result(timeout=30)


def test_a_range_reads_exactly_its_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    _fill(config, 200)
    monkeypatch.setattr(reader, "CHUNK", 15)  # several reads, each ending inside a batch
    table = _read(config, 7, 133)
    assert table["offset"].to_pylist() == list(range(7, 133))
    assert table["value"].to_pylist() == [b"r%d" % i for i in range(7, 133)]
    assert [h[0]["value"] for h in table["headers"].to_pylist()] == [
        b"%d" % i for i in range(7, 133)
    ]


def test_a_start_deleted_by_retention_reads_from_the_low_watermark(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    _fill(config, 400)
    with open_bus(config) as bus:
        bus.commit("w", {TopicPartition("t", 0): 0})
        assert bus.enforce_retention() > 0
        low, high = bus.watermarks("t", 0)
    assert 0 < low < high == 400
    with caplog.at_level(logging.WARNING, logger=reader.__name__):
        table = _read(config, 0, 400)
    assert table["offset"].to_pylist() == list(range(low, 400))
    assert f"offsets 0 to {low - 1} were deleted by retention" in caplog.text
