"""Collectors for tests: one running in a background thread (real sockets on a free loopback
port, a real bus underneath), or ``headwater collector`` as a child process to kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from headwater.bus.base import Bus
from headwater.collector.config import CollectorConfig
from headwater.collector.server import CollectorServer
from headwater.collector.service import Collector
from headwater.testing.process import OutputLines

DEADLINE_S = 30.0  # for the collector process to start, answer /healthz or stop


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


COLLECTOR_ROLE = ("collector", "--port", "0", "--grpc-port", "0")


class CollectorProcess:
    """``headwater collector --port 0 --grpc-port 0`` (or another server ``role``: ``webhooks
    --port 0``) as a child process; its stdout is read line by line, its stderr goes to a
    file."""

    def __init__(
        self,
        config_file: Path,
        stderr_path: Path,
        role: Sequence[str] = COLLECTOR_ROLE,
        *,
        group: bool = False,
    ) -> None:
        self.stderr_path = stderr_path
        self.group = group  # a process group of its own: ``kill`` takes Spark's JVM too
        self._stderr: IO[bytes] = stderr_path.open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "headwater",
                "--config",
                str(config_file),
                *role,
            ],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=group,
        )
        assert self.proc.stdout is not None
        self.out = OutputLines(self.proc.stdout, f"headwater {role[0]}", self.stderr)

    def wait_for_line(self, prefix: str) -> str:
        """The first stdout line starting with ``prefix``; fails at the deadline or at exit."""
        return self.out.wait_for(prefix, DEADLINE_S)

    def wait_healthy(self, context: ssl.SSLContext | None = None) -> int:
        """The HTTP port, once GET /healthz answers 200 (within the deadline); ``context``
        verifies the certificate of a collector serving TLS."""
        url = self.wait_for_line("headwater: health at ").split(" at ", 1)[1]
        deadline = time.monotonic() + DEADLINE_S
        last: object = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=DEADLINE_S, context=context) as response:
                    if response.status == 200:
                        return int(url.rsplit(":", 1)[1].split("/", 1)[0])
                    last = response.status
            except urllib.error.HTTPError as e:  # answered, not 200 yet (starting)
                e.close()
                last = e.code
            except (urllib.error.URLError, OSError) as e:
                last = e
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)  # a pause between tries that also sees an exit
                break
        raise AssertionError(f"{url} did not answer 200 in time: {last}; {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, to the whole process group when it has one (no-op once it exited)."""
        if self.proc.poll() is not None:
            return
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(signal.SIGKILL)

    def stop(self) -> int:
        """SIGTERM, and the exit code once it has stopped gracefully."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=DEADLINE_S)

    def close(self) -> int:
        """Kill if still running, reap, release the pipes; the exit code."""
        self.kill()
        code = self.proc.wait(timeout=DEADLINE_S)
        self.out.join(DEADLINE_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return code


@contextmanager
def collector_with_grpc(
    root: Path, collector_yaml: str = "", context: ssl.SSLContext | None = None
) -> Iterator[tuple[CollectorProcess, int]]:
    """``headwater collector`` with its data under ``root`` and ``collector_yaml`` (indented
    lines) in its ``collector:`` section, once healthy (``context``: as ``wait_healthy``):
    the process and its gRPC port."""
    config = root / "headwater.yaml"
    config.write_text(f"data_dir: {root / 'state'}\ncollector:\n{collector_yaml or '  {}'}\n")
    process = CollectorProcess(config, root / "collector.err")
    try:
        process.wait_healthy(context)
        line = process.wait_for_line("headwater: gRPC EventService on ")
        yield process, int(line.split()[4].rsplit(":", 1)[1])  # "... on HOST:PORT [(TLS...)]"
    finally:
        process.close()
