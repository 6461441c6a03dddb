"""Why the collector refuses a request: one exception, mapped to each protocol's answer."""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """Raccoon's response codes (the HTTP status follows from them, see ``http_status``)."""

    UNSPECIFIED = 0
    OK = 1
    BAD_REQUEST = 2
    INTERNAL_ERROR = 3
    MAX_CONNECTION_LIMIT_REACHED = 4
    MAX_USER_LIMIT_REACHED = 5


class Rejected(Exception):
    """A request the collector will not take, with the reason the client is told.

    ``status`` is the HTTP status; ``retry_after`` (seconds) marks backpressure: the client
    should retry then, nothing was stored.
    """

    def __init__(
        self,
        reason: str,
        *,
        status: int = 400,
        code: Code = Code.BAD_REQUEST,
        retry_after: int | None = None,
        kind: str = "bad_request",
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.code = code
        self.retry_after = retry_after
        self.kind = kind  # the metrics label of the refusal


def bad_request(reason: str, kind: str = "bad_request") -> Rejected:
    return Rejected(reason, status=400, code=Code.BAD_REQUEST, kind=kind)


def unauthorized(reason: str) -> Rejected:
    return Rejected(reason, status=401, code=Code.BAD_REQUEST, kind="unauthorized")


def too_large(reason: str) -> Rejected:
    return Rejected(reason, status=413, code=Code.BAD_REQUEST, kind="too_large")


def unavailable(reason: str, retry_after: int) -> Rejected:
    return Rejected(
        reason, status=503, code=Code.INTERNAL_ERROR, retry_after=retry_after, kind="backpressure"
    )
