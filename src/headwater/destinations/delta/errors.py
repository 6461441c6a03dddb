"""How a Delta destination's errors count: ``classify`` decides, ``classified`` applies it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from headwater.destinations.base import DestinationError, DestinationUnavailable
from headwater.errors import HeadwaterError

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


@contextmanager
def classified() -> Iterator[None]:
    try:
        yield
    except HeadwaterError:
        raise
    except Exception as exc:
        raise classify(exc) from exc
