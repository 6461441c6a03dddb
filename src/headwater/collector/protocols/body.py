"""Reading an HTTP body safely: undo its ``Content-Encoding`` without inflating past the limit.

A compressed body is inflated incrementally, never asking zlib for more than the bytes still
allowed, so a decompression bomb costs at most ``max_bytes`` of memory before it is refused.
Supported codings: ``gzip`` (also ``x-gzip``, several members allowed), ``deflate`` (the zlib
format of RFC 9110, and the raw deflate some clients send instead) and ``identity``. A list of
codings (``Content-Encoding: gzip, gzip``) is undone from the last to the first.

The JSON intakes (Segment, Jitsu, OTLP/JSON) parse the result with ``parse_json``: orjson,
strict, so invalid UTF-8, NaN, trailing garbage and absurd nesting are refused up front.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from headwater.collector.errors import Rejected, bad_request, too_large

_LIMIT_KEY = "collector.limits.max_body_bytes"
_MAX_CODINGS = 2  # more layers than this is not a client, it is an attack
_GZIP = 16 + zlib.MAX_WBITS
_ZLIB = zlib.MAX_WBITS
_RAW_DEFLATE = -zlib.MAX_WBITS
_GZIP_MAGIC = b"\x1f\x8b"
SUPPORTED = ("gzip", "deflate", "identity")


def unsupported_encoding(reason: str) -> Rejected:
    """415: the body is in a coding the collector cannot undo (RFC 9110 §15.5.16)."""
    return Rejected(reason, status=415, kind="unsupported_encoding")


def decode_body(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body with its content codings undone; ``Rejected`` when it is corrupt, in an
    unknown coding, or larger than ``max_bytes`` (before or after inflating)."""
    if len(raw) > max_bytes:
        raise too_large(f"body is {len(raw)} bytes, more than {max_bytes} ({_LIMIT_KEY})")
    codings = _codings(content_encoding)
    body = raw
    for coding in reversed(codings):
        body = _inflate(body, coding, max_bytes)
    return body


def _codings(header: str | None) -> list[str]:
    if not header:
        return []
    codings = []
    for part in header.split(","):
        coding = part.strip().lower()
        if coding in ("", "identity"):
            continue
        if coding == "x-gzip":
            coding = "gzip"
        if coding not in ("gzip", "deflate"):
            raise unsupported_encoding(
                f"Content-Encoding {part.strip()[:40]!r} is not supported "
                f"(use one of: {', '.join(SUPPORTED)})"
            )
        codings.append(coding)
    if len(codings) > _MAX_CODINGS:
        raise unsupported_encoding(
            f"Content-Encoding {header[:80]!r} stacks {len(codings)} codings; "
            f"at most {_MAX_CODINGS} are accepted"
        )
    return codings


def _inflate(data: bytes, coding: str, max_bytes: int) -> bytes:
    if not data:
        raise bad_request(f"{coding} body is empty", kind="bad_encoding")
    if coding == "gzip":
        if not data.startswith(_GZIP_MAGIC):
            raise bad_request(
                "gzip body is corrupt: it does not start with the gzip magic bytes 1f 8b",
                kind="bad_encoding",
            )
        wbits = _GZIP
    else:
        wbits = _ZLIB if _looks_like_zlib(data) else _RAW_DEFLATE
    out = bytearray()
    member = 0
    while True:
        rest = _inflate_member(data, wbits, coding, max_bytes, out)
        member += 1
        if not rest:
            return bytes(out)
        if coding == "gzip" and rest.startswith(_GZIP_MAGIC):
            data = rest  # another gzip member (RFC 1952 §2.2): keep reading
            continue
        raise bad_request(
            f"{coding} body is corrupt: {len(rest)} bytes of trailing data after "
            f"the compressed stream" + (f" (member {member})" if member > 1 else ""),
            kind="bad_encoding",
        )


def _inflate_member(data: bytes, wbits: int, coding: str, max_bytes: int, out: bytearray) -> bytes:
    """Inflate one compressed stream from ``data`` into ``out``; return what follows it."""
    d = zlib.decompressobj(wbits)
    pending = data
    try:
        while True:
            room = max_bytes - len(out)
            chunk = d.decompress(pending, room + 1)
            out += chunk
            if len(out) > max_bytes:
                raise too_large(f"body inflates past {max_bytes} bytes ({_LIMIT_KEY})")
            if d.eof:
                return d.unused_data
            pending = d.unconsumed_tail
            if not pending and not chunk:
                raise bad_request(
                    f"{coding} body is truncated: the compressed stream ends early",
                    kind="bad_encoding",
                )
    except zlib.error as e:
        raise bad_request(f"{coding} body is corrupt: {e}", kind="bad_encoding") from None


def _looks_like_zlib(data: bytes) -> bool:
    """True when ``data`` starts with a zlib header (RFC 1950 §2.2): method 8, check bits."""
    if len(data) < 2:
        return False
    cmf, flg = data[0], data[1]
    return cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf << 8 | flg) % 31 == 0


def parse_json(body: bytes) -> Any:
    """The JSON document in ``body`` (strict: UTF-8, no NaN/Infinity, nesting at most 1024
    deep, nothing after the document); ``Rejected`` naming the problem otherwise."""
    if not body.strip():
        raise bad_request("body is empty", kind="bad_json")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"body is not valid JSON: {e}", kind="bad_json") from None


def dump_json(value: Any, where: str) -> bytes:
    """``value`` as compact JSON; ``Rejected`` when it cannot be written back (orjson writes
    at most 254 levels of nesting, fewer than it reads)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as e:
        raise bad_request(f"{where}cannot be stored: {e}", kind="bad_json") from None


def json_kind(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def show_value(value: Any) -> str:
    """A client's value for an error message, kept short: a string quoted, else its kind."""
    if isinstance(value, str):
        return repr(value[:60])
    return with_article(json_kind(value))


def with_article(kind: str) -> str:
    """A :func:`json_kind` with its article: "a number", "an object"."""
    return ("an " if kind[0] in "ao" else "a ") + kind
