"""PostgreSQL's text form of a value -> the JSON value a transport message carries.

Both ``pgoutput`` and ``COPY ... TO STDOUT`` send a column's text output, so one converter per
type OID serves the copy and the stream. The session runs with ``DateStyle=ISO`` and
``TimeZone=UTC`` so that the texts do not depend on the server's settings.

What each type becomes, chosen so that nothing is lost on the way to a mirror:
- booleans, integers: JSON booleans and numbers;
- float4/float8: JSON numbers, except NaN and the infinities, which stay text;
- numeric: text (exact: ``"12.50"`` keeps its scale, and any precision fits);
- bytea: base64 text;
- arrays: JSON arrays of their elements converted the same way (NULL elements are null);
- everything else (timestamps, json/jsonb, uuid, intervals, ...): the server's text, as is.
The schema message names each column's SQL type, so a writer can type the text again.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from typing import Any

Convert = Callable[[str], Any]

BOOL, BYTEA, INT8, INT2, INT4, OID, FLOAT4, FLOAT8 = 16, 17, 20, 21, 23, 26, 700, 701

_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_COPY_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{1,2}|[0-7]{1,3}|.)")


def _bool(v: str) -> bool:
    return v == "t"


def _float(v: str) -> float | str:
    f = float(v)
    return f if math.isfinite(f) else v


def _bytea(v: str) -> str:
    if v.startswith("\\x"):
        return base64.b64encode(bytes.fromhex(v[2:])).decode()
    raise ValueError(f"bytea text {v[:20]!r} is not in hex format (set bytea_output=hex)")


_SCALAR: dict[int, Convert] = {
    BOOL: _bool,
    INT2: int,
    INT4: int,
    INT8: int,
    OID: int,
    FLOAT4: _float,
    FLOAT8: _float,
    BYTEA: _bytea,
}


def scalar(type_oid: int) -> Convert | None:
    """The converter of a scalar type; None when its text is kept as is."""
    return _SCALAR.get(type_oid)


def array(element: Convert | None, delimiter: str = ",") -> Convert:
    """The converter of an array whose elements convert with ``element``."""

    def convert(v: str) -> Any:
        return _parse_array(v, element, delimiter)

    return convert


def _parse_array(text: str, element: Convert | None, delimiter: str) -> list[Any]:
    if text.startswith("["):  # explicit bounds: [0:2]={1,2,3}
        text = text[text.index("=") + 1 :]
    out, end = _array_at(text, 0, element, delimiter)
    if end != len(text):
        raise ValueError(f"array text {text[:40]!r} has trailing characters")
    return out


def _array_at(text: str, i: int, element: Convert | None, delimiter: str) -> tuple[list[Any], int]:
    if text[i] != "{":
        raise ValueError(f"array text {text[:40]!r} does not start with '{{'")
    i += 1
    out: list[Any] = []
    if text[i] == "}":
        return out, i + 1
    while True:
        if text[i] == "{":
            item, i = _array_at(text, i, element, delimiter)
            out.append(item)
        elif text[i] == '"':
            j = i + 1
            chars: list[str] = []
            while text[j] != '"':
                if text[j] == "\\":
                    j += 1
                chars.append(text[j])
                j += 1
            raw = "".join(chars)
            out.append(element(raw) if element else raw)
            i = j + 1
        else:
            j = i
            while text[j] != delimiter and text[j] != "}":
                j += 1
            raw = text[i:j]
            out.append(None if raw == "NULL" else element(raw) if element else raw)
            i = j
        if text[i] == "}":
            return out, i + 1
        i += 1  # the delimiter


def copy_field(field: str) -> str | None:
    """A field of ``COPY ... TO STDOUT`` text format, unescaped; ``\\N`` is NULL."""
    if field == "\\N":
        return None
    if "\\" not in field:
        return field
    return _COPY_ESCAPE.sub(_unescape, field)


def _unescape(m: re.Match[str]) -> str:
    s = m.group(1)
    if s[0] == "x" and len(s) > 1:
        return chr(int(s[1:], 16))
    if s[0].isdigit() and s[0] < "8":
        return chr(int(s, 8))
    return _ESCAPES.get(s, s)
