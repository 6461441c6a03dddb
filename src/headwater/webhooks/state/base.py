"""The webhook state (seed 004, "Databases"): each message with its status and history, every
attempt, the schedule of retries and polls, and the receivers' rate limits, behind one
interface with two backends (:mod:`.sqlite`, embedded, for one machine; :mod:`.redis`, for
several processes and machines), both held to one contract test suite.

Status machine: ARRIVED -> DELIVERED_TO_RECEIVER -> RESPONSE_RECEIVED_FROM_RECEIVER -> DONE,
and FAILED from any state but DONE. A sync response skips nothing: the worker records the
delivery and the response (and DONE, when it called the sender back in place) in one step,
each transition with its own time.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from headwater.errors import TerminalError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Sequence


class Status(StrEnum):
    ARRIVED = "ARRIVED"
    DELIVERED_TO_RECEIVER = "DELIVERED_TO_RECEIVER"
    RESPONSE_RECEIVED_FROM_RECEIVER = "RESPONSE_RECEIVED_FROM_RECEIVER"
    DONE = "DONE"
    FAILED = "FAILED"


# status -> the statuses it may come from (a retry, ``StateStore.retry``, alone leaves FAILED)
ALLOWED_FROM: dict[Status, frozenset[Status]] = {
    Status.ARRIVED: frozenset(),
    Status.DELIVERED_TO_RECEIVER: frozenset({Status.ARRIVED}),
    Status.RESPONSE_RECEIVED_FROM_RECEIVER: frozenset({Status.DELIVERED_TO_RECEIVER}),
    Status.DONE: frozenset({Status.RESPONSE_RECEIVED_FROM_RECEIVER}),
    Status.FAILED: frozenset(
        {Status.ARRIVED, Status.DELIVERED_TO_RECEIVER, Status.RESPONSE_RECEIVED_FROM_RECEIVER}
    ),
}
EXCERPT_BYTES = 512  # of a response body kept with an attempt
# the schedules a retry goes back to, by the stage the message failed in
DELIVER, POLL, CALLBACK = "deliver", "poll", "callback"


class UnknownMessage(TerminalError):
    code = "HW-WH-101"


class InvalidTransition(TerminalError):
    """A status change the machine does not allow (another worker got there first)."""

    code = "HW-WH-102"

    def __init__(self, key: tuple[str, str], current: Status, wanted: Status) -> None:
        super().__init__(f"message {key[0]}/{key[1]} is {current}, it cannot become {wanted}")
        self.current = current
        self.wanted = wanted


@dataclass(frozen=True)
class Attempt:
    """One HTTP exchange for a message: a delivery, a status poll or a callback."""

    at: float
    kind: str  # "deliver", "poll", "callback"
    status_code: int | None  # None: no answer (timeout, connection error)
    duration_ms: float
    excerpt: str = ""  # the start of the response body
    error: str = ""


@dataclass(frozen=True)
class Transition:
    status: Status
    at: float
    reason: str = ""


# what a move passes through on its way (one status, or several in turn), and the attempts it
# records with its change (one, or several in order)
Via = Status | tuple[Status, ...] | None
Attempts = Attempt | tuple[Attempt, ...] | None


@dataclass(frozen=True)
class MessageState:
    source_id: str
    message_id: str
    receiver: str
    status: Status
    payload: bytes
    created_at: float
    updated_at: float
    reason: str = ""  # why it FAILED
    response: bytes | None = None  # the receiver's result, once there is one
    history: tuple[Transition, ...] = field(default_factory=tuple)
    attempts: tuple[Attempt, ...] = field(default_factory=tuple)

    @classmethod
    def arrived(
        cls, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> MessageState:
        """A message just recorded as ARRIVED at ``now``, as ``StateStore.arrive`` records it."""
        history = (Transition(Status.ARRIVED, now),)
        return cls(
            source_id, message_id, receiver, Status.ARRIVED, payload, now, now, history=history
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.source_id, self.message_id)

    def tries(self, kind: str) -> int:
        """Attempts of ``kind`` since the message last (re)entered its current stage: a retried
        message starts its schedule again."""
        since = self.history[-1].at if self.history else 0.0
        return sum(1 for a in self.attempts if a.kind == kind and a.at >= since)

    def last(self, status: Status) -> float | None:
        """When the message last became ``status``."""
        return next((t.at for t in reversed(self.history) if t.status is status), None)

    def moved(
        self,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        """This message as ``StateStore.move`` leaves it (what ``move`` returns, worked out
        here instead of read back)."""
        if via is None:  # (the common case, without the general path's tuples)
            moved: tuple[Transition, ...] = (Transition(status, now, reason),)
        else:
            moved = tuple(Transition(s, at, reason) for s, at in stamped(status, via, now, via_at))
        return MessageState(  # (not ``dataclasses.replace``: a hot path, and it is 5x slower)
            self.source_id,
            self.message_id,
            self.receiver,
            status,
            self.payload,
            self.created_at,
            now,
            reason if status is Status.FAILED else "",
            self.response if response is None else response,
            self.history + moved,
            (*self.attempts, *attempts_of(attempt)) if attempt is not None else self.attempts,
        )

    def resume_stage(self) -> tuple[Status, str]:
        """Where a retry of this FAILED message starts, and on which schedule: the callback
        again when the receiver's response is known, the poll when it was delivered and a
        result is awaited, else the delivery."""
        reached = {t.status for t in self.history}
        if Status.RESPONSE_RECEIVED_FROM_RECEIVER in reached:
            return Status.RESPONSE_RECEIVED_FROM_RECEIVER, CALLBACK
        if Status.DELIVERED_TO_RECEIVER in reached:
            return Status.DELIVERED_TO_RECEIVER, POLL
        return Status.ARRIVED, DELIVER

    def to_json(self) -> dict[str, object]:
        """What the status endpoint and ``headwater webhooks status`` show (times in seconds
        since the epoch; bodies as text, or base64 when they are not UTF-8)."""
        return {
            "source_id": self.source_id,
            "message_id": self.message_id,
            "receiver": self.receiver,
            "status": self.status.value,
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "response": None if self.response is None else _text(self.response),
            "history": [
                {"status": t.status.value, "at": t.at, "reason": t.reason} for t in self.history
            ],
            "attempts": [dict(a.__dict__) for a in self.attempts],
        }


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        import base64

        return "base64:" + base64.b64encode(data).decode()


def check_transition(key: tuple[str, str], current: Status, wanted: Status) -> None:
    if current not in ALLOWED_FROM[wanted]:
        raise InvalidTransition(key, current, wanted)


def path_to(
    status: Status, via: Via, retry: bool = False
) -> tuple[frozenset[Status], list[Status]]:
    """The statuses a message may be in before moving to ``status`` (through ``via``, one
    status or several in turn; a ``retry`` from FAILED alone), and the transitions recorded."""
    if retry:
        return frozenset({Status.FAILED}), [status]
    if via is None:
        return ALLOWED_FROM[status], [status]
    path = _through(via)
    for before, after in zip(path, [*path[1:], status], strict=True):
        if before not in ALLOWED_FROM[after]:
            raise ValueError(f"{after} cannot come from {before}")
    return ALLOWED_FROM[path[0]], [*path, status]


def stamped(
    status: Status, via: Via, now: float, via_at: float | None = None
) -> list[tuple[Status, float]]:
    """The transitions a move records, each with its time: those it passes through (``via``)
    at ``via_at`` (``now`` when None), the last at ``now``."""
    at = now if via_at is None else via_at
    return [*((s, at) for s in _through(via)), (status, now)]


def _through(via: Via) -> list[Status]:
    """The statuses a move passes through, in turn."""
    if via is None:
        return []
    return [via] if isinstance(via, Status) else list(via)


def attempts_of(attempt: Attempts) -> tuple[Attempt, ...]:
    """The attempts a move records: none, one, or several in order."""
    if attempt is None:
        return ()
    return (attempt,) if isinstance(attempt, Attempt) else tuple(attempt)


# (updated_at, source_id, message_id) of the last message of a page of ``StateStore.messages``
Cursor = tuple[float, str, str]


def cursor(state: MessageState) -> Cursor:
    """Where the next page of ``StateStore.messages`` starts: after ``state``."""
    return (state.updated_at, state.source_id, state.message_id)


def statuses(status: str | None) -> list[Status]:
    """The statuses a ``messages`` filter selects: every one for None."""
    return list(Status) if status is None else [Status(status)]


class Claim(StrEnum):
    """The answer to ``begin_send``."""

    CLAIMED = "claimed"  # send it
    INTERRUPTED = "interrupted"  # send it, but an earlier send by a worker that stopped never
    # recorded its answer: the request may have arrived
    BUSY = "busy"  # another worker is sending it right now
    MOVED = "moved"  # it changed since it was read: another worker acted on it


@dataclass(frozen=True)
class ReceiverState:
    name: str
    disabled: bool
    reason: str = ""
    at: float = 0.0


class StateStore(abc.ABC):
    """Thread-safe; every method is one atomic step, so several workers (threads, processes,
    machines for Redis) may share a store."""

    @abc.abstractmethod
    def arrive(
        self, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> tuple[bool, MessageState]:
        """Record a new message as ARRIVED; (False, the existing one) when ``(source_id,
        message_id)`` is already known: the dedup."""

    def arrive_many(
        self,
        messages: list[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[tuple[bool, MessageState]]:
        """``arrive`` for each ``(source_id, message_id, receiver, payload)``, in order (a
        backend may record them in one step). ``claims``: a message's first send claimed
        until its claim (None: not), when the message is recorded here, as ``begin_send``
        would claim it (one step fewer for the worker that sends it next)."""
        out = []
        for message, claim in zip(messages, claims or [None] * len(messages), strict=True):
            created, state = self.arrive(*message, now)
            if created and claim is not None:  # (not in one step: the backends do it in one)
                self.begin_send(state, now, claim)
            out.append((created, state))
        return out

    @abc.abstractmethod
    def get(self, source_id: str, message_id: str) -> MessageState | None: ...

    def known(self, source_id: str, message_id: str) -> bool:
        """Whether the message was recorded (cheaper than ``get`` where a backend can)."""
        return self.get(source_id, message_id) is not None

    @abc.abstractmethod
    def advance(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Status | None = None,
        retry: bool = False,
        attempt: Attempt | None = None,
    ) -> MessageState:
        """Move the message to ``status`` (through ``via`` first, in the same atomic step:
        both transitions are recorded; with ``retry``, from FAILED only; ``attempt`` recorded
        with it, as ``record_attempt`` would). InvalidTransition
        when the machine does not allow it from where it is; UnknownMessage when there is no
        such message."""

    @abc.abstractmethod
    def move(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        """``advance`` for a message read as ``state``, returned as ``state.moved`` says
        (a backend may leave out reading it back: what a concurrent step added meanwhile, an
        attempt, may be missing from it). ``via`` may be several statuses passed through in
        turn, recorded at ``via_at`` (``now`` when None), and ``attempt`` several attempts, all
        in the one step (a step that got a response and made its callback records both at
        once)."""

    @abc.abstractmethod
    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None: ...

    @abc.abstractmethod
    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        """Put the message on ``kind``'s schedule (a retry, a poll) at ``due_at``; once per
        message and kind (scheduling again moves it)."""

    @abc.abstractmethod
    def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        """Claim up to ``limit`` messages of ``kind``'s schedule due by ``now``, earliest
        first, so that one claimant gets each. With ``lease_s`` a claimed entry is not removed
        but moved to ``now + lease_s``: if the claimant dies, it comes due again; the claimant
        ``release``s it when its step is over."""

    @abc.abstractmethod
    def release(self, kind: str, source_id: str, message_id: str, leased_until: float) -> None:
        """Remove a leased entry, unless the step scheduled it again (its due time moved)."""

    @abc.abstractmethod
    def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        """Mark the message as being sent until ``until`` (``record_attempt`` clears the
        mark), if it is still as ``state`` was read (the same status and number of attempts).
        MOVED when it is not (another worker acted on it since), BUSY while another worker's
        mark stands, INTERRUPTED when an expired mark was left by a worker that stopped before
        recording its answer."""

    @abc.abstractmethod
    def failed(
        self, receiver: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[MessageState]:
        """FAILED messages (of ``receiver``, failed at or after ``since``), oldest first."""

    @abc.abstractmethod
    def messages(
        self,
        source_id: str | None,
        status: str | None,
        receiver: str | None,
        limit: int,
        before: Cursor | None = None,
    ) -> list[MessageState]:
        """Up to ``limit`` messages, newest first: ordered by ``(updated_at, source_id,
        message_id)`` descending (ids compared as UTF-8 bytes), each filter applied that is not
        None (``status``: a :class:`Status` value; ValueError for another). ``before`` is the
        :func:`cursor` of the last message of the previous page: the page holds the messages
        ordered after it, so walking pages lists every message that did not change meanwhile
        exactly once (a message that changes moves to the top, with its new ``updated_at``).
        Served by an index of the statuses (and receivers): the cost of a page does not grow
        with the number of messages; a source is filtered while walking those ranges, so a rare
        source's page walks more of them (indexing it too would cost every status change)."""

    @abc.abstractmethod
    def counts(self, receiver: str | None = None) -> dict[str, dict[str, int]]:
        """How many messages each receiver (or only ``receiver``) has in each status: receiver
        -> every :class:`Status` value -> count, for the receivers that have a message (purged
        DONE messages are not counted). One consistent snapshot, cheap to ask often."""

    @abc.abstractmethod
    def purge(self, before: float, limit: int = 1000) -> int:
        """Forget up to ``limit`` DONE messages that became DONE before ``before`` (their
        status, history and attempts; a repeat of one is then a new message); how many."""

    @abc.abstractmethod
    def set_receiver(self, name: str, disabled: bool, reason: str, now: float) -> None:
        """Disable a receiver (a 410, or an operator) or enable it again."""

    @abc.abstractmethod
    def receivers(self) -> dict[str, ReceiverState]:
        """Receivers that were ever disabled or enabled, by name."""

    def retry(self, source_id: str, message_id: str, now: float) -> tuple[MessageState, str]:
        """Send a FAILED message on from the stage it failed in (see ``resume_stage``): back to
        that status and due at once on that stage's schedule. InvalidTransition when it is not
        FAILED."""
        state = self.get(source_id, message_id)
        if state is None:
            raise UnknownMessage(f"no message {source_id}/{message_id}")
        status, kind = state.resume_stage()
        resumed = self.advance(source_id, message_id, status, now, reason="retried", retry=True)
        self.schedule(kind, source_id, message_id, now)
        return resumed, kind

    @abc.abstractmethod
    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        """Take one request of ``receiver``'s rate limit (``requests`` per ``per_s`` seconds,
        evenly spaced: GCRA); 0 when taken, else how many seconds to wait before asking again.
        Shared by every worker of the store. A request asked for up to one interval after it
        was due is counted from when it was due, so that the time a worker takes to ask again
        is not lost from the rate (two requests may then be closer than an interval, never more
        than ``requests`` + 1 in ``per_s``)."""

    def batch_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Let the changes made on ``loop``'s thread be committed together, once per turn of
        the loop (None: each alone again); a backend may ignore it. Until ``flush`` returns,
        such a change may not be committed yet."""
        return None  # each change of this backend is committed when its call returns

    async def flush(self) -> None:
        """Wait until every change made so far is committed (see ``batch_on``)."""
        return None

    def on_loop(self) -> LoopState:
        """The steps the webhook workers take, as coroutines for their event loop (made on
        it)."""
        return LoopState(self)

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopState:
    """The state as the webhook workers' event loop uses it: each step a coroutine, so that a
    backend may send the steps of every task of a turn of the loop together. This one runs each
    on the store in place (the SQLite state commits a turn's changes together, see
    ``StateStore.batch_on``); the Redis state's sends a turn's steps in one pipeline. What the
    workers do rarely (the receivers' flags, purges) they ask ``store`` for."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    async def get(self, source_id: str, message_id: str) -> MessageState | None:
        return self.store.get(source_id, message_id)

    async def lookup(self, source_id: str, message_id: str) -> MessageState | None:
        """``get``, for a message that is most likely not recorded: asks ``known`` first where
        that is cheaper."""
        if not self.store.known(source_id, message_id):
            return None
        return self.store.get(source_id, message_id)

    async def arrive_many(
        self,
        messages: list[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[tuple[bool, MessageState]]:
        return self.store.arrive_many(messages, now, claims)

    async def move(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        """``StateStore.move``: InvalidTransition when another worker moved it first."""
        return self.store.move(
            state, status, now, reason=reason, response=response, via=via, via_at=via_at,
            attempt=attempt,
        )  # fmt: skip

    async def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        self.store.record_attempt(source_id, message_id, attempt)

    async def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        self.store.schedule(kind, source_id, message_id, due_at)

    async def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        return self.store.take_due(kind, now, limit, lease_s)

    async def release(
        self, kind: str, source_id: str, message_id: str, leased_until: float
    ) -> None:
        self.store.release(kind, source_id, message_id, leased_until)

    async def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        return self.store.begin_send(state, now, until)

    async def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        return self.store.acquire(receiver, requests, per_s)

    async def flush(self) -> None:
        """Wait until every change made so far is committed."""
        await self.store.flush()

    async def close(self) -> None:
        """Let go of what the loop's state holds (not the store)."""
        return None
