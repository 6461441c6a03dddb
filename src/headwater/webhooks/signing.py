"""Standard Webhooks signatures (https://www.standardwebhooks.com): every request to a receiver
and every callback to a sender carries ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``.

A secret is ``whsec_`` followed by the base64 of the key. Rotation: while the old secret is in
its grace period both sign, and the header holds both signatures, space-separated, so a receiver
that knows either one accepts the request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from headwater.errors import TerminalError

PREFIX = "whsec_"
VERSION = "v1"
ID, TIMESTAMP, SIGNATURE = "webhook-id", "webhook-timestamp", "webhook-signature"
TOLERANCE_S = 300  # how far a timestamp may be from now when verifying


class SignatureError(TerminalError):
    """A secret is malformed, or a request's signature does not verify."""

    code = "HW-WH-001"


def decode_secret(secret: str) -> bytes:
    """The key of a ``whsec_...`` secret."""
    if not secret.startswith(PREFIX):
        raise SignatureError(f"a webhook secret starts with {PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except ValueError:
        raise SignatureError("a webhook secret is whsec_ followed by base64") from None
    if len(key) < 16:
        raise SignatureError(f"a webhook secret's key has {len(key)} bytes; at least 16")
    return key


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    # (not ``hmac.digest``: that one releases the GIL, and the workers' loop then waits for
    # the log's threads to give it back; it showed as 11% of the loop)
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return f"{VERSION},{base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class Signer:
    """Signs with every secret given (the current one first, then those in their grace
    period)."""

    keys: tuple[bytes, ...]

    @classmethod
    def from_secrets(cls, secrets: Iterable[str]) -> Signer:
        keys = tuple(decode_secret(s) for s in secrets)
        if not keys:
            raise SignatureError("no secret to sign with")
        return cls(keys)

    def headers(self, message_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
        timestamp = int(time.time() if now is None else now)
        signatures = " ".join(signature(k, message_id, timestamp, body) for k in self.keys)
        return {ID: message_id, TIMESTAMP: str(timestamp), SIGNATURE: signatures}


def verify(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Iterable[str],
    *,
    now: float | None = None,
    tolerance_s: float = TOLERANCE_S,
) -> str:
    """Check a signed request (header names in any case); the message id when one of its
    signatures matches one of ``secrets`` and its timestamp is within the tolerance."""
    lowered = {k.lower(): v for k, v in headers.items()}
    missing = [h for h in (ID, TIMESTAMP, SIGNATURE) if not lowered.get(h)]
    if missing:
        raise SignatureError(f"missing header(s): {', '.join(missing)}")
    message_id, raw_time = lowered[ID], lowered[TIMESTAMP]
    try:
        timestamp = int(raw_time)
    except ValueError:
        raise SignatureError(f"{TIMESTAMP} is not a whole number: {raw_time!r}") from None
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise SignatureError(f"{TIMESTAMP} {timestamp} is more than {tolerance_s:.0f} s from now")
    given = lowered[SIGNATURE].split()
    for key in (decode_secret(s) for s in secrets):
        expected = signature(key, message_id, timestamp, body)
        if any(hmac.compare_digest(expected, g) for g in given):
            return message_id
    raise SignatureError("no signature matches")
