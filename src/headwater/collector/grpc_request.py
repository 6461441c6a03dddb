"""What a gRPC call's header block says, and whether RFC 9113 lets it open a request (§8.2-8.3)
or end one as its trailers (§8.1).

``parse_request`` runs once per distinct header block (``http2.HeaderBlocks`` caches its result
while the decoder's table is unchanged), so the checks cost a call nothing after the first.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

from headwater.collector import http2 as h2


def shown(value: bytes) -> str:
    """A header value for a message: as UTF-8, its other bytes escaped (``\\xff``)."""
    return value.decode("utf-8", "backslashreplace")


# A request's pseudo-header fields (RFC 9113 §8.3.1), the ones every request but CONNECT carries,
# and the fields that only mean something to an HTTP/1.1 connection (§8.2.2)
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
_REQUIRED_PSEUDO = frozenset({b":method", b":scheme", b":path"})
_CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


@dataclass(frozen=True, slots=True)
class Request:
    """What a call's header block says."""

    method: bytes
    path: bytes
    content_type: bytes
    encoding: bytes
    metadata: Mapping[str, str]
    size: int  # HPACK's measure of the list: names, values and 32 per field
    content_length: int  # what its content-length says the DATA will add up to, or -1
    request_problem: str  # why the block cannot open a request (RFC 9113 §8.2-8.3), or ""
    trailers_problem: str  # why it cannot end a request as its trailers, or ""


def parse_request(headers: h2.Headers) -> Request:
    method = path = content_type = b""
    encoding = b"identity"
    metadata: dict[str, str] = {}
    size = 0
    content_length = -1
    pseudo: set[bytes] = set()
    malformed = ""
    regular = False
    for name, value in headers:
        size += len(name) + len(value) + 32
        if name[:1] == b":":
            if malformed:
                pass
            elif regular:
                malformed = f"{shown(name)} after a regular field (RFC 9113 §8.3)"
            elif name not in _REQUEST_PSEUDO:
                malformed = f"the pseudo-header field {shown(name)} (RFC 9113 §8.3)"
            elif name in pseudo:
                malformed = f"{shown(name)} twice (RFC 9113 §8.3.1)"
            elif name == b":path" and not value:
                malformed = "an empty :path (RFC 9113 §8.3.1)"
            pseudo.add(name)
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
            continue
        regular = True
        if malformed:
            pass
        elif name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            malformed = f"the connection-specific field {shown(name)} (RFC 9113 §8.2.2)"
        elif name != name.lower():
            malformed = f"the field name {shown(name)} in upper case (RFC 9113 §8.2)"
        if name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
        elif name == b"content-length":
            if not value.isdigit() or content_length not in (-1, int(value)):
                malformed = malformed or f"the content-length {shown(value)} (RFC 9110 §8.6)"
            else:
                content_length = int(value)
        elif not name.endswith(b"-bin"):
            metadata.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    missing = _REQUIRED_PSEUDO - pseudo
    if malformed or not missing or method == b"CONNECT":
        opening = malformed
    else:
        opening = f"a request without {shown(min(missing))} (RFC 9113 §8.3.1)"
    ending = f"trailers with {shown(min(pseudo))} (RFC 9113 §8.1)" if pseudo else malformed
    meta = types.MappingProxyType(metadata)
    return Request(
        method, path, content_type, encoding, meta, size, content_length, opening, ending
    )
