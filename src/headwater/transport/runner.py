"""Runs the configured readers, each on a thread of its own, restarting one that fails (after
1 s, doubling to 30 s): a source that goes away for a while costs a delay, not the reader."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

from headwater.bus.base import Bus
from headwater.config.model import HeadwaterConfig
from headwater.transport.config import ReaderConfig
from headwater.transport.reader import reader_class

log = logging.getLogger(__name__)
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class Readers:
    """The readers of ``transport.readers`` over ``bus``."""

    def __init__(self, config: HeadwaterConfig, bus: Bus) -> None:
        self._config = config
        self._bus = bus
        self._stop = threading.Event()
        self.errors: dict[str, str] = {}  # reader id -> its last error, while it retries

    @property
    def names(self) -> list[str]:
        return [r.id for r in self._config.transport.readers]

    async def run(self, stop: asyncio.Event) -> None:
        """Run every reader until ``stop`` is set; then each records its position and
        returns."""
        tasks = [
            asyncio.create_task(self._supervise(r), name=f"reader-{r.id}")
            for r in self._config.transport.readers
        ]
        try:
            await stop.wait()
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _supervise(self, config: ReaderConfig) -> None:
        delay = FIRST_RETRY_S
        while not self._stop.is_set():
            reader = reader_class(config.type)(
                config, self._bus, self._config.transport_dir(config.id)
            )
            try:
                await asyncio.to_thread(reader.run, self._stop)
                self.errors.pop(config.id, None)
                return
            except Exception as e:
                message = f"{type(e).__name__}: {e}".strip()
                self.errors[config.id] = message
                log.error("reader %s failed: %s; again in %.0f s", config.id, message, delay)
                reader.report(force=True, running=False, error=message)
            wait = delay * random.uniform(0.8, 1.2)
            await asyncio.to_thread(self._stop.wait, wait)
            delay = min(delay * 2, MAX_RETRY_S)
