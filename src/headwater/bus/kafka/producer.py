"""The produce path of the Kafka backend: one future per appended batch, resolved by the
delivery reports that a background thread serves."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from headwater.bus.errors import BusUnavailable, QueueFull
from headwater.bus.kafka.client import load_kafka
from headwater.bus.kafka.errors import classify
from headwater.bus.records import Message, Position

_POLL_INTERVAL_S = 0.1
_MAX_QUEUED = 100_000  # librdkafka's default queue.buffering.max.messages

#: One batch for ``send_all``: its topic, its messages and their indexes by partition.
Send = tuple[str, Sequence[Message], Mapping[int, list[int]]]
_log = logging.getLogger(__name__)


class _Batch:
    """The outcome of one ``append``: done when every message has a delivery report."""

    def __init__(self, topic: str, size: int) -> None:
        self.topic = topic
        self.future: Future[Sequence[Position]] = Future()
        self.future.set_running_or_notify_cancel()  # what was handed to Kafka can't be undone
        self._positions: list[Position | None] = [None] * size
        self._remaining = size
        self._error: Any = None
        self._lock = threading.Lock()

    def delivered(self, index: int, error: Any, message: Any) -> None:
        """Delivery report of message ``index`` (librdkafka's callback, any thread)."""
        with self._lock:
            if error is None:
                self._positions[index] = Position(message.partition(), message.offset())
            elif self._error is None:
                self._error = error
            self._remaining -= 1
            if self._remaining:
                return
        self._resolve()

    def fail(self, indexes: Sequence[int], error: Any) -> None:
        """Messages that were never handed to librdkafka."""
        for index in indexes:
            self.delivered(index, error, None)

    def _resolve(self) -> None:
        if self._error is not None:
            self.future.set_exception(classify(self._error, f"appending to {self.topic!r}"))
        else:
            self.future.set_result([p for p in self._positions if p is not None])


class DeliveryProducer:
    """An idempotent ``acks=all`` producer and the thread that serves its delivery reports."""

    def __init__(self, settings: Mapping[str, Any], queue_timeout_s: float) -> None:
        kafka = load_kafka()
        self.fatal_error: Any = None
        self._producer = kafka.Producer({**settings, "error_cb": self._on_error})
        self._max_queued = int(settings.get("queue.buffering.max.messages", _MAX_QUEUED))
        self._queue_timeout_s = queue_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="headwater-kafka-delivery", daemon=True
        )
        self._thread.start()

    def send_all(self, sends: Sequence[Send]) -> list[Future[Sequence[Position]]]:
        """Produce every ``(topic, messages, partitions)``, or raise ``QueueFull`` having
        produced none when the queue holds too many messages to take them all (an empty queue
        takes any number: librdkafka's own limit then makes them wait for room in turn)."""
        needed = sum(len(messages) for _, messages, _ in sends)
        if not self._fits(needed):
            raise QueueFull(
                f"the Kafka producer's queue holds {len(self._producer)} messages (limit "
                f"{self._max_queued}: queue.buffering.max.messages); retry shortly",
                needed,
            )
        return [self.send(topic, messages, partitions) for topic, messages, partitions in sends]

    def _fits(self, needed: int) -> bool:
        queued = len(self._producer)
        return not queued or queued + needed <= self._max_queued

    def wait_for_room(self, needed: int, timeout: float) -> bool:
        """Serve delivery reports (what frees the queue) until ``needed`` messages fit, at
        most ``timeout`` seconds; whether they fit."""
        deadline = time.monotonic() + timeout
        while not self._fits(needed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._producer.poll(min(remaining, _POLL_INTERVAL_S))
        return True

    def send(
        self, topic: str, messages: Sequence[Message], partitions: Mapping[int, list[int]]
    ) -> Future[Sequence[Position]]:
        """Produce ``messages`` to the partitions chosen for them, in order per partition."""
        batch = _Batch(topic, len(messages))
        if not messages:
            batch.future.set_result([])
            return batch.future
        order = [(p, i) for p, indexes in partitions.items() for i in indexes]
        for n, (partition, index) in enumerate(order):
            message = messages[index]
            try:
                self._produce(topic, partition, message, functools.partial(batch.delivered, index))
            except Exception as exc:  # a full queue past its timeout, or a fatal producer error
                batch.fail([i for _, i in order[n:]], exc)
                break
        return batch.future

    def _produce(self, topic: str, partition: int, message: Message, on_delivery: Any) -> None:
        deadline = time.monotonic() + self._queue_timeout_s
        while True:
            try:
                self._producer.produce(
                    topic,
                    value=message.value,
                    key=message.key,
                    partition=partition,
                    headers=list(message.headers) or None,
                    timestamp=message.timestamp or 0,
                    on_delivery=on_delivery,
                )
                return
            except BufferError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BusUnavailable(
                        f"the producer queue stayed full for {self._queue_timeout_s:.0f} s"
                    ) from None
                # Serving delivery reports is what frees the queue: wait on it, not on a timer.
                self._producer.poll(min(remaining, _POLL_INTERVAL_S))

    def flush(self, timeout: float | None) -> None:
        remaining = self._producer.flush(-1 if timeout is None else timeout)
        if remaining:
            raise BusUnavailable(
                f"{remaining} messages were not yet acknowledged after {timeout} s"
            )

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for outstanding messages, then fail what is left."""
        try:
            self._producer.flush(timeout)
        finally:
            self._producer.purge()
            self._producer.poll(0)  # deliver the purge reports, so no future stays pending
            self._stop.set()
            self._thread.join()

    def _on_error(self, error: Any) -> None:
        """librdkafka's client-wide errors. Only a fatal one needs us: the producer is then
        unusable (its pending messages fail) and must be replaced."""
        if error.fatal():
            self.fatal_error = error

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._producer.poll(_POLL_INTERVAL_S)
            except Exception:  # a bug in a callback must not stop every future resolving
                _log.exception("serving Kafka delivery reports failed")
