"""The health of each destination's writer, and the one place that records it.

A writer whose destination fails (a locked DuckDB file, PostgreSQL restarting) is retried in the
running process for as long as it takes; an operator must still be told. The running pipeline
keeps one ``DestinationStatus`` per destination in a ``StatusBoard`` and writes the board as JSON
to ``<data_dir>/status/pipeline.json`` (atomically, by rename) whenever it changes, so
``headwater pipeline status`` and ``/readyz`` in other processes read what this one knows.

Pausing goes the other way: ``pause``/``resume`` (``headwater pipeline pause``, the console)
write ``<data_dir>/status/paused.json`` from any process; the running pipeline follows it
(``PauseWatch``), stopping a paused destination's query between batches and starting it again
from its checkpoint once it is resumed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

if TYPE_CHECKING:
    from headwater.errors import HeadwaterError

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError

log = logging.getLogger(__name__)

State = Literal["starting", "running", "retrying", "paused", "stopped"]


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


class LastBatch(BaseModel):
    """The last micro-batch a destination's writer finished (committed, or found already
    committed in its ledger: then nothing was written)."""

    batch_id: int = Field(description="The batch id from the query's checkpoint.")
    committed_at: float = Field(description="Unix time the write returned.")
    duration_s: float = Field(description="From the start of the write to its end.")
    rows: dict[str, int] = Field(
        default_factory=dict,
        description="Rows written per table (empty for a mirror: see written).",
    )
    written: int = Field(0, description="Rows (a mirror: changes) written, all tables together.")
    failed: int = Field(0, description="Events the batch sent to the failed store.")


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
    last_batch: LastBatch | None = None

    @property
    def healthy(self) -> bool:
        """Not failing: a paused destination is not (someone paused it on purpose)."""
        if self.state == "paused":
            return True
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
        self._written_at = 0.0
        self._dirty = False  # a change not in the file yet (succeeded() writes at most 1/s)
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

    def succeeded(self, dest: str, last_batch: LastBatch | None = None) -> None:
        """A batch committed: the destination is healthy again. The board has ``last_batch``
        at once; while all is well the file is written at most once a second (``flush``
        writes what waited)."""
        now = time.time()
        with self._lock:
            item = self._items[dest]
            quiet = item.consecutive_failures == 0 and item.state == "running"
            update: dict[str, Any] = {
                "last_success_at": now,
                "consecutive_failures": 0,
                "state": "running",
            }
            if last_batch is not None:
                update["last_batch"] = last_batch
            self._items[dest] = item.model_copy(update=update)
            if quiet and item.last_success_at and now - self._written_at < 1.0:
                self._dirty = True
                return  # at most one file write per second while all is well
            self._write()

    def paused(self, dest: str) -> None:
        """The destination's query is stopped until it is resumed."""
        self.update(dest, state="paused", next_retry_at=None)

    def flush(self) -> None:
        """Write what ``succeeded`` kept back, once its second is over."""
        with self._lock:
            if self._dirty and time.time() - self._written_at >= 1.0:
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
        self._dirty = False
        self._written_at = time.time()
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


def as_json(
    statuses: list[DestinationStatus],
    now: float | None = None,
    pauses: dict[str, Pause] | None = None,
) -> str:
    """The statuses for scripts; ``paused`` is the pause requested in ``paused.json`` (the state
    says whether the running pipeline has applied it)."""
    now = now or time.time()
    pauses = pauses or {}
    return json.dumps(
        [
            {
                **s.model_dump(),
                "seconds_since_success": s.seconds_since_success(now),
                "paused": p.model_dump() if (p := pauses.get(s.destination)) else None,
            }
            for s in statuses
        ]
    )


# --- pausing ----------------------------------------------------------------------------------


class Pause(BaseModel):
    """A destination someone paused: its query stays stopped until it is resumed."""

    at: float = Field(description="Unix time of the pause.")
    by: str = Field(description="Who paused it (a user, the console), for people.")


_PAUSES = TypeAdapter(dict[str, Pause])


def paused_path(config: HeadwaterConfig) -> Path:
    return config.data_dir / "status" / "paused.json"


def paused(config: HeadwaterConfig) -> dict[str, Pause]:
    """The paused destinations (by id), as ``paused.json`` holds them."""
    return _read_pauses(paused_path(config))


def pause(config: HeadwaterConfig, dest_id: str, by: str) -> bool:
    """Pause a configured destination (from any process): the running pipeline stops its query
    after the batch in progress, within about a second. False: it was paused already (the first
    pause is kept). Raises ``ConfigError`` for an id that is not configured."""
    known_destinations(config, [dest_id])
    with _LockedPauses(config) as pauses:
        if dest_id in pauses:
            return False
        pauses[dest_id] = Pause(at=time.time(), by=by)
        return True


def resume(config: HeadwaterConfig, dest_id: str) -> bool:
    """Resume a paused destination: the running pipeline starts its query again from its
    checkpoint. False: it was not paused. Raises ``ConfigError`` for an id that is neither
    configured nor paused (a pause of a destination since removed from the config can go)."""
    with _LockedPauses(config) as pauses:
        if dest_id not in pauses:
            known_destinations(config, [dest_id])
            return False
        del pauses[dest_id]
        return True


def known_destinations(config: HeadwaterConfig, ids: list[str]) -> None:
    """Raise ``ConfigError`` naming the configured destinations when one of ``ids`` is not."""
    known = {d.id for d in config.pipeline.destinations}
    unknown = [d for d in ids if d not in known]
    if unknown:
        raise ConfigError(
            f"no destination named {', '.join(unknown)} in pipeline.destinations "
            f"(configured: {', '.join(sorted(known)) or 'none'})"
        )


class _LockedPauses:
    """``paused.json`` read under an exclusive lock (``paused.lock``, so that two processes
    pausing at once both count) and written back, by rename, when it changed."""

    def __init__(self, config: HeadwaterConfig) -> None:
        self.path = paused_path(config)
        self._fd = -1
        self._before: dict[str, Pause] = {}
        self.pauses: dict[str, Pause] = {}

    def __enter__(self) -> dict[str, Pause]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._before = _read_pauses(self.path)
        self.pauses = dict(self._before)
        return self.pauses

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None and self.pauses != self._before:
                body = _PAUSES.dump_json(self.pauses, indent=2)
                tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(body)
                os.replace(tmp, self.path)
        finally:
            os.close(self._fd)  # releases the lock


def _read_pauses(path: Path) -> dict[str, Pause]:
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return _PAUSES.validate_json(body)
    except ValidationError as exc:
        raise ConfigError(f"{path} is not a valid pause file: {exc}") from None


class PauseWatch:
    """The pauses as ``paused.json`` holds them, for the running pipeline's supervisors, which
    ask every half second: a ``stat`` of the file each time, a read only when it changed (every
    write replaces the file, so its inode, size or mtime changes). A file that cannot be read
    keeps the last pauses read, with a warning."""

    def __init__(self, config: HeadwaterConfig) -> None:
        self.path = paused_path(config)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._pauses: dict[str, Pause] = {}

    def current(self) -> dict[str, Pause]:
        with self._lock:
            try:
                st = os.stat(self.path)
                key: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                key = None
            if key != self._seen:
                try:
                    self._pauses = _read_pauses(self.path)
                    self._seen = key
                except (OSError, ConfigError) as exc:
                    log.warning("pauses not read (the last ones read still hold): %s", exc)
            return dict(self._pauses)

    def is_paused(self, dest_id: str) -> bool:
        return dest_id in self.current()
