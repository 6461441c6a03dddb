"""Write keys: sources are configured with SHA-256 hashes of their keys; a presented key is
hashed and compared in constant time with every configured hash."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

from headwater.collector.config import SourceConfig
from headwater.collector.errors import unauthorized


def hash_key(key: str) -> str:
    """The form a write key is stored in: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class WriteKeys:
    def __init__(self, sources: list[SourceConfig]) -> None:
        self._hashes = [
            (bytes.fromhex(h.removeprefix("sha256:")), s.id) for s in sources for h in s.write_keys
        ]

    @property
    def configured(self) -> bool:
        return bool(self._hashes)

    def source_for(self, key: str | None) -> str:
        """The source owning ``key``; ``Rejected`` (401) when it is missing or unknown."""
        if not key:
            raise unauthorized("a write key is required")
        digest = hashlib.sha256(key.encode()).digest()
        found = ""
        for h, source in self._hashes:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(digest, h):
                found = source
        if not found:
            raise unauthorized("unknown write key")
        return found


def key_from_headers(
    headers: Mapping[str, str], query: Mapping[str, str] | None = None
) -> str | None:
    """A write key as SDKs send it: Basic auth user (Segment, RudderStack), Bearer token,
    ``X-Write-Key`` (Jitsu), or a ``token``/``writeKey`` query parameter."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "basic" and value:
        try:
            user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
        except (binascii.Error, UnicodeDecodeError):
            raise unauthorized("the Authorization header is not valid Basic auth") from None
        return user or None
    if scheme.lower() == "bearer" and value:
        return value.strip()
    for name in ("x-write-key", "x-auth-token"):
        if headers.get(name):
            return headers[name]
    if query:
        return query.get("token") or query.get("writeKey") or query.get("writekey")
    return None
