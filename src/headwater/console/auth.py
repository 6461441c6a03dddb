"""Who may use the console: an admin token opens a session; every page needs the session, every
action also its CSRF token and the console's own origin.

The token is compared as the config stores it (``sha256:<hex>``, constant time against every
configured hash). A session is a cookie (HttpOnly, SameSite=Strict) holding its expiry, the
hash it was opened with (a session dies with its token's removal from the config) and a nonce,
signed with HMAC-SHA256 under a key made when the process starts: a restart logs everyone out,
and nothing about sessions is stored. The CSRF token is an HMAC of the session under the same
key, so it needs no storage either.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import deque
from dataclasses import dataclass

from aiohttp import web

COOKIE = "hw_console"
OPEN_PATHS = ("/login", "/healthz")  # and the static files
STATIC = "/static/"
LOGIN_FAILURES_PER_MINUTE = 10


@dataclass(frozen=True)
class Session:
    token_hash: str
    expires: float
    nonce: str
    raw: str


class Sessions:
    """Opens, signs and checks sessions for the configured admin token hashes."""

    def __init__(self, token_hashes: list[str], ttl_s: float) -> None:
        self._hashes = [h.removeprefix("sha256:") for h in token_hashes]
        self._key = secrets.token_bytes(32)
        self.ttl_s = ttl_s
        self._failures: deque[float] = deque()

    @property
    def configured(self) -> bool:
        return bool(self._hashes)

    def login(self, token: str, now: float | None = None) -> str | None:
        """The cookie value of a new session for ``token``, None when no admin token matches."""
        now = time.time() if now is None else now
        digest = hashlib.sha256(token.encode()).hexdigest()
        found = ""
        for h in self._hashes:  # no early exit: the time does not depend on which one matched
            if hmac.compare_digest(digest, h):
                found = h
        if not found:
            self._failures.append(now)
            return None
        payload = f"{now + self.ttl_s:.0f}.{found[:16]}.{secrets.token_hex(8)}"
        return f"{payload}.{self._sign(payload)}"

    def throttled(self, now: float | None = None) -> bool:
        """Too many wrong tokens in the last minute (from anyone): refuse logins for a while."""
        now = time.time() if now is None else now
        while self._failures and self._failures[0] < now - 60:
            self._failures.popleft()
        return len(self._failures) >= LOGIN_FAILURES_PER_MINUTE

    def check(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie holds, None when it is missing, forged, expired or its token
        is no longer configured."""
        if not cookie:
            return None
        payload, _, signature = cookie.rpartition(".")
        if not payload or not hmac.compare_digest(signature, self._sign(payload)):
            return None
        expires, prefix, nonce = ([*payload.split("."), "", "", ""])[:3]
        try:
            until = float(expires)
        except ValueError:
            return None
        if until < (time.time() if now is None else now):
            return None
        if not any(h.startswith(prefix) for h in self._hashes):
            return None
        return Session(token_hash=prefix, expires=until, nonce=nonce, raw=cookie)

    def csrf(self, session: Session) -> str:
        return self._sign(f"csrf:{session.raw}")

    def csrf_ok(self, session: Session, token: str) -> bool:
        return hmac.compare_digest(self.csrf(session), token or "")

    def _sign(self, payload: str) -> str:
        mac = hmac.new(self._key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def same_origin(request: web.Request) -> bool:
    """The request comes from a page of this site: its Origin (or, without one, its Referer)
    names the host the request was sent to."""
    own = f"{request.scheme}://{request.host}"
    origin = request.headers.get("Origin")
    if origin is not None:
        return origin == own
    referer = request.headers.get("Referer", "")
    return referer == own or referer.startswith(own + "/")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(STATIC)
