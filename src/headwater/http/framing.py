"""HTTP/1.1 answers without I/O: an answer's head parsed and checked (RFC 9112 sections 4 and 5),
and how its body is framed (RFC 9112 section 6). ``client.py`` reads the bytes; everything here
takes bytes or a parsed head and either returns what it found or raises ``HttpError``."""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple

MAX_INTERIM = 16  # 1xx answers accepted before the final one


class HttpError(OSError):
    """The exchange failed: no (complete) answer."""


_STATUS_LINE = re.compile(r"HTTP/1\.([0-9]) ([1-5][0-9][0-9])(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TOKEN_CHARS = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]*")
_OBS_FOLD = re.compile(r"\r\n[ \t]+")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(?:;[^\r\n]*)?\r\n")
_NO_BODY = frozenset({204, 304})
_FRAMING = ("connection", "content-length", "transfer-encoding")


class Head(NamedTuple):
    minor: int  # HTTP/1.<minor>
    status: int
    headers: dict[str, str]  # lower-case names; a repeated field: its last line
    framing: dict[str, list[str]]  # every line of Connection, Content-Length, Transfer-Encoding

    def values(self, name: str) -> list[str]:
        """The elements of the comma-separated lists in all lines of the framing field ``name``."""
        lines = self.framing.get(name, ())
        return [item.strip() for line in lines for item in line.split(",") if item.strip()]


def parse_head(data: bytes) -> Head:
    """A status line and header section ending in an empty line (CRLF CRLF)."""
    text = data.decode("latin-1")
    if "\r\n " in text or "\r\n\t" in text:  # obs-fold: a user agent replaces it with a space
        text = _OBS_FOLD.sub(" ", text)
    if "\x00" in text or not text.count("\r") == text.count("\n") == text.count("\r\n"):
        raise HttpError("the answer's head holds a CR, LF or NUL outside a line's end")
    lines = text.removesuffix("\r\n\r\n").split("\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise HttpError(f"not an HTTP answer (HTTP/1.x NNN): {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise HttpError(f"a header line with no colon: {line[:80]!r}")
        headers[name.lower()] = value.strip(" \t")
    if "" in headers or not _TOKEN_CHARS.fullmatch("".join(headers)):
        name = next(name for name in headers if not _TOKEN.fullmatch(name))
        raise HttpError(f"not a valid header name: {name[:80]!r}")
    if len(headers) == len(lines) - 1:  # no name repeated
        framing = {name: [headers[name]] for name in _FRAMING if name in headers}
    else:
        fields = [line.partition(":") for line in lines[1:]]
        framing = {}
        for name, _, value in fields:
            if name.lower() in _FRAMING:
                framing.setdefault(name.lower(), []).append(value.strip(" \t"))
    return Head(int(status_line[1]), int(status_line[2]), headers, framing)


class Body(Enum):
    NONE = "none"
    LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE = "until the close"


class Framing(NamedTuple):
    body: Body
    length: int  # Body.LENGTH: the body's size
    keep: bool  # the connection may carry another request once the body is read


def framing(head: Head, method: str, max_body: int) -> Framing:
    """How the final answer ``head`` to a ``method`` request delimits its body (RFC 9112 6.3)."""
    fields = head.framing
    keep = head.minor >= 1 and (
        "connection" not in fields or "close" not in {t.lower() for t in head.values("connection")}
    )
    if method == "HEAD" or head.status in _NO_BODY:
        return Framing(Body.NONE, 0, keep)
    codings = head.values("transfer-encoding") if "transfer-encoding" in fields else None
    lengths = fields.get("content-length")
    if lengths is not None and (len(lengths) > 1 or "," in lengths[0]):
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
        length = lengths[0]
        if not (length.isascii() and length.isdigit() and len(length) <= 18):
            raise HttpError(f"not a valid Content-Length: {length[:80]!r}")
        if int(length) > max_body:
            raise HttpError(f"the answer's body is {length} bytes, over {max_body}")
        return Framing(Body.LENGTH, int(length), keep)
    return Framing(Body.CLOSE, 0, False)


def chunk_size(line: bytes) -> int:
    """The size on a chunk's first line (hex digits, extensions ignored, CRLF included)."""
    match = _CHUNK_LINE.fullmatch(line)
    if match is None:
        raise HttpError(f"not a valid chunk size line: {line[:40]!r}")
    return int(match[1], 16)
