"""The webhook workers of seed 004 over headwater's bus, in one process: a consumer per topic
(per receiver for ``to_receiver``) and the loop of the state's schedules.

- FromSender reads ``webhooks.from_sender``: dedup, record, route to ``to_receiver.<r>``; or,
  for a receiver that is not ordered, rate limited or disabled, run its ToReceiver step in
  place, up to ``concurrency`` of them a receiver (see ``_from_sender``); a slow receiver's next
  messages go through its topic.
- ToReceiver reads ``webhooks.to_receiver.<r>`` (one consumer per receiver, so a disabled or
  ordered receiver holds only its own messages): rate limit, send, and hand the message on to
  ``to_sender`` (a result), ``pending_from_receiver.<r>`` (a result to come) or
  ``failed_messages``.
- FromReceiverAsync reads ``webhooks.pending_from_receiver.<r>`` and schedules the polls.
- ToSender reads ``webhooks.to_sender`` and calls the sender back.
- Failed reads ``webhooks.failed_messages`` and logs each failure; ``headwater webhooks failed``
  lists, shows and retries them from the state.
- The schedules loop runs due retries, polls and callbacks (:mod:`.schedules`).

Each consumer commits a record's offset only once its step and its hand-offs are done (the
hand-offs durably on the log), so a worker that dies leaves its records to be read again; the
steps are safe to run twice (see :mod:`.receiving`). Several worker processes share the topics
through consumer groups (Kafka) and the work of the schedules through the state (Redis, or the
SQLite file on one machine); a ``to_receiver`` topic has one partition, so one process at a time
reads a receiver's queue, while retries of its messages may run in any process: the rate limit
lives in the state and holds across all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from headwater.bus.base import Bus, Consumer
from headwater.bus.records import Message, Record, TopicPartition
from headwater.bus.waiting import append_many_when_room
from headwater.errors import HeadwaterError, TerminalError
from headwater.http.client import HttpClient
from headwater.webhooks.callbacks import to_sender
from headwater.webhooks.config import ReceiverConfig, WebhooksConfig
from headwater.webhooks.receiving import Receiving, Step
from headwater.webhooks.routing import Topics, WebhookMessage, from_senders
from headwater.webhooks.schedules import run_schedules
from headwater.webhooks.state.base import LoopState, MessageState, StateStore, Status

log = logging.getLogger(__name__)
POLL_RECORDS = 500
IDLE_POLL_S = 0.2  # a consumer's wait for records when it has nothing in flight
BUSY_POLL_S = 0.005
HOLD_CHECK_S = 0.25  # how often a held receiver (disabled, or ordered behind a retry) looks again
# a receiver at its bound of steps in place (``concurrency``) whose steps take this long on
# average, or none of which has ended for this long, is slow: its next messages go through its
# topic; FromSender waits only for one that is not (see ``InPlace.room``)
SLOW_S = 0.25
MAX_BACKOFF_S = 30.0

Handle = Callable[[Record], Awaitable[None]]
BatchHandle = Callable[[list[Record]], Awaitable[None]]


class InPlace:
    """The ToReceiver steps FromSender runs in place, by receiver: at most ``bound`` of them
    a receiver (a poll's worth may overshoot), unless the receiver is slow (``SLOW_S``)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.count: dict[str, int] = {}
        self._progress: dict[str, float] = {}  # when one last ended (or the first began)
        self._took: dict[str, float] = {}  # how long they take (a moving average, seconds)
        self._ended = asyncio.Event()

    def take(self, receiver: str) -> bool:
        """Count one more step for ``receiver``; False (nothing counted) when it is at the
        bound and slow: its message goes through its topic."""
        taken = self.count.get(receiver, 0)
        if taken >= self.bound and self.slow(receiver):
            return False
        if not taken:
            self._progress[receiver] = time.monotonic()
        self.count[receiver] = taken + 1
        return True

    def untake(self, receiver: str) -> None:
        """Uncount a step counted by ``take`` that does not run after all."""
        self.count[receiver] -= 1

    def ended(self, receiver: str, started: float) -> None:
        now = time.monotonic()
        self.count[receiver] -= 1
        self._progress[receiver] = now
        took = self._took.get(receiver)
        self._took[receiver] = now - started if took is None else 0.9 * took + 0.1 * (now - started)
        self._ended.set()

    def slow(self, receiver: str) -> bool:
        """Whether its steps take ``SLOW_S`` on average, or none ended for as long."""
        idle = time.monotonic() - self._progress.get(receiver, 0.0)
        return idle > SLOW_S or self._took.get(receiver, 0.0) > SLOW_S

    async def room(self, stop: asyncio.Event) -> None:
        """Wait while a receiver is at the bound and not slow (before FromSender polls). A
        backlog is then taken on in place as steps end, not spilled through the topics, which
        cost more; a slow receiver is not waited for (its messages go through its topic), so
        it holds the others' messages ``SLOW_S`` at most."""
        while not stop.is_set() and any(
            n >= self.bound and not self.slow(r) for r, n in self.count.items()
        ):
            self._ended.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), SLOW_S / 4)


class Workers:
    """Every webhook worker of one process, on ``bus`` and ``store``."""

    def __init__(self, config: WebhooksConfig, bus: Bus, store: StateStore) -> None:
        self.config = config
        self.bus = bus
        self.store = store
        self.ctx: Receiving | None = None
        self.names = Topics(config.topic_prefix)
        self.state = LoopState(store)  # the backend's own, made on the loop by ``run``
        self._stop = asyncio.Event()
        self._grace_s = 10.0
        self._in_place = InPlace(config.concurrency)  # the ToReceiver steps FromSender runs
        # a running step's consumer's (running, settling) sets: see ``_release``
        self._slots: dict[asyncio.Task[None], tuple[set[asyncio.Task[None]], ...]] = {}

    def topics(self) -> dict[str, int | None]:
        """Every topic the workers read or write, with its partition count (None: the bus's
        default)."""
        t = self.names
        topics: dict[str, int | None] = {
            t.from_sender: None,
            t.to_sender: None,
            t.failed_messages: 1,
        }
        for r in self.config.receivers:
            topics[t.to_receiver(r.name)] = 1
            topics[t.pending_from_receiver(r.name)] = 1
        return topics

    def create_topics(self) -> None:
        for name, partitions in self.topics().items():
            self.bus.create_topic(name, partitions)

    async def run(self, stop: asyncio.Event, grace_s: float = 10.0) -> None:
        """Run until ``stop`` is set; then finish what is in flight (for at most ``grace_s``)
        and commit it."""
        self._stop, self._grace_s = stop, grace_s
        await asyncio.to_thread(self.create_topics)
        # the state's changes on this loop are committed together, once per turn; a request
        # waits for them (HttpClient's ``before``), and so do appends and offset commits
        self.store.batch_on(asyncio.get_running_loop())
        self.state = state = self.store.on_loop()
        async with HttpClient(before=state.flush) as session:
            self.ctx = ctx = Receiving(
                self.store,
                self.config,
                session,
                respond=self._respond,
                pending=self._pending,
                failed=self._failed,
                state=state,
                inline_callbacks=True,  # see ``_respond``
            )
            t = self.names
            loops = [
                self._consume(
                    stop,
                    "from_sender",
                    [t.from_sender],
                    self._from_sender,
                    batched=True,
                    ready=functools.partial(self._in_place.room, stop),
                ),
                self._consume(stop, "pending", self._pending_topics(), self._schedule_poll),
                self._consume(stop, "to_sender", [t.to_sender], self._to_sender),
                self._consume(stop, "failed", [t.failed_messages], self._log_failed),
                run_schedules(ctx, stop),
            ]
            for r in self.config.receivers:
                loops.append(
                    self._consume(
                        stop,
                        f"to_receiver.{r.name}",
                        [t.to_receiver(r.name)],
                        self._receiving(r),
                        1 if r.ordered else self.config.concurrency,
                    )
                )
            tasks = [asyncio.create_task(loop) for loop in loops]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await state.close()
                self.store.batch_on(None)

    def _pending_topics(self) -> list[str]:
        return [self.names.pending_from_receiver(r.name) for r in self.config.receivers]

    # -- hand-offs: appended durably before the record that caused them is committed ----------
    async def _emit(self, batches: Mapping[str, Sequence[Message]]) -> None:
        """Append hand-offs, each topic's in one batch, once the state changes they follow
        are committed."""
        await self.state.flush()
        futures = await append_many_when_room(self.bus, batches)
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    async def _respond(self, state: MessageState) -> None:
        """The response goes back to the sender from here, in the step that got it (its
        record, uncommitted until then, brings the message back here after a crash); an
        ordered receiver's, whose queue must not wait for callbacks, through ``to_sender``."""
        assert self.ctx is not None
        if self.ctx.calls_back_inline(state):
            await to_sender(self.ctx, *state.key, state=state)
            return
        out = WebhookMessage(
            state.source_id, state.message_id, state.receiver, state.response or b""
        )
        await self._emit({self.names.to_sender: [out.to_message()]})

    async def _pending(self, state: MessageState) -> None:
        out = WebhookMessage(state.source_id, state.message_id, state.receiver, b"")
        await self._emit({self.names.pending_from_receiver(state.receiver): [out.to_message()]})

    async def _failed(self, state: MessageState) -> None:
        out = WebhookMessage(
            state.source_id, state.message_id, state.receiver, state.payload, state.reason
        )
        await self._emit({self.names.failed_messages: [out.to_message()]})

    # -- the steps, one record each -----------------------------------------------------------
    async def _from_sender(self, records: list[Record]) -> None:
        """A whole poll's records at once: recorded in one step of the state, routed in one
        append per topic; or, for a receiver that is not ordered, rate limited or disabled, its
        ToReceiver step run here (``_take_on``), without the trip through ``to_receiver.<r>``
        (an append, an fdatasync, a read). The records are committed once those steps are done
        too, so a worker that dies runs them again from ``from_sender``. The steps do not count
        toward this consumer's limit: ``concurrency`` a receiver bounds them, the consumer
        waiting for a receiver at that bound while it ends them (``InPlace.room``); a slow
        receiver's messages go through its topic, so it holds the others' for ``SLOW_S`` at
        most."""
        messages = []
        for record in records:
            try:
                messages.append(WebhookMessage.from_record(record.value, record.headers))
            except TerminalError as e:
                log.error(
                    "webhooks from_sender: skipping %s@%d: %s", record.topic, record.offset, e
                )
        ctx = self.ctx
        assert ctx is not None
        # the steps run here are decided first: their sends are claimed with the arrival
        now = time.time()
        claims: list[float | None] = []
        claimed: dict[tuple[str, str], float | None] = {}  # (a repeat's: the first's)
        taken: dict[tuple[str, str], int] = {}
        for message in messages:
            receiver = self._takes_on(message)
            claim = None if receiver is None else ctx.claim_until(receiver, message.source_id, now)
            claims.append(claim)
            claimed.setdefault(key := _key(message), claim)
            if receiver is not None:
                taken[key] = taken.get(key, 0) + 1
        recorded: list[MessageState] = []
        routed = await from_senders(self.state, self.config, messages, now, recorded, claims)
        ctx.remember(recorded)  # (before their records can be read)
        ctx.arrival_claims([(s.key, c) for s in recorded if (c := claimed[s.key]) is not None])
        batches: dict[str, list[Message]] = {}
        here: list[WebhookMessage] = []
        for topic, out in routed:
            if taken.get(key := _key(out)) and topic == self.names.to_receiver(out.receiver):
                taken[key] -= 1
                here.append(out)
            else:
                batches.setdefault(topic, []).append(out.to_message())
        for message in messages:  # taken, but known already (past ARRIVED): no step
            if taken.get(key := _key(message)):
                taken[key] -= 1
                self._in_place.untake(message.receiver)
        try:
            if batches:
                await self._emit(batches)
        except BaseException:
            for message in here:  # (not taken on after all: the batch runs again)
                self._in_place.untake(message.receiver)
                ctx.forget_claim(_key(message))
            raise
        if here:
            self._release()
            done = await asyncio.gather(*(self._take_on(m) for m in here), return_exceptions=True)
            for error in done:
                if isinstance(error, BaseException):
                    raise error

    def _takes_on(self, message: WebhookMessage) -> ReceiverConfig | None:
        """The receiver, when FromSender runs this message's ToReceiver step itself (counted
        when so)."""
        name = message.receiver
        receiver = self.config.receiver(name)
        assert self.ctx is not None
        if (
            receiver is None
            or receiver.ordered
            or receiver.rate_limit is not None  # (its pace is the limit's: many steps waiting
            or self.ctx.disabled(name)  # on it in every process cost more)
            or not self._in_place.take(name)
        ):
            return None
        return receiver

    async def _take_on(self, message: WebhookMessage) -> None:
        """The ToReceiver step of a message FromSender took on; one that fails (the state or
        the receiver's connection gone) is handed to ``to_receiver.<r>`` after all, whose
        consumer retries it."""
        ctx = self.ctx
        assert ctx is not None
        started = time.monotonic()
        try:
            await ctx.to_receiver(message.source_id, message.message_id, from_topic=True)
        except TerminalError as e:
            log.error("webhooks from_sender: skipping %s/%s: %s", *_key(message), e)
        except Exception as e:
            log.warning("webhooks: %s/%s goes through its topic: %r", *_key(message), e)
            await self._emit({self.names.to_receiver(message.receiver): [message.to_message()]})
        finally:
            ctx.forget_claim(_key(message))
            self._in_place.ended(message.receiver, started)

    def _receiving(self, receiver: ReceiverConfig) -> Handle:
        async def handle(record: Record) -> None:
            ctx = self.ctx
            assert ctx is not None
            message = WebhookMessage.from_record(record.value, record.headers)
            while ctx.disabled(receiver.name):  # held on the topic until enabled again
                await self._hold()
            step = await ctx.to_receiver(message.source_id, message.message_id, from_topic=True)
            if receiver.ordered and step is Step.SCHEDULED:
                # strict FIFO: the receiver's next message waits for this one's retries
                while (state := await self.state.get(*_key(message))) is not None and (
                    state.status is Status.ARRIVED
                ):
                    await self._hold()

        return handle

    async def _hold(self) -> None:
        """Wait a moment before looking again; a stopping worker gives the record up."""
        if self._stop.is_set():
            raise asyncio.CancelledError
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), HOLD_CHECK_S)

    async def _schedule_poll(self, record: Record) -> None:
        assert self.ctx is not None
        state = await self.state.get(
            *_key(WebhookMessage.from_record(record.value, record.headers))
        )
        if state is not None and state.status is Status.DELIVERED_TO_RECEIVER:
            await self.ctx.schedule_poll(state)

    async def _to_sender(self, record: Record) -> None:
        assert self.ctx is not None
        message = WebhookMessage.from_record(record.value, record.headers)
        await to_sender(self.ctx, message.source_id, message.message_id, from_topic=True)

    async def _log_failed(self, record: Record) -> None:
        message = WebhookMessage.from_record(record.value, record.headers)
        log.warning(
            "webhooks: message %s/%s to %s FAILED: %s",
            message.source_id,
            message.message_id,
            message.receiver,
            message.reason,
        )

    # -- the consumer loop ------------------------------------------------------------------
    async def _consume(
        self,
        stop: asyncio.Event,
        name: str,
        topics: list[str],
        handle: Handle | BatchHandle,
        concurrency: int | None = None,
        *,
        batched: bool = False,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Read ``topics`` for the worker's group (``headwater-webhooks.<name>``), run
        ``handle`` on up to ``concurrency`` records at once, and commit, per partition, the
        offsets whose records (and every one before them) are done. ``batched``: ``handle``
        takes each poll's records together, as one task. ``ready``: awaited before each poll."""
        if not topics:
            return
        limit = concurrency or self.config.concurrency
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"webhooks-{name}")
        consumer: Consumer = await loop.run_in_executor(
            pool, self.bus.consumer, self.names.group(name), topics
        )
        window: dict[TopicPartition, deque[tuple[int, asyncio.Task[None]]]] = {}
        running: set[asyncio.Task[None]] = set()
        settling: set[asyncio.Task[None]] = set()  # released from the limit (``_release``)
        try:
            while not stop.is_set():
                if len(running) >= limit:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                else:
                    if ready is not None:
                        await ready()
                    wait = BUSY_POLL_S if running else IDLE_POLL_S
                    n = min(POLL_RECORDS, limit - len(running))
                    if consumer.polls_in_place:  # on the loop: a trip through the thread
                        records = consumer.poll(n, 0)  # is a handful of wake-ups
                        if records:
                            await asyncio.sleep(0)  # (the tasks run, whatever keeps coming)
                        else:
                            await consumer.arrivals(wait)
                            records = consumer.poll(n, 0)
                    else:
                        records = await loop.run_in_executor(pool, consumer.poll, n, wait)
                    if batched and records:
                        task = self._task(name, handle, records, stop, running, settling)
                        tasks = [task] * len(records)
                    else:
                        tasks = [
                            self._task(name, handle, r, stop, running, settling) for r in records
                        ]
                    for r, task in zip(records, tasks, strict=True):
                        tp = TopicPartition(r.topic, r.partition)
                        window.setdefault(tp, deque()).append((r.offset, task))
                await self._commit(pool, consumer, window)
            if running or settling:  # finish what is in flight, within the process's grace
                await asyncio.wait(running | settling, timeout=self._grace_s)
            await self._commit(pool, consumer, window)
        finally:
            for t in running | settling:
                t.cancel()
            await loop.run_in_executor(pool, consumer.close)
            pool.shutdown(wait=False)

    def _task(
        self,
        name: str,
        handle: Handle | BatchHandle,
        what: Record | list[Record],
        stop: asyncio.Event,
        running: set[asyncio.Task[None]],
        settling: set[asyncio.Task[None]],
    ) -> asyncio.Task[None]:
        task = asyncio.create_task(self._guarded(name, handle, what, stop))
        running.add(task)
        self._slots[task] = (running, settling)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        running, settling = self._slots.pop(task)
        running.discard(task)
        settling.discard(task)

    def _release(self) -> None:
        """The running step no longer counts toward its consumer's limit (what it still waits
        for is bounded otherwise); its records are committed once it is done, as before."""
        task: asyncio.Task[None] | None = asyncio.current_task()  # type: ignore[assignment]
        slots = self._slots.get(task) if task is not None else None
        if task is not None and slots is not None and task in slots[0]:
            slots[0].discard(task)
            slots[1].add(task)

    async def _commit(
        self,
        pool: ThreadPoolExecutor,
        consumer: Consumer,
        window: dict[TopicPartition, deque[tuple[int, asyncio.Task[None]]]],
    ) -> None:
        offsets: dict[TopicPartition, int] = {}
        for tp, queue in window.items():
            while queue and queue[0][1].done() and not queue[0][1].cancelled():
                offsets[tp] = queue.popleft()[0] + 1
        if offsets:
            await self.state.flush()  # the changes of the steps done, before their offsets
            try:
                if consumer.polls_in_place:
                    consumer.commit(offsets)
                else:
                    await asyncio.get_running_loop().run_in_executor(pool, consumer.commit, offsets)
            except HeadwaterError as e:  # the partitions moved to another member: it reads
                log.warning("webhooks: a commit was refused (%s); the records are read again", e)

    async def _guarded(
        self,
        name: str,
        handle: Handle | BatchHandle,
        what: Record | list[Record],
        stop: asyncio.Event,
    ) -> None:
        """Run ``handle`` until it succeeds: a record that is not a webhook message is logged
        and skipped; any other error (the state or the log unavailable) is retried with
        backoff, the record staying uncommitted, until the worker stops."""
        first = what[0] if isinstance(what, list) else what
        where = f"{first.topic}[{first.partition}]@{first.offset}"
        if isinstance(what, list) and len(what) > 1:
            where += f" (+{len(what) - 1})"
        backoff = 0.5
        while True:
            try:
                await handle(what)  # type: ignore[arg-type]
                return
            except TerminalError as e:
                log.error("webhooks %s: skipping %s: %s", name, where, e)
                return
            except Exception as e:
                log.error(
                    "webhooks %s: %s failed, trying again in %.1f s: %r", name, where, backoff, e
                )
            if stop.is_set():
                raise asyncio.CancelledError
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)


def _key(message: WebhookMessage) -> tuple[str, str]:
    return (message.source_id, message.message_id)
