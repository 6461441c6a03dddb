"""How a Delta destination's errors count: ``classify`` decides, ``classified`` applies it."""

from __future__ import annotations

from contextlib import AbstractContextManager

from headwater.destinations.base import DestinationError, DestinationUnavailable
from headwater.errors import HeadwaterError, classified_by

_TRANSIENT_TEXT = ("connection", "timed out", "timeout", "503", "slow down", "throttl", "reset")


def classify(exc: BaseException) -> HeadwaterError:
    """delta-rs and file-system errors as headwater's: a commit that lost every retry to other
    writers, and the network or store being away, are transient; the rest terminal."""
    from deltalake.exceptions import CommitFailedError

    text = str(exc)
    if isinstance(exc, CommitFailedError | ConnectionError | TimeoutError):
        return DestinationUnavailable(f"delta: {text}")
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | PermissionError):
        return DestinationUnavailable(f"delta: {text}")
    if any(t in text.lower() for t in _TRANSIENT_TEXT):
        return DestinationUnavailable(f"delta: {text}")
    return DestinationError(f"delta: {text}")


def classified() -> AbstractContextManager[None]:
    """A block whose foreign errors ``classify`` names."""
    return classified_by(classify)
