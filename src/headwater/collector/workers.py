"""Intake workers: several processes serve the collector's ports, one process holds the log.

``collector.workers`` (``auto``: one per core, at most ``MAX_AUTO``) processes are forked before
the main process starts anything else (no threads yet, so nothing is copied half-done). Each
worker has its own listening socket on the same port (``SO_REUSEPORT``: the kernel spreads new
connections over them) and, for gRPC, binds the same port too. A worker decodes requests,
encodes their events into the log's columnar batches and sends them, over a Unix socket, to the
main process, which queues them on the log's writer as they are and answers once they are
durable (``collector.host``). The bodies travel through memory the two processes share
(``collector.ring``), so the log's writer writes them from where the worker encoded them.
Acks keep their meaning: a worker acks a request only when the main process has answered that
its batches are fsync'd.

What stays correct across workers, and how:
- connection limits per identity and in total: counted in the main process (``CONN_OPEN``);
  a worker that goes away releases its connections;
- ``req_guid`` dedup: per WebSocket connection, and a connection lives in one worker;
- metrics: each worker counts its own, ``/metrics`` (on any worker) and the console sum them;
- admission: evaluated in the main process, which tells every worker its refusal;
- one gRPC connection's calls: a worker busier than a sibling hands it calls over a socket of
  their own (``collector.sharing``), and answers them on the connection it owns.

With ``bus: kafka`` the workers are independent producers; the main process still keeps the
shared connection counts. A worker that exits unexpectedly is forked again (its listening
socket stays open in the main process meanwhile, so connections wait in its backlog). SIGTERM
on the main process stops the workers first (each finishes its requests, which the log still
takes), then the log is flushed and closed. If the main process dies, its workers die with it
(``PR_SET_PDEATHSIG``): the collector fails as one unit, its clients' unacked requests are sent
again elsewhere, and no orphan keeps serving the port.
With ``collector.tls`` each worker serves TLS with its own contexts; SIGHUP on the main process
is passed on to every worker, which reloads its certificate (a worker forked later reads the
files as they are then).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import mmap
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from headwater.collector.config import CollectorConfig
from headwater.collector.ring import shared_mapping
from headwater.collector.sharing import Siblings

if TYPE_CHECKING:
    from headwater.collector.host import LogHost
    from headwater.config.model import HeadwaterConfig

log = logging.getLogger(__name__)

MAX_AUTO = 4
PR_SET_PDEATHSIG = 1
BACKLOG = 4096
READY_TIMEOUT_S = 60.0


def worker_count(config: CollectorConfig) -> int:
    """How many intake processes to run (1: the intake runs in the main process)."""
    if config.workers == "auto":
        return max(1, min(os.cpu_count() or 1, MAX_AUTO))
    return config.workers


def _preload() -> None:
    import headwater.collector.grpc_server
    import headwater.collector.link
    import headwater.collector.server
    import headwater.collector.service  # noqa: F401

    gc.collect()
    gc.freeze()


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the worker stops when its link closes
        log.debug("no PR_SET_PDEATHSIG here")
    if os.getppid() != parent:
        os._exit(1)


def _socket(host: str, port: int, *, listen: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        if listen:
            s.listen(BACKLOG)
            s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


# What a forked worker runs: (config, its listening socket, the gRPC port, its end of the link,
# its shared ring, where it stands among its siblings) -> exit code. The process assembling the
# roles provides it, so a worker serves what that process would (the collector with its webhook
# intake).
WorkerMain = Callable[
    [
        "HeadwaterConfig",
        socket.socket,
        "int | None",
        socket.socket,
        "mmap.mmap | None",
        Siblings,
    ],
    int,
]


class IntakeWorkers:
    """The forked intake processes, seen from the main process."""

    def __init__(
        self,
        config: HeadwaterConfig,
        host: str,
        port: int,
        grpc_port: int | None,
        count: int,
        main: WorkerMain,
    ) -> None:
        self.config = config
        self.main = main
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self.count = count
        self.sockets: list[socket.socket] = []
        self.pids: dict[int, int] = {}
        self.links: dict[int, socket.socket] = {}
        self.rings: dict[int, mmap.mmap] = {}  # each worker's shared memory (collector.ring)
        self._grpc_hold: socket.socket | None = None
        self.stopping = False

    # -- starting ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the ports and fork the workers (call before any thread starts). What the
        workers run is imported first and kept out of the garbage collector's walks
        (``gc.freeze``), so its memory stays shared with this process instead of being copied
        into each worker."""
        _preload()
        first = _socket(self.host, self.port, listen=True)
        self.port = first.getsockname()[1]
        self.sockets = [first]
        self.sockets += [_socket(self.host, self.port, listen=True) for _ in range(self.count - 1)]
        if self.grpc_port is not None:
            # held (bound, not listening) so that the port stays ours; the workers listen on it
            self._grpc_hold = _socket(self.host, self.grpc_port, listen=False)
            self.grpc_port = self._grpc_hold.getsockname()[1]
        for i in range(self.count):
            self._fork(i)

    def _fork(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ring = shared_mapping()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                _die_with(parent)
                ours.close()
                for i, s in enumerate(self.sockets):
                    if i != index:
                        s.close()
                for link in self.links.values():
                    link.close()
                if self._grpc_hold is not None:
                    self._grpc_hold.close()
                siblings = Siblings(index, self.count, str(parent))
                code = self.main(
                    self.config, self.sockets[index], self.grpc_port, theirs, ring, siblings
                )
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.pids[index] = pid
        self.rings[index] = ring
        old = self.links.pop(index, None)
        if old is not None:
            old.close()
        self.links[index] = ours

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.config.collector.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every worker (SIGHUP: they reload their TLS certificate)."""
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    # -- running ----------------------------------------------------------------------------
    async def serve(self, host: LogHost) -> None:
        """Attach every worker's link to ``host``, wait until each serves, then fork again
        any worker that exits, until ``stop``."""
        for index, sock in self.links.items():
            host.attach(index, sock, self.rings[index])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not host.all_ready(self.count):
            self._reap(host, restart=False)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the intake workers did not start within {READY_TIMEOUT_S:.0f} s"
                )
            await asyncio.sleep(0.02)

    async def watch(self, host: LogHost) -> None:
        while not self.stopping:
            self._reap(host, restart=True)
            await asyncio.sleep(0.25)

    def _reap(self, host: LogHost, *, restart: bool) -> None:
        for index, pid in list(self.pids.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if not done:
                continue
            del self.pids[index]
            code = os.waitstatus_to_exitcode(status)
            if self.stopping:
                continue
            if not restart:
                raise RuntimeError(f"intake worker {index} exited with code {code} at start")
            log.error(
                "intake worker %d (pid %d) exited with code %s; starting another", index, pid, code
            )
            self._fork(index)
            host.attach(index, self.links[index], self.rings[index])

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every worker and wait for them (they finish their requests first)."""
        self.stopping = True
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5
        while self.pids and time.monotonic() < deadline:
            for index, pid in list(self.pids.items()):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    del self.pids[index]
            await asyncio.sleep(0.02)
        for index, pid in list(self.pids.items()):
            log.error("intake worker %d (pid %d) did not stop in time; killing it", index, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids.clear()
        for s in self.sockets:
            s.close()
        if self._grpc_hold is not None:
            self._grpc_hold.close()
