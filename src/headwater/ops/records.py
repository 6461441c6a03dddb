"""Log records for people, as the CLI and the console show them: bytes as UTF-8 or base64,
timestamps in ISO 8601, one record as a JSON object or as text."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from headwater.bus.records import Record

Encoding = Literal["utf8", "base64"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# C0 controls and DEL, except tab, newline and carriage return: text that would garble a terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def render_bytes(data: bytes) -> tuple[str, Encoding]:
    """``data`` as text if it is valid UTF-8, else as base64; with which one it is."""
    try:
        return data.decode("utf-8"), "utf8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def render_text(data: bytes) -> tuple[str, Encoding]:
    """Like ``render_bytes``, but UTF-8 holding control characters is shown as base64 too, so a
    terminal is never garbled."""
    text, encoding = render_bytes(data)
    if encoding == "utf8" and _CONTROL.search(text):
        return base64.b64encode(data).decode("ascii"), "base64"
    return text, encoding


def iso_timestamp(ms: int) -> str:
    """Milliseconds since the epoch as ISO 8601 UTC (``2024-05-01T12:00:00.123Z``)."""
    try:
        moment = _EPOCH + timedelta(milliseconds=ms)
    except OverflowError:
        return "?"
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def record_to_json(record: Record) -> dict[str, Any]:
    """One record as a JSON object; each of key, value and header values says its encoding."""
    out: dict[str, Any] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "time": iso_timestamp(record.timestamp),
    }
    if record.key is None:
        out["key"] = None
        out["key_encoding"] = None
    else:
        out["key"], out["key_encoding"] = render_bytes(record.key)
    headers = []
    for name, raw in record.headers:
        value, encoding = render_bytes(raw)
        headers.append({"name": name, "value": value, "value_encoding": encoding})
    out["headers"] = headers
    out["value"], out["value_encoding"] = render_bytes(record.value)
    return out


def record_to_text(record: Record) -> str:
    """One record as an indented block for people."""
    lines = [
        f"{record.topic}[{record.partition}]@{record.offset}  "
        f"{iso_timestamp(record.timestamp)} ({record.timestamp})"
    ]
    if record.key is None:
        lines.append("  key: (none)")
    else:
        lines.append(_labelled("key", record.key))
    for name, raw in record.headers:
        lines.append(_labelled(f"header {name}", raw))
    lines.append(_labelled("value", record.value))
    return "\n".join(lines)


def _labelled(label: str, data: bytes) -> str:
    text, encoding = render_text(data)
    if encoding == "base64":
        label += " (base64)"
    # Continuation lines of multi-line text stay inside the record's block.
    return f"  {label}: " + text.replace("\r\n", "\n").replace("\n", "\n    ")
