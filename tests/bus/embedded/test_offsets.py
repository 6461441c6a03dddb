"""Writer offsets are persisted atomically at an interval and on clean close; a hard kill loses
at most the last interval's commits."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.bus.embedded.conftest import wait_for

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.records import Message, TopicPartition

OpenLog = Callable[..., EmbeddedBus]
TP = TopicPartition("t", 0)


def test_offsets_persist_at_the_interval(open_log: OpenLog) -> None:
    bus = open_log(offsets_flush_interval_ms=50, default_partitions=1)
    bus.append("t", [Message(b"%d" % i) for i in range(10)]).result(timeout=30)
    bus.commit("g", {TP: 7})
    path = bus.directory / "groups.json"

    def persisted() -> dict:
        return json.loads(path.read_text()) if path.exists() else {}

    wait_for(lambda: persisted().get("groups", {}).get("g") == {"t": {"0": 7}}, "the offsets' file")
    reader = open_log(read_only=True)
    assert reader.committed("g") == {TP: 7}
    assert reader.groups() == ["g"]


def test_clean_close_persists_and_consumer_resumes(open_log: OpenLog) -> None:
    bus = open_log(offsets_flush_interval_ms=60_000, default_partitions=1)
    bus.append("t", [Message(b"%d" % i) for i in range(10)]).result(timeout=30)
    with bus.consumer("g", ["t"]) as consumer:
        assert [r.value for r in consumer.poll(4, timeout=1)] == [b"0", b"1", b"2", b"3"]
        consumer.commit()
    bus.close()
    bus = open_log(default_partitions=1)
    with bus.consumer("g", ["t"]) as consumer:
        assert consumer.poll(100, timeout=1)[0].value == b"4"


def test_consumer_wakes_on_new_records(open_log: OpenLog) -> None:
    bus = open_log(default_partitions=1)
    bus.create_topic("t")
    with bus.consumer("g", ["t"]) as consumer:
        assert consumer.poll(10, timeout=0.05) == []
        bus.append("t", [Message(b"late")])
        assert [r.value for r in consumer.poll(10, timeout=5)] == [b"late"]
