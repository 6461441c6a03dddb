"""Seconds per phase, summed: how the writer and the tasks say where a batch's time went."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the time the block takes to ``seconds[name]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
