"""The log's writer thread: group commit for the embedded log.

Appenders validate and encode their batch in their own thread and queue it here. One thread takes
everything queued, gives each batch its offsets and writes each partition's batches with one
``write``. Under ``always`` durability a second thread then fdatasyncs each touched partition once
and tells the round's appenders, while the first writes the next round. When much of the next
round is already written by then (``HANDOFF_BYTES``), the second thread hands the round to a
third (the teller) and syncs the next one at once: a large fdatasync does not wait behind Python
work done for the round before it, and a round with little after it has no hand-off in the way
of its acks. The teller also drops each round's synced pages past the page-cache window.
Concurrent appenders so share both the write and the fdatasync.

``interval`` durability fdatasyncs dirty partitions every ``flush_interval_ms`` and tells appenders
once their batch is written; ``never`` leaves flushing to the OS. Queued bytes are bounded: past
``max_pending_bytes`` an append is refused with ``QueueFull`` (backpressure), never buffered
without limit; ``wait_for_room`` waits until the writer has taken enough of the queue for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

from headwater.bus.embedded import format as fmt
from headwater.bus.embedded.partition import Partition
from headwater.bus.errors import BusClosed, BusUnavailable, QueueFull

log = logging.getLogger(__name__)

#: Under ``always``, a synced round is handed to the teller (so that the next fdatasync starts
#: at once) when at least this much is written by the time it is synced; with less, the syncer
#: tells the round first. Measured on this project's machine, an fdatasync of up to ~128 KiB
#: costs about its fixed part (0.26-0.31 ms: the inode and the cache flush), so starting it a
#: tell later costs little, while a hand-off costs the told round's acks a thread wake-up.
HANDOFF_BYTES = 128 << 10

#: Called once a batch is durable (or failed): ``(base_offset, None)`` or ``(-1, error)``.
#: A ``Done`` may also have a ``round_end`` attribute: called once per group commit after every
#: ``Done`` of the round, so that a caller can tell its waiters once per round, not per batch.
Done = Callable[[int, BaseException | None], None]


def _tell(results: list[tuple[Done, int, BaseException | None]]) -> None:
    """Call each batch's ``Done``, then each distinct ``round_end`` once."""
    ends: dict[Callable[[], None], None] = {}  # (bound methods of one object are equal)
    for done, base, error in results:
        done(-1 if error is not None else base, error)
        end = getattr(done, "round_end", None)
        if end is not None:
            ends[end] = None
    for end in ends:
        end()


#: Told once every batch of an append has its outcome: the base offset of each batch (-1 for
#: one that failed) and the first error, if any.
Finish = Callable[[list[int], BaseException | None], None]


class Parts:
    """The batches of one append (one per partition, or a worker's request over several
    topics): each batch's ``Done`` is ``part(i)``, and ``finish`` is called once, on the
    writer's thread, when the last of them is told. ``round_end`` is passed on to the writer."""

    __slots__ = ("_bases", "_error", "_finish", "_left", "_lock", "round_end")

    def __init__(self, n: int, finish: Finish, round_end: Callable[[], None] | None = None) -> None:
        self._bases = [-1] * n
        self._left = n
        self._error: BaseException | None = None
        self._finish = finish
        self._lock = threading.Lock()
        self.round_end = round_end

    def part(self, i: int) -> Done:
        return _Part(self, i)

    def _done(self, i: int, base: int, error: BaseException | None) -> None:
        with self._lock:
            self._bases[i] = base
            self._error = self._error or error
            self._left -= 1
            if self._left:
                return
        self._finish(self._bases, self._error)


class _Part:
    __slots__ = ("i", "parts", "round_end")

    def __init__(self, parts: Parts, i: int) -> None:
        self.parts = parts
        self.i = i
        self.round_end = parts.round_end

    def __call__(self, base: int, error: BaseException | None) -> None:
        self.parts._done(self.i, base, error)


class _Round(NamedTuple):
    """A round the syncer took: what was written and the partitions it touched, each
    partition's fdatasync error, the failure of the whole round (a bug in the syncer), if any,
    and whether the syncer told it itself."""

    written: list[tuple[Done, int, Partition]]
    touched: set[Partition]
    errors: dict[Partition, BaseException]
    failure: BaseException | None
    told: bool


def _dones(taken: _Round) -> list[Done]:
    return [done for done, _, _ in taken.written]


class LogWriter:
    def __init__(
        self,
        policy: Literal["always", "interval", "never"],
        interval_s: float,
        max_pending_bytes: int,
        on_visible: Callable[[], None],
    ) -> None:
        self.policy = policy
        self._interval = interval_s
        self._max_pending = max_pending_bytes
        self._on_visible = on_visible
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._room = threading.Condition(lock)  # told when the writer takes the queue
        self._queue: list[tuple[Partition, fmt.EncodedBatch, Done]] = []
        self._pending_bytes = 0
        self._dirty: set[Partition] = set()
        self._closing = False
        self._busy = False
        self._failure: BaseException | None = None
        self._sync_cond = threading.Condition()
        self._to_sync: list[tuple[Done, int, Partition]] = []
        self._to_sync_bytes = 0
        self._untold = 0  # rounds taken by the syncer whose appenders are not told yet
        self._syncer_stop = False
        # synced rounds, in order, for the teller (None: no more)
        self._rounds: queue.SimpleQueue[_Round | None] = queue.SimpleQueue()
        self._syncers: list[threading.Thread] = []
        if policy == "always":
            self._syncers = [
                threading.Thread(target=self._run_syncer, name="headwater-log-syncer", daemon=True),
                threading.Thread(target=self._run_teller, name="headwater-log-teller", daemon=True),
            ]
            for thread in self._syncers:
                thread.start()
        self._thread = threading.Thread(target=self._run, name="headwater-log-writer", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[Partition, fmt.EncodedBatch, Done]]) -> None:
        """Queue encoded batches (all or none)."""
        size = sum(len(batch.body) for _, batch, _ in items)
        with self._cond:
            if self._closing:
                raise BusClosed("the log is closing")
            if self._failure is not None:
                raise BusUnavailable(f"the log cannot write: {self._failure}")
            if not self._fits(size):
                raise QueueFull(
                    f"the log's write queue is full ({self._pending_bytes} bytes queued, "
                    f"limit {self._max_pending}); retry shortly",
                    size,
                )
            self._queue += items
            self._pending_bytes += size
            self._cond.notify()

    def _fits(self, size: int) -> bool:
        """Whether ``size`` more bytes may be queued now (one append always fits an empty
        queue, whatever its size). Called holding the lock."""
        return not self._pending_bytes or self._pending_bytes + size <= self._max_pending

    def wait_for_room(self, size: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``size`` bytes fit in the queue (or the log
        closes or fails, which the next ``submit`` reports); whether they fit."""
        with self._room:
            self._room.wait_for(
                lambda: self._fits(size) or self._closing or self._failure is not None, timeout
            )
            return self._fits(size)

    def _run(self) -> None:
        next_sync = time.monotonic() + self._interval
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    if self.policy == "interval" and self._dirty:
                        left = next_sync - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                queue, self._queue = self._queue, []
                size, self._pending_bytes = self._pending_bytes, 0
                closing = self._closing
                self._busy = True
                if queue:
                    self._room.notify_all()
            try:
                self._write(queue, size)
            except BaseException as e:  # a bug, not I/O: fail loudly, never hang appenders
                log.exception("the log writer failed")
                self._fail_everything([done for _, _, done in queue], e, "write")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if self.policy == "interval" and (time.monotonic() >= next_sync or closing):
                self._sync(self._dirty)
                for p in self._dirty:
                    p.drop_synced()
                self._dirty = set()
                next_sync = time.monotonic() + self._interval
            if closing and not queue:
                with self._cond:
                    if not self._queue:
                        return

    def _write(self, queue: list[tuple[Partition, fmt.EncodedBatch, Done]], size: int) -> None:
        """Write ``queue`` (``size`` bytes of batch bodies, as ``submit`` counted them)."""
        if not queue:
            return
        by_partition: dict[Partition, list[tuple[fmt.EncodedBatch, Done]]] = {}
        for partition, batch, done in queue:
            by_partition.setdefault(partition, []).append((batch, done))
        written: list[tuple[Done, int, Partition]] = []
        failed: list[tuple[Done, BaseException]] = []
        for partition, items in by_partition.items():
            try:
                bases = partition.write([batch for batch, _ in items])
            except OSError as e:
                log.error("write to %s/%d failed: %s", partition.topic, partition.index, e)
                error = BusUnavailable(
                    f"could not write to {partition.topic}/{partition.index}: {e}"
                )
                failed += [(done, error) for _, done in items]
                continue
            written += [
                (done, base, partition) for (_, done), base in zip(items, bases, strict=True)
            ]
        if failed:
            _tell([(done, -1, error) for done, error in failed])
        if self.policy == "always":  # the syncer thread makes it durable while we write on
            with self._sync_cond:
                self._to_sync += written
                self._to_sync_bytes += size
                self._sync_cond.notify()
            return
        touched = {p for _, _, p in written}
        for p in touched:
            p.mark_durable(p.next_offset)
        if self.policy == "interval":
            self._dirty |= touched
        if written:
            self._on_visible()
        _tell([(done, base, None) for done, base, _ in written])

    def _fail_everything(self, dones: list[Done], error: BaseException, doing: str) -> None:
        """A bug, not I/O, while ``doing`` (write, sync, ...): the log refuses appends from now
        on, and each of ``dones`` is told so (one already told is passed over)."""
        with self._cond:
            self._failure = error
            self._room.notify_all()
        failure = BusUnavailable(f"the log cannot {doing}: {error}")
        for done in dones:
            try:
                _tell([(done, -1, failure)])
            except Exception:  # a future already resolved: nothing left to tell
                log.debug("append already resolved", exc_info=True)

    def _run_syncer(self) -> None:
        """Under ``always``: fdatasync what the writer wrote, then tell the round's appenders.
        When the writer has written ``HANDOFF_BYTES`` or more by then (or the teller is still
        telling an earlier round), the round goes to the teller instead and the next fdatasync
        starts at once, not behind Python work done for this one; otherwise it is told here,
        without a thread hand-off in its acks' way. The teller drops each round's synced
        pages."""
        while True:
            with self._sync_cond:
                while not self._to_sync and not self._syncer_stop:
                    self._sync_cond.wait()
                if not self._to_sync:
                    break
                written, self._to_sync = self._to_sync, []
                self._to_sync_bytes = 0
                self._untold += 1
            touched = {p for _, _, p in written}
            failure: BaseException | None = None
            errors: dict[Partition, BaseException] = {}
            try:
                errors = self._sync(touched)
            except BaseException as e:
                log.exception("the log syncer failed")
                with self._cond:
                    self._failure = e  # (refused from now on, before the round is told)
                    self._room.notify_all()
                failure = e
            with self._sync_cond:
                here = failure is None and self._to_sync_bytes < HANDOFF_BYTES and self._untold == 1
            taken = _Round(written, touched, errors, failure, here)
            if here:
                self._tell_taken(taken)
            self._rounds.put(taken)
        self._rounds.put(None)

    def _run_teller(self) -> None:
        """Under ``always``: tell, in order, the synced rounds the syncer handed over, and drop
        every round's synced pages past the page-cache window (most of a millisecond for
        megabytes of pages: never between two fdatasyncs)."""
        while (taken := self._rounds.get()) is not None:
            if not taken.told:
                self._tell_taken(taken)
            for p in taken.touched:
                p.drop_synced()

    def _tell_taken(self, taken: _Round) -> None:
        """Tell the appenders of a round the syncer took, and count it told."""
        try:
            if taken.failure is not None:
                self._fail_everything(_dones(taken), taken.failure, "sync")
                return
            for p in taken.touched:
                if p not in taken.errors:
                    p.mark_durable(p.synced_offset)
            self._on_visible()
            _tell([(done, base, taken.errors.get(p)) for done, base, p in taken.written])
        except BaseException as e:  # a bug, not I/O: fail loudly, never hang appenders
            log.exception("the log failed telling its appenders")
            self._fail_everything(_dones(taken), e, "tell its appenders")
        finally:
            with self._sync_cond:
                self._untold -= 1
                self._sync_cond.notify_all()

    def _sync(self, partitions: set[Partition]) -> dict[Partition, BaseException]:
        errors: dict[Partition, BaseException] = {}
        for p in partitions:
            try:
                p.sync()
            except OSError as e:
                # An fdatasync failure is not retried: the page cache can no longer be trusted.
                log.error("fdatasync of %s/%d failed: %s", p.topic, p.index, e)
                errors[p] = BusUnavailable(f"could not make {p.topic}/{p.index} durable: {e}")
                with self._cond:
                    self._failure = errors[p]
                    self._room.notify_all()
        return errors

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been written (and, under ``always``,
        synced)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue and not self._busy, timeout):
                return False
        with self._sync_cond:
            return self._sync_cond.wait_for(lambda: not self._to_sync and not self._untold, timeout)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._room.notify_all()
        self._thread.join()
        with self._sync_cond:
            self._syncer_stop = True
            self._sync_cond.notify_all()
        for thread in self._syncers:
            thread.join()
