"""Durability policies: ``always`` resolves an append only once its batch is fdatasync'd, and
concurrent appenders share fdatasyncs (group commit); ``interval`` syncs on a timer; ``never``
leaves it to the OS."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from tests.bus.embedded.conftest import wait_for

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.partition import Partition
from headwater.bus.embedded.segment import Segment
from headwater.bus.embedded.writer import HANDOFF_BYTES
from headwater.bus.errors import BusUnavailable
from headwater.bus.records import Message

OpenLog = Callable[..., EmbeddedBus]


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts fdatasync calls on segments (a spy around the real call)."""
    calls: list[int] = []
    real = Segment.sync

    def counting(self: Segment) -> None:
        real(self)
        calls.append(self.next_offset)

    monkeypatch.setattr(Segment, "sync", counting)
    return calls


def test_always_resolves_after_fdatasync_and_shares_it(open_log: OpenLog, syncs: list[int]) -> None:
    bus = open_log(durability="always", default_partitions=1)
    bus.create_topic("t")
    part = bus._topics["t"][0]
    appends, violations = 32 * 20, []

    def appender() -> None:
        for _ in range(20):
            future = bus.append("t", [Message(b"x" * 200) for _ in range(10)])
            *_, last = future.result(timeout=30)
            if syncs[-1] <= last.offset or part.synced_offset <= last.offset:
                violations.append(last.offset)

    threads = [threading.Thread(target=appender) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == [], "an append resolved before its batch was fdatasync'd"
    assert bus.watermarks("t", 0)[1] == appends * 10
    assert len(syncs) < appends / 2, f"{len(syncs)} fdatasyncs for {appends} appends"


def test_interval_syncs_on_a_timer(open_log: OpenLog, syncs: list[int]) -> None:
    bus = open_log(durability="interval", flush_interval_ms=20, default_partitions=1)
    (pos,) = bus.append("t", [Message(b"x")]).result(timeout=5)
    deadline = time.monotonic() + 10
    while not syncs or syncs[-1] <= pos.offset:
        assert time.monotonic() < deadline, "no fdatasync within the interval"
        time.sleep(0.005)


def test_never_leaves_flushing_to_the_os_until_close(open_log: OpenLog, syncs: list[int]) -> None:
    bus = open_log(durability="never", default_partitions=1)
    for _ in range(50):
        bus.append("t", [Message(b"x" * 100)]).result(timeout=5)
    assert bus.read("t", 0, 0, max_records=100)[-1].offset == 49
    assert syncs == []
    bus.close()
    assert syncs, "close makes everything durable"


def test_a_full_write_queue_refuses_appends_instead_of_buffering(open_log: OpenLog) -> None:
    bus = open_log(durability="always", default_partitions=1, max_pending_bytes=10_000)
    bus.create_topic("t")
    refused = 0
    futures = []
    for _ in range(2000):
        try:
            futures.append(bus.append("t", [Message(b"x" * 1000)]))
        except BusUnavailable as e:
            assert "write queue is full" in str(e) and e.transient
            refused += 1
    positions = [f.result(timeout=30)[0].offset for f in futures]
    assert refused > 0
    assert positions == list(range(len(futures))), "every accepted append was stored, in order"


def test_append_many_queues_all_topics_or_none(open_log: OpenLog) -> None:
    bus = open_log(durability="always", default_partitions=1, max_pending_bytes=5_000)
    topics = ["a", "b", "c"]
    for t in topics:
        bus.create_topic(t)
    accepted = refused = 0
    for _ in range(500):
        try:
            futures = bus.append_many({t: [Message(b"x" * 1000)] for t in topics})
        except BusUnavailable:
            refused += 1
            continue
        accepted += 1
        assert len(futures) == 3
    bus.flush()
    assert refused > 0 and accepted > 0
    assert [bus.watermarks(t, 0)[1] for t in topics] == [accepted] * 3


def test_the_next_fdatasync_does_not_wait_for_the_last_round_to_be_told(
    open_log: OpenLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``always``, when ``HANDOFF_BYTES`` or more is written by the time a round is
    synced, the syncer hands the round to the teller and syncs the next one at once; the teller
    tells rounds in order."""
    real, syncs, sync_gate, syncing = Segment.sync, [], threading.Event(), threading.Event()

    def gated(self: Segment) -> None:
        if not syncs:
            syncing.set()
            sync_gate.wait(30)  # (the first fdatasync is held until the second batch is written)
        real(self)
        syncs.append(self.next_offset)

    monkeypatch.setattr(Segment, "sync", gated)
    bus = open_log(durability="always", default_partitions=1)
    bus.create_topic("t")
    part = bus._topics["t"][0]
    batch = fmt.encode([Message(b"x" * 200) for _ in range(10)], 1)
    big = fmt.encode([Message(b"y" * 1000) for _ in range(HANDOFF_BYTES // 1000 + 1)], 1)
    release, told = threading.Event(), []

    def first(base: int, error: BaseException | None) -> None:
        release.wait(30)  # (whoever tells the first round is held here)
        told.append(("first", base, error))

    def second(base: int, error: BaseException | None) -> None:
        told.append(("second", base, error))

    bus.append_encoded([("t", 0, batch, first)])
    assert syncing.wait(10), "the first round's fdatasync did not start"
    bus.append_encoded([("t", 0, big, second)])
    end = 10 + big.count
    wait_for(lambda: part.next_offset == end, "the second batch written")
    sync_gate.set()
    # the second batch is fdatasync'd while the first round's appender is still being told
    wait_for(lambda: len(syncs) == 2 and syncs[-1] == end, "the second round's fdatasync")
    assert told == []
    release.set()
    wait_for(lambda: len(told) == 2, "both rounds told")
    assert told == [("first", 0, None), ("second", 10, None)]


def test_a_round_with_little_written_after_it_is_told_by_the_syncer(
    open_log: OpenLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With less than ``HANDOFF_BYTES`` more to sync, the syncer tells the round itself (no
    hand-off in the way of its acks); its pages are still dropped by the teller."""
    bus = open_log(durability="always", default_partitions=1)
    bus.create_topic("t")
    threads: list[str] = []
    real = Partition.drop_synced

    def drop(self: Partition) -> None:
        threads.append("drop " + threading.current_thread().name)
        real(self)

    monkeypatch.setattr(Partition, "drop_synced", drop)
    batch = fmt.encode([Message(b"x" * 200) for _ in range(10)], 1)
    bus.append_encoded(
        [("t", 0, batch, lambda base, error: threads.append(threading.current_thread().name))]
    )
    wait_for(lambda: len(threads) == 2, "the round told and its pages dropped")
    assert threads == ["headwater-log-syncer", "drop headwater-log-teller"]


def test_a_failing_tell_fails_the_rest_of_the_round_instead_of_hanging_it(
    open_log: OpenLog,
) -> None:
    """A bug in telling one appender (its ``Done`` raises) fails the round's other appenders
    and the log, rather than leaving them waiting forever."""
    bus = open_log(durability="always", default_partitions=1)
    bus.create_topic("t")
    batch = fmt.encode([Message(b"x" * 200) for _ in range(10)], 1)
    told: list[tuple[int, BaseException | None]] = []

    def broken(base: int, error: BaseException | None) -> None:
        if error is None:
            raise RuntimeError("a bug in an appender's callback")

    bus.append_encoded([("t", 0, batch, broken), ("t", 0, batch, lambda b, e: told.append((b, e)))])
    wait_for(lambda: bool(told), "the other appender told")
    ((base, error),) = told
    assert base == -1 and isinstance(error, BusUnavailable)
    assert "cannot tell its appenders" in str(error)
    with pytest.raises(BusUnavailable):
        bus.append("t", [Message(b"y")])
