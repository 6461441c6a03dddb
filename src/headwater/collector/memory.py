"""Giving the C heap's free pages back to the system.

glibc keeps memory freed in the middle of its heap; ``malloc_trim`` returns those pages. The
intake processes call it after start-up and whenever their shared ring goes idle: a burst of
large request buffers otherwise stays resident after it has been freed, in every worker.
"""

from __future__ import annotations

import ctypes
from typing import Any

_LIBC: Any = None


def trim_heap() -> None:
    """``malloc_trim(0)`` where glibc has it; nothing elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - present in glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
