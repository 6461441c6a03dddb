"""The health of each destination's writer, and the one place that records it.

A writer whose destination fails (a locked DuckDB file, PostgreSQL restarting) is retried in the
running process for as long as it takes; an operator must still be told. The running pipeline
keeps one ``DestinationStatus`` per destination in a ``StatusBoard`` and writes the board as JSON
to ``<data_dir>/status/pipeline.json`` (atomically, by rename) whenever it changes, so
``headwater pipeline status`` and ``/readyz`` in other processes read what this one knows.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from headwater.errors import HeadwaterError

from headwater.config.model import HeadwaterConfig

State = Literal["starting", "running", "retrying", "stopped"]


class Backoff(BaseModel):
    """How long to wait before restarting a failed writer: exponential, capped, with jitter."""

    initial_s: float = Field(1.0, gt=0, description="The first wait.")
    factor: float = Field(2.0, ge=1, description="Each consecutive failure multiplies the wait.")
    max_s: float = Field(30.0, gt=0, description="The longest wait.")
    jitter: float = Field(0.2, ge=0, le=1, description="Random share added or taken off.")

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (1 or more)."""
        base = min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1))
        return min(self.max_s, max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter))))


BACKOFF = Backoff()

_CODE = re.compile(r"\b(HW-[A-Z]+-\d+)\b")
_CONNECTION = re.compile(
    r"ConnectionRefused|ConnectionReset|ConnectionError|OperationalError|TimeoutError"
    r"|connection refused|could not connect|server closed the connection|timed out",
    re.IGNORECASE,
)
_TRANSIENT_CLASSES = re.compile(r"\b\w*(TransientError|Transient)\b")


class Failure(BaseModel):
    """Why a writer's query stopped: its stable code when it has one, and a short reason."""

    code: str | None = None
    reason: str
    transient: bool
    stops: bool = False  # the destination is stopped, not retried (``stops_destination``)


def classify(exc: BaseException) -> Failure:
    """Read a writer's failure as it surfaces on the driver.

    The writer runs inside ``foreachBatch``; what it raises comes back to Python as a
    ``StreamingQueryException`` whose text holds the original Python error (its class and
    ``HW-...: message``), so the decision is made on that text: a ``TransientError`` (by class or
    by code, which the error's ``str`` starts with) or a connection-level error is transient.
    """
    from headwater.errors import HeadwaterError, TransientError

    if isinstance(exc, HeadwaterError):
        return Failure(
            code=exc.code,
            reason=exc.message,
            transient=isinstance(exc, TransientError),
            stops=exc.stops_destination,
        )
    text = str(exc)
    code_match = _CODE.search(text)
    transient = bool(_TRANSIENT_CLASSES.search(text) or _CONNECTION.search(text))
    code = code_match.group(1) if code_match else None
    if code and not transient:
        transient = any(c.code == code for c in _errors(TransientError))
    stops = bool(code) and any(c.code == code and c.stops_destination for c in _errors())
    reason = _reason(text, code)
    return Failure(code=code, reason=reason, transient=transient, stops=stops)


def _errors(base: type[HeadwaterError] | None = None) -> list[type[HeadwaterError]]:
    """``base`` (every headwater error by default) and its subclasses, as imported."""
    from headwater.errors import HeadwaterError

    def walk(cls: type[HeadwaterError]) -> list[type[HeadwaterError]]:
        return [cls, *[c for sub in cls.__subclasses__() for c in walk(sub)]]

    return walk(base or HeadwaterError)


def _reason(text: str, code: str | None) -> str:
    """The line of a long JVM/Python trace that says what went wrong."""
    if code is not None:
        for line in text.splitlines():
            if code in line:
                return line.strip()[line.strip().find(code) :].removeprefix(f"{code}: ")[:500]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(text).__name__)[:500]


class DestinationStatus(BaseModel):
    destination: str
    mode: str
    state: State = "starting"
    attempts: int = Field(0, description="Query runs started, first one included.")
    consecutive_failures: int = 0
    last_error_code: str | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    last_success_at: float | None = Field(None, description="Unix time of the last good batch.")
    next_retry_at: float | None = None

    @property
    def healthy(self) -> bool:
        return self.state in ("starting", "running") and self.consecutive_failures == 0

    def seconds_since_success(self, now: float | None = None) -> float | None:
        if self.last_success_at is None:
            return None
        return (now or time.time()) - self.last_success_at


class StatusFile(BaseModel):
    pid: int
    updated_at: float
    destinations: list[DestinationStatus]


def status_path(config: HeadwaterConfig) -> Path:
    return config.data_dir / "status" / "pipeline.json"


def read_status(config: HeadwaterConfig) -> StatusFile | None:
    """The last status a running pipeline wrote (None: no pipeline has run here)."""
    path = status_path(config)
    try:
        return StatusFile.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None


class StatusBoard:
    """The running pipeline's statuses; every change is written to the status file."""

    def __init__(self, config: HeadwaterConfig, destinations: list[tuple[str, str]]) -> None:
        self.path = status_path(config)
        self._lock = threading.Lock()
        self._items = {d: DestinationStatus(destination=d, mode=m) for d, m in destinations}
        self._write()

    def get(self, dest: str) -> DestinationStatus:
        with self._lock:
            return self._items[dest].model_copy()

    def all(self) -> list[DestinationStatus]:
        with self._lock:
            return [s.model_copy() for s in self._items.values()]

    def update(self, dest: str, **changes: Any) -> None:
        with self._lock:
            item = self._items[dest]
            self._items[dest] = item.model_copy(update=changes)
            self._write()

    def started(self, dest: str) -> None:
        with self._lock:
            item = self._items[dest]
            state: State = "retrying" if item.consecutive_failures else "running"
            self._items[dest] = item.model_copy(
                update={"attempts": item.attempts + 1, "state": state, "next_retry_at": None}
            )
            self._write()

    def succeeded(self, dest: str) -> None:
        """A batch committed: the destination is healthy again."""
        now = time.time()
        with self._lock:
            item = self._items[dest]
            if (
                item.consecutive_failures == 0
                and item.state == "running"
                and item.last_success_at
                and now - item.last_success_at < 1.0
            ):
                self._items[dest] = item.model_copy(update={"last_success_at": now})
                return  # at most one file write per second while all is well
            self._items[dest] = item.model_copy(
                update={"last_success_at": now, "consecutive_failures": 0, "state": "running"}
            )
            self._write()

    def failed(self, dest: str, failure: Failure, retry_in: float) -> int:
        """Record a failed run; returns the consecutive failures."""
        now = time.time()
        with self._lock:
            item = self._items[dest]
            count = item.consecutive_failures + 1
            self._items[dest] = item.model_copy(
                update={
                    "state": "retrying",
                    "consecutive_failures": count,
                    "last_error_code": failure.code,
                    "last_error": failure.reason,
                    "last_error_at": now,
                    "next_retry_at": now + retry_in,
                }
            )
            self._write()
            return count

    def _write(self) -> None:
        body = StatusFile(
            pid=os.getpid(), updated_at=time.time(), destinations=list(self._items.values())
        ).model_dump_json(indent=2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(body)
        os.replace(tmp, self.path)


def unhealthy(statuses: list[DestinationStatus]) -> dict[str, str]:
    """Failing destinations and why, for ``/readyz``."""
    out = {}
    for s in statuses:
        if not s.healthy:
            reason = f"{s.last_error_code}: {s.last_error}" if s.last_error_code else s.last_error
            out[s.destination] = f"{s.state}: {reason or 'no reason recorded'}"
    return out


def as_json(statuses: list[DestinationStatus], now: float | None = None) -> str:
    now = now or time.time()
    return json.dumps(
        [
            {**s.model_dump(), "seconds_since_success": s.seconds_since_success(now)}
            for s in statuses
        ]
    )
