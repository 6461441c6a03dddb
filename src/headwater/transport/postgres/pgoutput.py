"""Decoding of ``pgoutput``, PostgreSQL's logical replication protocol (version 1, the one
PostgreSQL 10+ speaks), from the bytes of each ``XLogData`` message.

Message layouts (PostgreSQL's "Logical Replication Message Formats"): integers are big-endian,
strings end with a zero byte, timestamps are microseconds since 2000-01-01 UTC. Column values come
as text (``TupleData`` kind ``t``), or are NULL (``n``), or are a TOASTed value the change did not
touch and the server did not send (``u``: ``UNCHANGED``, never to be written as NULL).
Typing the text values is the caller's: each ``Relation`` names its columns' type OIDs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

PG_EPOCH_US: Final = 946_684_800_000_000  # 2000-01-01 in microseconds since the Unix epoch


class Unchanged:
    """A TOASTed value the change did not touch (the server did not send it)."""

    _instance: Unchanged | None = None

    def __new__(cls) -> Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = Unchanged()
Value = str | None | Unchanged


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool  # part of the replica identity


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_us: int  # Unix microseconds
    xid: int


@dataclass(frozen=True)
class Commit:
    lsn: int
    end_lsn: int
    commit_us: int


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # d (default: the key), n (nothing), f (full), i (index)
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class TypeInfo:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True)
class Insert:
    relation: int
    new: tuple[Value, ...]


@dataclass(frozen=True)
class Update:
    relation: int
    new: tuple[Value, ...]
    old: tuple[Value, ...] | None = None  # the whole old row (replica identity full)
    old_key: tuple[Value, ...] | None = None  # the old key's columns, when the key changed


@dataclass(frozen=True)
class Delete:
    relation: int
    old: tuple[Value, ...] | None = None  # replica identity full
    old_key: tuple[Value, ...] | None = None  # the key's columns (others NULL)


@dataclass(frozen=True)
class Truncate:
    relations: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = (
    Begin
    | Commit
    | Relation
    | TypeInfo
    | Origin
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
)


class DecodeError(ValueError):
    """Bytes that are not a pgoutput message of protocol version 1."""


@dataclass
class _Reader:
    data: bytes
    at: int = 0

    def fixed(self, fmt: str) -> int:
        s = _STRUCTS[fmt]
        if self.at + s.size > len(self.data):
            raise DecodeError(f"the message ends inside a field at byte {self.at}")
        (value,) = s.unpack_from(self.data, self.at)
        self.at += s.size
        return int(value)

    def byte(self) -> str:
        if self.at >= len(self.data):
            raise DecodeError(f"the message ends at byte {self.at}")
        value = chr(self.data[self.at])
        self.at += 1
        return value

    def string(self) -> str:
        end = self.data.find(b"\0", self.at)
        if end < 0:
            raise DecodeError(f"a string at byte {self.at} has no end")
        value = self.data[self.at : end].decode()
        self.at = end + 1
        return value

    def raw(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise DecodeError(f"a value of {n} bytes at byte {self.at} passes the message's end")
        value = self.data[self.at : self.at + n]
        self.at += n
        return value

    def tuple(self) -> tuple[Value, ...]:
        values: list[Value] = []
        for _ in range(self.fixed("h")):
            kind = self.byte()
            if kind == "n":
                values.append(None)
            elif kind == "u":
                values.append(UNCHANGED)
            elif kind == "t":
                values.append(self.raw(self.fixed("i")).decode())
            else:
                raise DecodeError(f"unknown tuple value kind {kind!r} at byte {self.at - 1}")
        return tuple(values)


_STRUCTS = {f: struct.Struct(">" + f) for f in ("b", "h", "i", "I", "q", "Q")}


def decode(data: bytes) -> Message:
    """One ``pgoutput`` message."""
    r = _Reader(bytes(data))
    kind = r.byte()
    if kind == "B":
        return Begin(r.fixed("Q"), r.fixed("q") + PG_EPOCH_US, r.fixed("I"))
    if kind == "C":
        r.fixed("b")  # flags, unused
        return Commit(r.fixed("Q"), r.fixed("Q"), r.fixed("q") + PG_EPOCH_US)
    if kind == "R":
        oid, namespace, name, identity = r.fixed("I"), r.string(), r.string(), r.byte()
        columns = []
        for _ in range(r.fixed("h")):
            flags = r.fixed("b")
            columns.append(Column(r.string(), r.fixed("I"), r.fixed("i"), bool(flags & 1)))
        return Relation(oid, namespace, name, identity, tuple(columns))
    if kind == "Y":
        return TypeInfo(r.fixed("I"), r.string(), r.string())
    if kind == "O":
        return Origin(r.fixed("Q"), r.string())
    if kind == "I":
        oid = r.fixed("I")
        _expect(r, "N")
        return Insert(oid, r.tuple())
    if kind == "U":
        oid = r.fixed("I")
        old = old_key = None
        marker = r.byte()
        if marker == "O":
            old, marker = r.tuple(), r.byte()
        elif marker == "K":
            old_key, marker = r.tuple(), r.byte()
        if marker != "N":
            raise DecodeError(f"an update's new tuple was expected, not {marker!r}")
        return Update(oid, r.tuple(), old, old_key)
    if kind == "D":
        oid = r.fixed("I")
        marker = r.byte()
        if marker not in ("O", "K"):
            raise DecodeError(f"a delete's old tuple was expected, not {marker!r}")
        values = r.tuple()
        return Delete(oid, values, None) if marker == "O" else Delete(oid, None, values)
    if kind == "T":
        count, options = r.fixed("I"), r.fixed("b")
        oids = tuple(r.fixed("I") for _ in range(count))
        return Truncate(oids, bool(options & 1), bool(options & 2))
    if kind == "M":
        flags, lsn, prefix = r.fixed("b"), r.fixed("Q"), r.string()
        return LogicalMessage(bool(flags & 1), lsn, prefix, r.raw(r.fixed("i")))
    raise DecodeError(f"unknown pgoutput message type {kind!r}")


def _expect(r: _Reader, marker: str) -> None:
    got = r.byte()
    if got != marker:
        raise DecodeError(f"expected {marker!r} at byte {r.at - 1}, got {got!r}")
