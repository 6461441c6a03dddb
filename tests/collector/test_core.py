"""The collector's core, below the servers: routing, write keys, limits, context headers,
event ids, publishing with both ack modes, and admission control."""

from __future__ import annotations

import asyncio
import base64
import collections
import random
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from headwater.bus import context
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.records import TopicPartition
from headwater.collector.admission import Admission
from headwater.collector.auth import WriteKeys, hash_key, key_from_headers
from headwater.collector.config import AdmissionConfig, CollectorConfig, SourceConfig
from headwater.collector.dedup import RecentRequests
from headwater.collector.errors import Code, Rejected
from headwater.collector.events import EventIn, RequestContext, Uuid7, to_messages
from headwater.collector.limits import Connections
from headwater.collector.metrics import MAX_TYPES, Metrics, type_counts
from headwater.collector.publisher import Publisher
from headwater.collector.routing import Router


def test_routing_by_type_with_either_pattern_form() -> None:
    assert Router("clickstream-{type}-log").topic("viewed") == "clickstream-viewed-log"
    assert Router("topic-%s-log").topic("viewed") == "topic-viewed-log"
    assert Router("e-{type}").topic("page view/2") == "e-page_view_2"
    with pytest.raises(Rejected, match="empty type"):
        Router("e-{type}").topic("")
    with pytest.raises(Rejected, match="249"):
        Router("e-{type}").topic("x" * 300)


def test_grouping_by_topic_keeps_each_topics_order() -> None:
    router = Router("t-{type}")
    one = [EventIn("a", bytes([i]), "x") for i in range(3)]
    assert router.group(one) == {"t-a": one}
    mixed = [EventIn("a", b"1", "x"), EventIn("b", b"2", "x"), EventIn("a", b"3", "x")]
    assert router.group(mixed) == {"t-a": [mixed[0], mixed[2]], "t-b": [mixed[1]]}
    assert router.group([]) == {}
    with pytest.raises(Rejected, match="empty type"):
        router.group([EventIn("a", b"1", "x"), EventIn("", b"2", "x")])


def test_type_counts_and_the_counters_they_bump() -> None:
    one = [EventIn("a", b"12", "x"), EventIn("a", b"345", "x")]
    assert type_counts(one) == {"a": (2, 5)}
    mixed = [EventIn("a", b"1", "x"), EventIn("b", b"22", "x"), EventIn("a", b"333", "x")]
    assert type_counts(mixed) == {"a": (2, 4), "b": (1, 2)}
    assert type_counts([]) == {}
    m = Metrics()
    for _ in range(2):  # the second time through the kept children
        m.received(type_counts(mixed), "raccoon-ws")
        m.published(type_counts(mixed))
        m.from_source("web", "rest", 3)
        m.acked("rest", 0.003)
    value = m.registry.get_sample_value
    assert (
        value("headwater_collector_events_received_total", {"type": "a", "protocol": "raccoon-ws"})
        == 4
    )
    assert value("headwater_collector_bytes_received_total", {"type": "b"}) == 4
    assert value("headwater_collector_events_published_total", {"type": "a"}) == 4
    assert value("headwater_collector_bytes_published_total", {"type": "a"}) == 8
    assert (
        value("headwater_collector_source_events_total", {"source": "web", "protocol": "rest"}) == 6
    )
    assert value("headwater_collector_ack_latency_seconds_count", {"protocol": "rest"}) == 2
    # past MAX_TYPES distinct types, new ones count as "other" (and keep no child of their own)
    for i in range(MAX_TYPES + 5):
        m.published({f"t{i}": (1, 1)})
    assert value("headwater_collector_events_published_total", {"type": "other"}) == 7
    assert len(m._published) == MAX_TYPES + 1


def test_write_keys_are_stored_hashed_and_found_in_every_sdk_spelling() -> None:
    keys = WriteKeys([SourceConfig(id="web", write_keys=[hash_key("s3cret")])])
    basic = "Basic " + base64.b64encode(b"s3cret:").decode()
    assert keys.source_for(key_from_headers({"authorization": basic})) == "web"
    assert keys.source_for(key_from_headers({"x-write-key": "s3cret"})) == "web"
    assert keys.source_for(key_from_headers({}, {"token": "s3cret"})) == "web"
    with pytest.raises(Rejected, match="unknown write key") as info:
        keys.source_for("nope")
    assert info.value.status == 401
    with pytest.raises(Rejected, match="required"):
        keys.source_for(key_from_headers({}))
    with pytest.raises(ValidationError, match="stored hashed"):
        SourceConfig(id="web", write_keys=["s3cret"])


def test_connection_limits_total_and_per_identity() -> None:
    c = Connections(max_total=2, max_per_identity=1)
    c.open("a")
    with pytest.raises(Rejected) as per_user:
        c.open("a")
    assert per_user.value.code == Code.MAX_USER_LIMIT_REACHED
    c.open("b")
    with pytest.raises(Rejected) as total:
        c.open("c")
    assert total.value.code == Code.MAX_CONNECTION_LIMIT_REACHED
    c.close("a")
    c.open("c")
    assert c.total == 2


def test_uuid7_ids_are_unique_ordered_and_version_7() -> None:
    # a generator of its own: the process's one never goes back to an earlier millisecond
    generator = Uuid7()
    ids = generator.batch(10_000, 1_700_000_000_000) + generator.batch(10, 1_700_000_000_000)
    parsed = [uuid.UUID(i.decode()) for i in ids]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert {u.version for u in parsed} == {7} and {u.variant for u in parsed} == {uuid.RFC_4122}
    assert parsed[0].int >> 80 == 1_700_000_000_000


def test_messages_keep_bytes_and_carry_context_in_headers() -> None:
    ctx = RequestContext("raccoon-ws", "raccoon", "req-1", 1_700_000_000_123, "10.0.0.7", "ua/1")
    (m,) = to_messages([EventIn("viewed", b"\x00raw\xff", "application/x-protobuf")], ctx)
    assert m.value == b"\x00raw\xff" and m.timestamp == 1_700_000_000_123
    headers = dict(m.headers)
    assert headers[context.TYPE] == b"viewed"
    assert headers[context.REQUEST_ID] == b"req-1"
    assert headers[context.RECEIVED_AT] == b"2023-11-14T22:13:20.123Z"
    assert headers[context.CLIENT_IP] == b"10.0.0.7"
    assert uuid.UUID(headers[context.EVENT_ID].decode()).version == 7
    assert set(headers) <= set(context.ALL)


def _publisher(bus: EmbeddedBus, durable: bool, admission: Admission | None = None) -> Publisher:
    return Publisher(
        bus,
        durable=durable,
        max_record_bytes=1000,
        admission=admission or Admission(bus, AdmissionConfig(min_free_disk_bytes=None), None),
        metrics=Metrics(),
        retry_after_s=2,
    )


CTX = RequestContext("raccoon-ws", "raccoon", "r", 1_700_000_000_000)


def test_publish_routes_by_type_and_bad_input_publishes_nothing(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path, EmbeddedBusConfig(default_partitions=1)) as bus:
        pub, router = _publisher(bus, durable=True), Router("t-{type}")
        events = [EventIn("a", b"1", "x"), EventIn("b", b"2", "x"), EventIn("a", b"3", "x")]
        asyncio.run(pub.publish(events, CTX, router))
        assert [r.value for r in bus.read("t-a", 0, 0)] == [b"1", b"3"]
        assert [r.value for r in bus.read("t-b", 0, 0)] == [b"2"]
        too_big = [EventIn("c", b"ok", "x"), EventIn("d", b"x" * 2000, "x")]
        with pytest.raises(Rejected, match=r"event 1 \(type 'd'\) is \d+ bytes") as info:
            asyncio.run(pub.publish(too_big, CTX, router))
        assert info.value.status == 413
        with pytest.raises(Rejected, match="empty type"):
            asyncio.run(pub.publish([EventIn("e", b"1", "x"), EventIn("", b"2", "x")], CTX, router))
        assert {t.name for t in bus.topics()} == {"t-a", "t-b"}, "nothing of a bad request stored"
        with pytest.raises(Rejected, match="no events"):
            asyncio.run(pub.publish([], CTX, router))


def test_admission_refuses_over_the_lag_budget_and_recovers(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path, EmbeddedBusConfig(default_partitions=1)) as bus:
        admission = Admission(
            bus, AdmissionConfig(min_free_disk_bytes=None, max_lag_records=5), tmp_path
        )
        pub, router = _publisher(bus, durable=True, admission=admission), Router("t-{type}")
        asyncio.run(pub.publish([EventIn("a", b"%d" % i, "x") for i in range(10)], CTX, router))
        bus.commit("slow-writer", {TopicPartition("t-a", 0): 0})
        admission.update()
        with pytest.raises(Rejected, match="'slow-writer' lags 10 records") as info:
            asyncio.run(pub.publish([EventIn("a", b"more", "x")], CTX, router))
        assert info.value.status == 503 and info.value.retry_after == 1
        assert bus.watermarks("t-a", 0)[1] == 10, "a refused request stores nothing"
        bus.commit("slow-writer", {TopicPartition("t-a", 0): 10})
        admission.update()
        asyncio.run(pub.publish([EventIn("a", b"more", "x")], CTX, router))


def test_admission_refuses_when_the_disk_budget_is_exceeded(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path, EmbeddedBusConfig()) as bus:
        admission = Admission(bus, AdmissionConfig(min_free_disk_bytes=1 << 62), tmp_path)
        admission.update()
        with pytest.raises(Rejected, match="bytes free, below the budget"):
            admission.check()


def test_a_full_log_queue_is_backpressure_not_an_error(tmp_path: Path) -> None:
    config = EmbeddedBusConfig(default_partitions=1, max_pending_bytes=2000)
    with EmbeddedBus(tmp_path, config) as bus:
        pub, router = _publisher(bus, durable=False), Router("t-{type}")

        async def flood() -> list[Rejected]:
            refused = []
            for _ in range(200):
                try:
                    await pub.publish([EventIn("a", b"x" * 700, "x")], CTX, router)
                except Rejected as e:
                    refused.append(e)
            return refused

        refused = asyncio.run(flood())
        assert refused and all(r.status == 503 and r.retry_after == 2 for r in refused)
        bus.flush()
        assert bus.watermarks("t-a", 0)[1] == 200 - len(refused)


def test_received_mode_acks_before_durability(tmp_path: Path) -> None:
    with EmbeddedBus(tmp_path, EmbeddedBusConfig(default_partitions=1)) as bus:
        pub = _publisher(bus, durable=False)
        asyncio.run(pub.publish([EventIn("a", b"1", "x")], CTX, Router("t-{type}")))
        bus.flush()
        assert bus.read("t-a", 0, 0)[0].value == b"1"


def test_collector_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        CollectorConfig(topic_pattern="no-placeholder")
    with pytest.raises(ValidationError, match="not an IP"):
        CollectorConfig(trusted_proxies=["nonsense"])
    with pytest.raises(ValidationError, match="appears twice"):
        CollectorConfig(sources=[SourceConfig(id="a"), SourceConfig(id="a")])


def test_recent_requests_keep_a_window_of_stored_ids_and_forget_failed_ones() -> None:
    async def scenario() -> None:
        recent = RecentRequests()
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        recent.start("a", first)
        assert recent.running("a") is first and not recent.stored("a")
        recent.end("a", stored=True, window=2)
        assert recent.running("a") is None and recent.stored("a")
        recent.start("b", asyncio.get_running_loop().create_future())
        recent.end("b", stored=False, window=2)  # failed: may be sent again
        assert not recent.stored("b")
        for guid in ("c", "d"):  # the window of 2 now holds c and d: a is forgotten
            recent.end(guid, stored=True, window=2)
        assert not recent.stored("a") and recent.stored("c") and recent.stored("d")
        recent.end("e", stored=True, window=2)
        assert not recent.stored("c") and recent.stored("d") and recent.stored("e")

    asyncio.run(scenario())


def test_recent_requests_answer_as_the_last_window_of_ids_would() -> None:
    """Against a plain list of the last ``window`` ids: thousands of ids through a window of
    300, so that many share a one-byte mark (about 300 / 256 per mark) and ids leave the ring
    in every slot."""
    rng = random.Random(7)
    recent = RecentRequests()
    window = 300
    kept: list[str] = []
    for i in range(5_000):
        guid = f"g-{rng.randrange(2_000)}" if i % 3 else f"new-{i}"
        assert recent.stored(guid) == (guid in kept), (i, guid)
        if guid in kept:
            continue  # a repeat is answered, not stored again
        recent.end(guid, stored=True, window=window)
        kept = [*kept, guid][-window:]
    marks = collections.Counter(hash(g) & 0xFF for g in kept)
    assert max(marks.values()) > 1  # marks were shared: the ids behind them were compared
