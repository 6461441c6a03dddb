"""A task's archive rows made into per-session packs (``delivery.task.items``): grouped by
session key in log order, NULL keys in the default session, each format's items exact, an event
too large for a batch handed over alone (as an ``Event``) where it stood, and the source rows
remembered for the failed store."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from headwater.delivery.bodies import BodyFormat, Event, Pack
from headwater.delivery.task import items, source_records

BASE_US = 1_700_000_000_000_000


def rows(keys: list[str | None], pads: list[int] | None = None, large: bool = False) -> pa.Table:
    pads = pads or [10] * len(keys)
    texts = [json.dumps({"n": i, "pad": "x" * p}) for i, p in enumerate(pads)]
    stamps = [BASE_US + i for i in range(len(keys))]
    return pa.table(
        {
            "event": pa.array(texts, pa.large_string() if large else pa.string()),
            "_timestamp": pa.array(stamps, pa.timestamp("us", tz="UTC")),
            "_hw_session": pa.array(keys, pa.string()),
            "key": pa.array([None] * len(keys), pa.binary()),
            "value": pa.array([t.encode() for t in texts], pa.binary()),
            "headers": pa.array([None] * len(keys), pa.binary()),
            "topic": ["t"] * len(keys),
            "partition": pa.array([0] * len(keys), pa.int32()),
            "offset": pa.array(range(len(keys)), pa.int64()),
        }
    )


def unpack(made: list[tuple[str, Pack | Event]], fmt: BodyFormat) -> dict[str, list[bytes]]:
    """Each session's items, in order."""
    out: dict[str, list[bytes]] = {}
    for key, item in made:
        if isinstance(item, Event):
            out.setdefault(key, []).append(b"EVENT:" + fmt.item(item))
            continue
        data, start = bytes(item.data), 0
        for end in item.ends.tolist():
            out.setdefault(key, []).append(data[start:end])
            start = end
    return out


@pytest.mark.parametrize("large", [False, True])
def test_rows_are_grouped_by_session_in_log_order(large: bool) -> None:
    keys = ["b", "a", None, "b", "a", "b", None]
    made = items(rows(keys, large=large), "default", BodyFormat("ndjson"), 10_000)
    got = {
        k: [json.loads(i)["n"] for i in v] for k, v in unpack(made, BodyFormat("ndjson")).items()
    }
    assert got == {"a": [1, 4], "b": [0, 3, 5], "default": [2, 6]}
    assert all(i.endswith(b"\n") for v in unpack(made, BodyFormat("ndjson")).values() for i in v)


def test_one_key_or_none_is_one_pack_without_reordering() -> None:
    fmt = BodyFormat("json")
    one = items(rows(["k"] * 5), "default", fmt, 10_000)
    assert [k for k, _ in one] == ["k"]
    plain = items(rows(["k"] * 5).drop(["_hw_session"]), "default", fmt, 10_000)
    assert [k for k, _ in plain] == ["default"]
    for made in (one, plain):
        (pack,) = [p for _, p in made]
        assert isinstance(pack, Pack)
        assert bytes(pack.data) == b"".join(
            json.dumps({"n": i, "pad": "x" * 10}).encode() + b"," for i in range(5)
        )


def test_dataset_items_carry_each_events_time_in_nanoseconds() -> None:
    fmt = BodyFormat("dataset")
    made = items(rows(["b", "a", "b"]), "default", fmt, 10_000)
    got = unpack(made, fmt)
    stamps = {k: [json.loads(i[:-1])["ts"] for i in v] for k, v in got.items()}
    assert stamps == {
        "a": [str((BASE_US + 1) * 1000)],
        "b": [str(BASE_US * 1000), str((BASE_US + 2) * 1000)],
    }


def test_an_event_too_large_for_a_batch_comes_alone_where_it_stood() -> None:
    fmt = BodyFormat("ndjson")
    keys = ["a", "b", "a", "a", "b", "a"]
    pads = [10, 10, 500, 10, 600, 10]
    made = items(rows(keys, pads), "default", fmt, 200)
    order = [(k, "event" if isinstance(i, Event) else i.count) for k, i in made]
    assert order == [("a", 1), ("a", "event"), ("a", 2), ("b", 1), ("b", "event")]
    big = [i for _, i in made if isinstance(i, Event)]
    assert [json.loads(e.data)["n"] for e in big] == [2, 4]
    assert [r["offset"] for r in source_records(big)] == [2, 4]


def test_source_records_follow_the_rows_of_each_pack() -> None:
    made = items(rows(["b", "a", "b", "a"]), "default", BodyFormat("ndjson"), 10_000)
    by_key = {k: source_records([p]) for k, p in made if isinstance(p, Pack)}
    assert [r["offset"] for r in by_key["a"]] == [1, 3]
    assert [r["offset"] for r in by_key["b"]] == [0, 2]
    assert json.loads(by_key["b"][1]["value"]) == {"n": 2, "pad": "x" * 10}


def test_chunked_columns_are_read_whole() -> None:
    table = pa.concat_tables([rows(["a", "b"]), rows(["b", "a"])])
    assert table.column("event").num_chunks == 2
    made = items(table, "default", BodyFormat("ndjson"), 10_000)
    got = {k: len(v) for k, v in unpack(made, BodyFormat("ndjson")).items()}
    assert got == {"a": 2, "b": 2}
