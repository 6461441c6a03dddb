"""One writing process per log directory: an exclusive ``flock`` on ``<dir>/LOCK``.

A process forked by the holder (the collector's intake workers, forked again after a worker
died) closes its copy of the descriptor at once: the lock then stays the holder's alone, and
ends with the holder even while such a child lives on."""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from pathlib import Path

from headwater.bus.errors import LogLocked

_HELD: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _drop_in_child() -> None:
    for lock in list(_HELD):
        if lock._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(lock._fd)  # the parent's descriptor keeps the flock
            lock._fd = -1
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


class DirectoryLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LogLocked(
                f"the log at {self.path.parent} is in use by process {holder}; only one process "
                "may write to a log (open it read-only, or stop that process)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        _HELD.add(self)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1
            _HELD.discard(self)
