"""Errors shared by every headwater package.

Every error carries a stable code (``HW-...``) that tests and operators match on, and is either
*transient* (retry with backoff) or *terminal* (send the event to the failed store / stop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar


class HeadwaterError(Exception):
    """Base of every error headwater raises on purpose."""

    code: ClassVar[str] = "HW-000"
    transient: ClassVar[bool] = False
    # a pipeline destination failing with it is stopped, not retried: only a person can fix it
    stops_destination: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class TransientError(HeadwaterError):
    """Retrying later may succeed."""

    transient = True


class TerminalError(HeadwaterError):
    """Retrying will not help."""


class ConfigError(TerminalError):
    """A configuration file or value is invalid."""

    code = "HW-CFG-001"


class MissingDependencyError(TerminalError):
    """An optional dependency is not installed."""

    code = "HW-DEP-001"

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"the Python module {module!r} is not installed; "
            f"install it with: pip install 'headwater[{extra}]'"
        )
        self.module = module
        self.extra = extra


@contextmanager
def classified_by(classify: Callable[[BaseException], HeadwaterError]) -> Iterator[None]:
    """Run a block, re-raising what is not headwater's own as ``classify`` names it (each
    connector's one function that decides transient or terminal)."""
    try:
        yield
    except HeadwaterError:
        raise
    except Exception as exc:
        raise classify(exc) from exc
