"""A consumer that polls in place waits for records on its event loop (``Consumer.arrivals``):
the log's writer wakes the loop once what was appended is durable, with no thread of the
consumer's own."""

from __future__ import annotations

import asyncio
import threading
import time

from tests.bus.embedded.conftest import OpenLog

from headwater.bus.records import Message


def test_a_waiting_consumer_wakes_when_an_append_is_durable(open_log: OpenLog) -> None:
    bus = open_log(durability="always")
    bus.create_topic("t", 1)
    consumer = bus.consumer("g", ["t"])
    assert consumer.polls_in_place

    async def main() -> list[bytes]:
        assert consumer.poll(10, 0) == []
        waiting = asyncio.create_task(consumer.arrivals(30))
        await asyncio.sleep(0)  # (it is watching now)
        assert not waiting.done()
        # appended from another thread, as the intake's links do
        threading.Thread(target=lambda: bus.append("t", [Message(b"v")]).result()).start()
        started = time.monotonic()
        await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - started < 10
        return [r.value for r in consumer.poll(10, 0)]

    assert asyncio.run(main()) == [b"v"]
    assert bus._watchers == []


def test_records_that_came_between_the_poll_and_the_wait_are_not_waited_for(
    open_log: OpenLog,
) -> None:
    bus = open_log(durability="always")
    bus.create_topic("t", 1)
    consumer = bus.consumer("g", ["t"])

    async def main() -> list[bytes]:
        assert consumer.poll(10, 0) == []
        bus.append("t", [Message(b"v")]).result()  # after the empty poll, before the wait
        await asyncio.wait_for(consumer.arrivals(30), 5)  # answers at once
        return [r.value for r in consumer.poll(10, 0)]

    assert asyncio.run(main()) == [b"v"]


def test_a_wait_that_times_out_or_is_cancelled_leaves_no_watcher(open_log: OpenLog) -> None:
    bus = open_log(durability="always")
    bus.create_topic("t", 1)
    consumers = [bus.consumer(f"g{i}", ["t"]) for i in range(3)]

    async def main() -> None:
        for c in consumers:
            assert c.poll(10, 0) == []
        await asyncio.gather(*(c.arrivals(0.01) for c in consumers[:2]))
        assert len(bus._watchers) == 0
        waiting = asyncio.create_task(consumers[2].arrivals(30))
        await asyncio.sleep(0)
        assert len(bus._watchers) == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert bus._watchers == []
        # the next append still wakes a new wait
        waiting = asyncio.create_task(consumers[0].arrivals(30))
        await asyncio.sleep(0)
        await asyncio.to_thread(lambda: bus.append("t", [Message(b"v")]).result())
        await asyncio.wait_for(waiting, 10)

    asyncio.run(main())
    assert [r.value for r in consumers[0].poll(10, 0)] == [b"v"]
