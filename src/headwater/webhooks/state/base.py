"""The webhook state (seed 004, "Databases"): each message with its status and history, every
attempt, the schedule of retries and polls, and the receivers' rate limits, behind one
interface with two backends (:mod:`.sqlite`, embedded, for one machine; :mod:`.redis`, for
several processes and machines), both held to one contract test suite.

Status machine: ARRIVED -> DELIVERED_TO_RECEIVER -> RESPONSE_RECEIVED_FROM_RECEIVER -> DONE,
and FAILED from any state but DONE. A sync response skips nothing: the worker records the
delivery, then the response. Every transition is timestamped.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from enum import StrEnum

from headwater.errors import TerminalError


class Status(StrEnum):
    ARRIVED = "ARRIVED"
    DELIVERED_TO_RECEIVER = "DELIVERED_TO_RECEIVER"
    RESPONSE_RECEIVED_FROM_RECEIVER = "RESPONSE_RECEIVED_FROM_RECEIVER"
    DONE = "DONE"
    FAILED = "FAILED"


# status -> the statuses it may come from
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

    @property
    def key(self) -> tuple[str, str]:
        return (self.source_id, self.message_id)

    def tries(self, kind: str) -> int:
        return sum(1 for a in self.attempts if a.kind == kind)

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


class StateStore(abc.ABC):
    """Thread-safe; every method is one atomic step, so several workers (threads, processes,
    machines for Redis) may share a store."""

    @abc.abstractmethod
    def arrive(
        self, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> tuple[bool, MessageState]:
        """Record a new message as ARRIVED; (False, the existing one) when ``(source_id,
        message_id)`` is already known: the dedup."""

    @abc.abstractmethod
    def get(self, source_id: str, message_id: str) -> MessageState | None: ...

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
    ) -> MessageState:
        """Move the message to ``status`` (InvalidTransition when the machine does not allow
        it from where it is; UnknownMessage when there is no such message)."""

    @abc.abstractmethod
    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None: ...

    @abc.abstractmethod
    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        """Put the message on ``kind``'s schedule (a retry, a poll) at ``due_at``; once per
        message and kind (scheduling again moves it)."""

    @abc.abstractmethod
    def take_due(self, kind: str, now: float, limit: int) -> list[tuple[str, str]]:
        """Claim up to ``limit`` messages of ``kind``'s schedule due by ``now``, earliest
        first: each is taken off the schedule, so one claimant gets it."""

    @abc.abstractmethod
    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        """Take one request of ``receiver``'s rate limit (``requests`` per ``per_s`` seconds,
        evenly spaced: GCRA); 0 when taken, else how many seconds to wait before asking again.
        Shared by every worker of the store."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
