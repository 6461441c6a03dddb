"""Writers other than the collector wait on a full write queue instead of failing: the
transport readers' appender and the webhook workers' hand-offs (``append_many_when_room``).
Each test gives the embedded log a write queue a few batches long and appends far more."""

from __future__ import annotations

import asyncio
from pathlib import Path

from headwater.bus import Message, open_bus
from headwater.bus.base import Bus
from headwater.bus.errors import QueueFull
from headwater.bus.waiting import append_many_when_room
from headwater.config.model import HeadwaterConfig
from headwater.transport.config import FilesReaderConfig
from headwater.transport.message import Change, Mode, Op
from headwater.transport.reader import Appender

SENDS = 200
PER_SEND = 50


def small_queue_bus(tmp_path: Path) -> Bus:
    config = HeadwaterConfig.model_validate(
        {
            "data_dir": tmp_path,
            "bus": {"embedded": {"durability": "always", "max_pending_bytes": 4096}},
        }
    )
    return open_bus(config)


def test_a_transport_reader_waits_for_room(tmp_path: Path) -> None:
    """Sends whose futures are not awaited in between fill the queue: each waits for room,
    and every change is on the log once."""
    config = FilesReaderConfig.model_validate(
        {"id": "files", "type": "files", "path": tmp_path, "format": "jsonl"}
    )
    with small_queue_bus(tmp_path) as bus:
        appender = Appender(bus, config)
        futures = []
        for s in range(SENDS):
            for i in range(PER_SEND):
                n = s * PER_SEND + i
                change = Change(Op.INSERT, "orders", 1, {"n": n, "pad": "x" * 60}, {"n": n})
                appender.add(change, Mode.SYNC)
            futures += appender.send()
        for f in futures:
            f.result(timeout=60)
        topic = appender.topic("orders")
        total = sum(bus.watermarks(topic, p)[1] for p in range(bus.topic(topic).partitions))
    assert total == SENDS * PER_SEND


def test_a_webhook_hand_off_waits_for_room_without_blocking_the_loop(tmp_path: Path) -> None:
    """Hand-offs from many tasks at once: those that meet the full queue wait for room (on a
    worker thread, off the event loop), and every one is stored once."""
    value = b"x" * 400
    with small_queue_bus(tmp_path) as bus:
        bus.create_topic("to_sender", partitions=1)
        refused = 0
        try:  # the queue is small enough to refuse a burst of plain appends
            for _ in range(200):
                bus.append("to_sender", [Message(value)] * PER_SEND)
        except QueueFull:
            refused = 1
        assert refused, "the queue never filled: the test shows nothing"
        bus.flush()
        before = bus.watermarks("to_sender", 0)[1]

        async def hand_off() -> None:
            futures = await append_many_when_room(bus, {"to_sender": [Message(value)] * PER_SEND})
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

        async def main() -> None:
            await asyncio.gather(*(hand_off() for _ in range(SENDS)))

        asyncio.run(main())
        assert bus.watermarks("to_sender", 0)[1] - before == SENDS * PER_SEND
