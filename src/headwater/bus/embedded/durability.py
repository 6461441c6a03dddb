"""When appended batches become durable: group commit (``always``), a timer (``interval``), or
never (the OS decides).

Under ``always`` every append registers a waiter; one syncer thread takes all waiters present,
fdatasyncs each partition they touched once, and resolves them together, so concurrent appenders
share one fdatasync per partition per round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from headwater.bus.embedded.partition import Partition
from headwater.bus.errors import BusUnavailable

log = logging.getLogger(__name__)

Waiter = Callable[[BaseException | None], None]


class Durability:
    """Makes written batches durable by the configured policy and tells waiters when."""

    def __init__(self, policy: Literal["always", "interval", "never"], interval_s: float) -> None:
        self.policy = policy
        self._interval = interval_s
        self._cond = threading.Condition()
        self._waiters: list[tuple[Partition, Waiter]] = []
        self._dirty: set[Partition] = set()
        self._closing = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.on_durable: Callable[[], None] = lambda: None
        if policy != "never":
            self._thread = threading.Thread(
                target=self._run, name=f"headwater-log-sync-{policy}", daemon=True
            )
            self._thread.start()

    def written(self, partition: Partition, waiter: Waiter) -> None:
        """A batch was written to ``partition``; call ``waiter`` once it is durable."""
        if self.policy != "always":
            partition.mark_durable(partition.next_offset)
            if self.policy == "interval":
                with self._cond:
                    self._dirty.add(partition)
            waiter(None)
            return
        with self._cond:
            if self._failure is not None:
                failure = self._failure
            else:
                self._waiters.append((partition, waiter))
                self._cond.notify()
                return
        waiter(failure)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self.policy == "always":
                    while not self._waiters and not self._closing:
                        self._cond.wait()
                else:
                    self._cond.wait_for(lambda: self._closing, timeout=self._interval)
                if self._closing and not self._waiters and not self._dirty:
                    return
                waiters, self._waiters = self._waiters, []
                dirty = self._dirty | {p for p, _ in waiters}
                self._dirty = set()
            self._sync(dirty, waiters)

    def _sync(self, dirty: set[Partition], waiters: list[tuple[Partition, Waiter]]) -> None:
        error: BaseException | None = None
        for partition in dirty:
            try:
                partition.mark_durable(partition.sync())
            except OSError as e:
                log.error("fdatasync of %s/%d failed: %s", partition.topic, partition.index, e)
                error = BusUnavailable(
                    f"could not make {partition.topic}/{partition.index} durable: {e}"
                )
        if error is not None:
            with self._cond:
                self._failure = error  # fsync failures are not retried: the page cache is suspect
        if waiters:
            self.on_durable()
        for _, waiter in waiters:
            waiter(error)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
