"""A child process's stdout, read line by line on a thread, to wait on with a deadline."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import IO


class OutputLines:
    def __init__(self, stream: IO[str], name: str, stderr: Callable[[], str]) -> None:
        self.name = name
        self.stderr = stderr
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first line starting with ``prefix``; fails at the deadline or when the child
        exits first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"{self.name} exited: {self.seen} {self.stderr()}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting with {prefix!r} in time: {self.seen}")

    def join(self, timeout: float) -> None:
        self._reader.join(timeout)
