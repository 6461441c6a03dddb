"""The transport's records on the log: the seed's Message (op, timestamp, namespace, data) with
the row's key and, where the source gives it, the row before; and the seed's LogEntry mode.

A record's value is one JSON object::

    {"op": "update", "ts": 1764121200123, "namespace": "shop.public.orders",
     "key": {"id": 7}, "data": {"id": 7, "total": "12.50", "note": null},
     "before": {"id": 7, "total": "10.00", "note": null}, "unchanged": ["body"],
     "position": "0/16B3748", "schema": 2}

- ``op``: ``read`` (a row of the initial copy), ``insert``, ``update``, ``delete``,
  ``truncate``; and two control ops: ``schema`` (the namespace's columns and their types, before
  the first change that uses them: ``columns`` = ``[{"name", "type", "key"}]``) and ``complete``
  (the namespace finished its copy phase).
- ``key``: the primary key (or replica identity) columns; the record's key is its JSON, so a
  row's changes stay in order in one partition.
- ``unchanged``: columns whose value the source did not send because the change did not touch
  them (PostgreSQL's TOASTed values). They are absent from ``data``, never NULL.
- ``position``: where in the source the change is (an LSN, ``file:line``, ``topic/p/offset``).

Headers: ``hw-mode`` (``copy``, ``sync``, ``complete``), ``hw-op`` and ``hw-namespace``, so that
a writer's namespace filter does not parse the value.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

import orjson

from headwater.bus.headers import PackedHeaders, pack_header
from headwater.bus.records import Headers, Message, Record

HEADER_MODE = "hw-mode"
HEADER_OP = "hw-op"
HEADER_NAMESPACE = "hw-namespace"
_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class Op(StrEnum):
    READ = "read"
    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    TRUNCATE = "truncate"
    SCHEMA = "schema"
    COMPLETE = "complete"


DATA_OPS = frozenset({Op.READ, Op.INSERT, Op.UPDATE, Op.DELETE, Op.TRUNCATE})


class Mode(StrEnum):
    COPY = "copy"
    SYNC = "sync"
    COMPLETE = "complete"


@dataclass(slots=True)
class Change:
    """One message of the transport."""

    op: Op
    namespace: str
    ts_ms: int
    data: dict[str, Any] | None = None
    key: dict[str, Any] | None = None
    before: dict[str, Any] | None = None
    unchanged: list[str] | None = None
    position: str | None = None
    schema: int | None = None
    columns: list[dict[str, Any]] | None = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": str(self.op), "ts": self.ts_ms, "namespace": self.namespace}
        if self.key is not None:
            out["key"] = self.key
        if self.data is not None:
            out["data"] = self.data
        if self.before is not None:
            out["before"] = self.before
        if self.unchanged:
            out["unchanged"] = self.unchanged
        if self.position is not None:
            out["position"] = self.position
        if self.schema is not None:
            out["schema"] = self.schema
        if self.columns is not None:
            out["columns"] = self.columns
        return out


def now_ms() -> int:
    """Now, in milliseconds since the epoch (a change's ``ts`` when the source has none)."""
    return int(time.time() * 1000)


def record_key(key: dict[str, Any] | None) -> bytes | None:
    """The record key of a row: its key columns as JSON, sorted, so equal keys give equal
    bytes."""
    return None if key is None else orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


@lru_cache(maxsize=4096)
def headers(mode: Mode, op: Op, namespace: str) -> Headers:
    """A record's headers, packed once per (mode, op, namespace) for the log."""
    pairs = (
        (HEADER_MODE, mode.value.encode()),
        (HEADER_OP, op.value.encode()),
        (HEADER_NAMESPACE, namespace.encode()),
    )
    return PackedHeaders.join(pairs, b"".join(pack_header(n, v) for n, v in pairs))


def encode(change: Change, mode: Mode) -> Message:
    """The log record of ``change`` appended in ``mode``."""
    return Message(
        value=orjson.dumps(change.as_dict()),
        key=record_key(change.key),
        headers=headers(mode, change.op, change.namespace),
        timestamp=change.ts_ms,
    )


class BadMessage(ValueError):
    """A record that is not a transport message."""


def decode(record: Record | Message) -> tuple[Change, Mode]:
    """The change and mode a record holds; ``BadMessage`` names what is wrong."""
    try:
        body = orjson.loads(record.value)
    except orjson.JSONDecodeError as e:
        raise BadMessage(f"the value is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadMessage("the value is not a JSON object")
    try:
        op = Op(body["op"])
        change = Change(
            op=op,
            namespace=str(body["namespace"]),
            ts_ms=int(body["ts"]),
            data=body.get("data"),
            key=body.get("key"),
            before=body.get("before"),
            unchanged=body.get("unchanged"),
            position=body.get("position"),
            schema=body.get("schema"),
            columns=body.get("columns"),
        )
    except KeyError as e:
        raise BadMessage(f"the message has no {e.args[0]!r}") from None
    except ValueError as e:
        raise BadMessage(f"the message is not valid: {e}") from None
    mode = dict(record.headers).get(HEADER_MODE)
    try:
        return change, Mode(mode.decode()) if mode else Mode.SYNC
    except ValueError:
        raise BadMessage(f"unknown {HEADER_MODE} {mode!r}") from None


def topic_name(pattern: str, reader: str, namespace: str, **parts: str) -> str:
    """The topic of ``namespace`` by the reader's pattern; characters a topic name cannot hold
    become ``_``."""
    fields = {"database": "", "schema": "", "table": "", **parts}
    name = pattern.format(reader=reader, namespace=namespace, **fields)
    return _TOPIC_CHARS.sub("_", name)[:249]
