"""headwater's Kafka producer (``sender.KafkaSender``) for the bus's synchronous callers: the
producer runs on an event loop of its own thread, and an ``append`` returns a
``concurrent.futures.Future`` of the messages' positions.

The collector, which runs on asyncio itself, uses the producer on its own loop instead
(``headwater.collector.kafka_sink``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from headwater.bus.errors import BusClosed, BusUnavailable, QueueFull
from headwater.bus.kafka.config import KafkaBusConfig
from headwater.bus.kafka.producer import Send
from headwater.bus.kafka.sender import KafkaSender, MessageChunk
from headwater.bus.records import Position


class ThreadedSender:
    """A ``KafkaSender`` on a thread of its own."""

    def __init__(self, config: KafkaBusConfig, client_id: str) -> None:
        self._timeout = config.timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="headwater-kafka-sender", daemon=True
        )
        self._thread.start()
        self.sender = KafkaSender.from_config(config, client_id)
        self._started = asyncio.run_coroutine_threadsafe(self.sender.start(), self._loop)
        self._start_lock = threading.Lock()
        # Bytes handed to the loop whose ``_send`` has not run yet: the sender's own count
        # (``buffered``) does not hold them, and a caller's check must.
        self._handed = 0
        self._handed_lock = threading.Lock()
        self._closed = False

    def _ready(self) -> None:
        """Wait for the producer's start; start it again if the last attempt failed."""
        with self._start_lock:
            started = self._started
            if started.done() and started.exception() is not None:
                started = self._started = asyncio.run_coroutine_threadsafe(
                    self.sender.start(), self._loop
                )
        try:
            started.result(self._timeout + 5)
        except concurrent.futures.TimeoutError:
            raise BusUnavailable("the Kafka cluster did not answer in time") from None

    def send_all(self, sends: Sequence[Send]) -> list[Future[Sequence[Position]]]:
        """Hand every batch to the producer (messages without a timestamp: now), or raise
        ``QueueFull`` having handed none when its buffer cannot take them (an empty buffer
        takes any size)."""
        if self._closed:
            raise BusClosed("the Kafka bus is closed")
        try:
            self._ready()
        except BusUnavailable as e:  # the cluster is out of reach: the appends fail, not the call
            return [_failed(e) for _ in sends]
        now_ms = time.time_ns() // 1_000_000
        work = []
        needed = 0
        for topic, messages, partitions in sends:
            chunks = []
            for partition, indexes in partitions.items():
                chunk = MessageChunk(
                    [
                        m if m.timestamp is not None else m._replace(timestamp=now_ms)
                        for m in (messages[i] for i in indexes)
                    ]
                )
                needed += chunk.size
                chunks.append((partition, indexes, chunk))
            work.append((topic, len(messages), chunks))
        with self._handed_lock:
            buffered = self.sender.buffered + self._handed
            if buffered and buffered + needed > self.sender.buffer_bytes:
                raise QueueFull(
                    f"the Kafka producer holds {buffered:,} unacknowledged bytes (buffer "
                    f"{self.sender.buffer_bytes:,}: bus.kafka.buffer_bytes); retry shortly",
                    needed,
                )
            self._handed += needed
        futures: list[Future[Sequence[Position]]] = [Future() for _ in work]
        for f in futures:
            f.set_running_or_notify_cancel()
        self._loop.call_soon_threadsafe(self._send, work, futures, needed)
        return futures

    def _send(
        self,
        work: list[tuple[str, int, list[tuple[int, list[int], MessageChunk]]]],
        futures: list[Future[Sequence[Position]]],
        handed: int,
    ) -> None:
        try:
            for (topic, count, chunks), outcome in zip(work, futures, strict=True):
                if not chunks:
                    outcome.set_result([])
                    continue
                sent = [self.sender.send(topic, p, chunk) for p, _, chunk in chunks]
                resolve = functools.partial(_resolve, sent, chunks, count, outcome)
                for s in sent:
                    s.add_done_callback(resolve)
        finally:  # the sender counts them now
            with self._handed_lock:
                self._handed -= handed

    def wait_for_room(self, needed: int, timeout: float) -> bool:
        async def wait() -> None:
            await self.sender.room(needed, timeout, hold=False)

        try:
            asyncio.run_coroutine_threadsafe(wait(), self._loop).result(timeout + 1)
        except (BusUnavailable, concurrent.futures.TimeoutError):
            return False
        return True

    def flush(self, timeout: float | None) -> None:
        self._ready()
        wait = None if timeout is None else timeout + 1
        asyncio.run_coroutine_threadsafe(self.sender.flush(timeout), self._loop).result(wait)

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self._started.done():
                self._started.cancel()
            closing = asyncio.run_coroutine_threadsafe(self.sender.close(timeout), self._loop)
            closing.result(timeout + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout + 5)
            if not self._thread.is_alive():
                self._loop.close()

    @property
    def fatal_error(self) -> None:
        """A ``DeliveryProducer``'s fatal error; this producer heals its own (``sender``)."""
        return None


def _resolve(
    sent: list[asyncio.Future[int]],
    chunks: list[tuple[int, list[int], MessageChunk]],
    count: int,
    outcome: Future[Sequence[Position]],
    _: object,
) -> None:
    """Once every chunk of a batch is answered: its positions in message order, or the first
    failure."""
    if outcome.done() or not all(s.done() for s in sent):
        return
    for s in sent:
        error = s.exception()
        if error is not None:
            outcome.set_exception(error)
            return
    positions: list[Position | None] = [None] * count
    for s, (partition, indexes, _chunk) in zip(sent, chunks, strict=True):
        base = s.result()
        for k, i in enumerate(indexes):
            positions[i] = Position(partition, base + k if base >= 0 else -1)
    outcome.set_result([p for p in positions if p is not None])


def _failed(error: BaseException) -> Future[Sequence[Position]]:
    future: Future[Sequence[Position]] = Future()
    future.set_exception(error)
    return future
