"""Checks every backend applies to a batch before any of it is appended."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from headwater.bus.errors import InvalidArgument, RecordTooLarge
from headwater.bus.headers import PackedHeaders
from headwater.bus.headers import size as header_size
from headwater.bus.records import Message

_PACKED = attrgetter("packed")
_KEY_TYPES = {bytes, type(None)}
_OPTIONAL_INT = {int, type(None)}


def _key_len(key: bytes | None) -> int:
    return 0 if key is None else len(key)


def validate_batch(topic: str, messages: Sequence[Message], max_record_bytes: int) -> None:
    """Raise for the first bad message, naming it; nothing of a bad batch is appended.

    A record's size is key + value + header names and values (+6 framing bytes per header)."""
    if not messages:
        return
    values, keys, headers, timestamps, partitions = zip(*messages, strict=True)
    n = len(values)
    if headers.count(()) == n:
        largest_headers: int | None = 0
    elif set(map(type, headers)) == {PackedHeaders}:
        largest_headers = max(map(len, map(_PACKED, headers)))
    else:
        largest_headers = None
    if (
        largest_headers is not None
        and set(map(type, values)) == {bytes}
        and set(map(type, keys)) <= _KEY_TYPES
        and set(map(type, timestamps)) <= _OPTIONAL_INT
        and (timestamps.count(None) == n or min(t for t in timestamps if t is not None) >= 0)
        and partitions.count(None) == n
        and max(map(len, values)) + max(map(_key_len, keys)) + largest_headers <= max_record_bytes
    ):
        return  # the common cases, checked in bulk (a bound on every record's size)
    for i, m in enumerate(messages):
        value, key, headers = m.value, m.key, m.headers
        if not isinstance(value, bytes):
            raise InvalidArgument(
                f"record {i} of the batch for {topic!r}: value must be bytes, "
                f"not {type(value).__name__}"
            )
        size = len(value)
        if key is not None:
            if not isinstance(key, bytes):
                raise InvalidArgument(
                    f"record {i} of the batch for {topic!r}: key must be bytes or None, "
                    f"not {type(key).__name__}"
                )
            size += len(key)
        for header in headers:
            name, hvalue = header
            if not isinstance(name, str) or not isinstance(hvalue, bytes):
                raise InvalidArgument(
                    f"record {i} of the batch for {topic!r}: header {header!r} must be "
                    "a (str, bytes) pair"
                )
        size += header_size(headers)
        if m.timestamp is not None and (type(m.timestamp) is not int or m.timestamp < 0):
            raise InvalidArgument(
                f"record {i} of the batch for {topic!r}: timestamp must be milliseconds since "
                f"the epoch (an int >= 0) or None, not {m.timestamp!r}"
            )
        if m.partition is not None and type(m.partition) is not int:
            raise InvalidArgument(
                f"record {i} of the batch for {topic!r}: partition must be an int or None, "
                f"not {m.partition!r}"
            )
        if size > max_record_bytes:
            error = RecordTooLarge(
                f"record {i} of the batch for {topic!r} is {size} bytes; "
                f"the limit (max_record_bytes) is {max_record_bytes}"
            )
            error.index, error.size = i, size
            raise error
