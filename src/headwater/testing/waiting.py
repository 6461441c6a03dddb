"""Waiting on a condition with a deadline, the way tests synchronise (never a bare sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02


def wait_until(check: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """``check()``'s first truthy answer, looked for every 20 ms until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not in {timeout:g} s: {what}")
        time.sleep(POLL_S)


async def until(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Wait in the event loop until ``check()`` is true, looked at every 20 ms, or fail naming
    ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not in {timeout:g} s: {what}")
        await asyncio.sleep(POLL_S)
