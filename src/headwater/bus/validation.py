"""Checks every backend applies to a batch before any of it is appended."""

from __future__ import annotations

from collections.abc import Sequence

from headwater.bus.errors import InvalidArgument, RecordTooLarge
from headwater.bus.records import Message


def validate_batch(topic: str, messages: Sequence[Message], max_record_bytes: int) -> None:
    """Raise for the first bad message, naming it; nothing of a bad batch is appended.

    A record's size is key + value + header names and values (+6 framing bytes per header)."""
    if not messages:
        return
    values, keys, headers, timestamps, partitions = zip(*messages, strict=True)
    n = len(values)
    if (
        keys.count(None) == n
        and headers.count(()) == n
        and timestamps.count(None) == n
        and partitions.count(None) == n
        and set(map(type, values)) == {bytes}
        and max(map(len, values)) <= max_record_bytes
    ):
        return  # the common case, checked in bulk
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
            size += len(name) + len(hvalue) + 6
        if size > max_record_bytes:
            error = RecordTooLarge(
                f"record {i} of the batch for {topic!r} is {size} bytes; "
                f"the limit (max_record_bytes) is {max_record_bytes}"
            )
            error.index, error.size = i, size
            raise error
