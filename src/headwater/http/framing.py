"""HTTP/1.1 answers without I/O: an answer's head parsed and checked (RFC 9112 sections 4 and 5),
and how its body is framed (RFC 9112 section 6). ``client.py`` reads the bytes; everything here
takes bytes or a parsed head and either returns what it found or raises ``HttpError``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

MAX_INTERIM = 16  # 1xx answers accepted before the final one


class HttpError(OSError):
    """The exchange failed: no (complete) answer."""


_STATUS_LINE = re.compile(r"HTTP/1\.([0-9]) ([1-5][0-9][0-9])(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_LENGTH = re.compile(r"[0-9]{1,18}")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(?:;[^\r\n]*)?\r\n")
_NO_BODY = frozenset({204, 304})


@dataclass(frozen=True)
class Head:
    minor: int  # HTTP/1.<minor>
    status: int
    fields: list[tuple[str, str]]  # (lower-case name, value) in the order received

    def values(self, name: str) -> list[str]:
        """Every element of the comma-separated lists in all of ``name``'s lines."""
        return [
            item.strip()
            for field, value in self.fields
            if field == name
            for item in value.split(",")
            if item.strip()
        ]

    def last(self) -> dict[str, str]:
        """One value per name: a repeated field's last line."""
        return dict(self.fields)


def parse_head(data: bytes) -> Head:
    """A status line and header section ending in an empty line (CRLF CRLF)."""
    lines = data.decode("latin-1").removesuffix("\r\n\r\n").split("\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise HttpError(f"not an HTTP answer (HTTP/1.x NNN): {lines[0][:80]!r}")
    fields: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):  # obs-fold: a user agent replaces it with a space (5.2)
            if not fields:
                raise HttpError("the answer's header section starts with a folded line")
            name, value = fields.pop()
            fields.append((name, value + " " + line.strip(" \t")))
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise HttpError(f"a header line with no colon: {line[:80]!r}")
        if not _TOKEN.fullmatch(name):
            raise HttpError(f"not a valid header name: {name[:80]!r}")
        fields.append((name.lower(), value.strip(" \t")))
    for name, value in fields:
        if any(c in value for c in "\r\n\x00"):
            raise HttpError(f"the header {name!r} holds a CR, LF or NUL")
    return Head(int(status_line[1]), int(status_line[2]), fields)


class Body(Enum):
    NONE = "none"
    LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE = "until the close"


@dataclass(frozen=True)
class Framing:
    body: Body
    length: int  # Body.LENGTH: the body's size
    keep: bool  # the connection may carry another request once the body is read


def framing(head: Head, method: str, max_body: int) -> Framing:
    """How the final answer ``head`` to a ``method`` request delimits its body (RFC 9112 6.3)."""
    keep = head.minor >= 1 and "close" not in {t.lower() for t in head.values("connection")}
    if method == "HEAD" or head.status in _NO_BODY:
        return Framing(Body.NONE, 0, keep)
    codings = head.values("transfer-encoding")
    lengths = head.values("content-length")
    if codings:
        if head.minor == 0:
            raise HttpError("an HTTP/1.0 answer with Transfer-Encoding (RFC 9112 6.1)")
        if [c.lower() for c in codings] != ["chunked"]:
            raise HttpError(f"a transfer coding the client did not ask for: {', '.join(codings)!r}")
        # Transfer-Encoding overrides Content-Length; the pair may be smuggling, so the
        # connection is not used again (RFC 9112 6.3, rule 3).
        return Framing(Body.CHUNKED, 0, keep and not lengths)
    if lengths:
        if len(set(lengths)) > 1:
            raise HttpError(f"conflicting Content-Length values: {', '.join(lengths)[:80]!r}")
        if not _LENGTH.fullmatch(lengths[0]):
            raise HttpError(f"not a valid Content-Length: {lengths[0][:80]!r}")
        length = int(lengths[0])
        if length > max_body:
            raise HttpError(f"the answer's body is {length} bytes, over {max_body}")
        return Framing(Body.LENGTH, length, keep)
    return Framing(Body.CLOSE, 0, False)


def chunk_size(line: bytes) -> int:
    """The size on a chunk's first line (hex digits, extensions ignored, CRLF included)."""
    match = _CHUNK_LINE.fullmatch(line)
    if match is None:
        raise HttpError(f"not a valid chunk size line: {line[:40]!r}")
    return int(match[1], 16)
