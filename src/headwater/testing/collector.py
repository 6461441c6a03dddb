"""A collector running in a background thread, for tests: real sockets on a free loopback port,
a real bus underneath."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from headwater.bus.base import Bus
from headwater.collector.config import CollectorConfig
from headwater.collector.server import CollectorServer
from headwater.collector.service import Collector


@dataclass
class RunningCollector:
    collector: Collector
    server: CollectorServer
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def ws_url(self) -> str:
        return self.server.url.replace("http", "ws", 1) + "/api/v1/events"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop gracefully (as on SIGTERM), from the test's thread."""
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout)


@contextmanager
def running_collector(
    bus: Bus, config: CollectorConfig | None = None, *, max_record_bytes: int = 1 << 20
) -> Iterator[RunningCollector]:
    """Serve ``config`` (port 0, gRPC port 0) on ``bus`` until the block ends."""
    config = (config or CollectorConfig()).model_copy(update={"port": 0, "grpc_port": 0})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-collector", daemon=True)
    thread.start()
    collector = Collector(config, bus, max_record_bytes=max_record_bytes)
    server = CollectorServer(collector, "127.0.0.1", 0, 0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    running = RunningCollector(collector, server, loop)
    try:
        yield running
    finally:
        if collector.ready:
            running.stop()
        # as asyncio.run does: end what the server left behind (for example aiohttp's lingering
        # read of a body a slow client never finished) before the loop closes
        asyncio.run_coroutine_threadsafe(_cancel_leftover_tasks(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def _cancel_leftover_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
