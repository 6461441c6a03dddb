"""gRPC calls shared between intake workers.

An HTTP/2 connection lives in one intake worker, so the calls of a client that multiplexes them
over one connection (Raccoon's gRPC clients do) would all be served by one process while its
siblings idle. Only the framing needs the connection: decoding a call, encoding its events and
appending them do not. So a worker serving more calls than a sibling hands it the next one, and
the sibling serves it as its own and returns the response message; the worker that owns the
connection answers the client either way.

How they talk: each worker listens on a Unix socket in the abstract namespace named after the
main process and its own index (``Siblings.address``), and connects to each sibling's. A call
goes as a ``wire`` HAND frame on the caller's socket and comes back as a TAKEN frame, each
written as soon as it is made. A worker serves only processes of the same user whose parent is
its own parent (``SO_PEERCRED``): its siblings.

Which calls are handed: a call is served here unless more calls are being served here than by
the least busy sibling. A sibling's count is the larger of the calls handed to it and not yet
answered and what its last answer said it was serving (trusted for ``SIBLING_FRESH_S``). One
call at a time is never handed; calls in flight are spread so each process serves its share.

Handing a call costs CPU of its own (its bytes cross a socket both ways, and each process
produces its own, smaller, requests to the log). So with ``share_grpc_calls: auto`` a worker
hands calls only while the machine has a spare core to put them on (``SpareCpu``, read from
``/proc/stat`` each ``SpareCpu.EVERY_S``): it starts when a window of it saw at least
``SpareCpu.ON`` of a core idle, and stops when one saw less than ``SpareCpu.OFF``. When
brokers or other work fill the cores, every call is served where it arrived.

A sibling that is stopping declines a call before starting it, and it is served here. A sibling
that goes away while serving one fails it: the client gets an error (its outcome is unknown, as
when the collector itself stops mid-call) and sends it again. A worker reports itself ready once
it reaches every sibling; one that is not there (being forked again) is connected to again every
``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from headwater.collector import wire
from headwater.collector.grpc_server import Handle
from headwater.collector.metrics import Metrics

log = logging.getLogger(__name__)

SIBLING_FRESH_S = 1.0
RETRY_S = 0.1
CONNECT_TIMEOUT_S = 10.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Siblings:
    """Where an intake worker stands: its index among ``count`` workers of the main process
    ``group`` names."""

    index: int
    count: int
    group: str

    def address(self, index: int) -> str:
        return f"\0headwater-intake-{self.group}-{index}"


class SpareCpu:
    """Whether the machine has had a spare core of late: idle time across every CPU in the
    last window of ``EVERY_S``, with hysteresis (on at ``ON`` cores idle, off below ``OFF``).
    Without ``/proc/stat`` it always says yes."""

    EVERY_S = 1.0
    ON = 0.4
    OFF = 0.1

    def __init__(self, path: str = "/proc/stat") -> None:
        self._path = path
        self._last = self._read()
        self._next = time.monotonic() + self.EVERY_S
        self.spare = True
        self.idle_cores = float("nan")

    def _read(self) -> tuple[int, int] | None:
        """(idle, total) jiffies, summed over every CPU."""
        try:
            with open(self._path) as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + fields[4], sum(fields[:8])

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return self.spare
        self._next = now + self.EVERY_S
        current = self._read()
        if current is None or self._last is None:
            self._last = current
            return self.spare
        idle, total = current[0] - self._last[0], current[1] - self._last[1]
        self._last = current
        if total > 0:
            self.idle_cores = idle / total * (os.cpu_count() or 1)
            self.observe(self.idle_cores)
        return self.spare

    def observe(self, idle_cores: float) -> None:
        if self.spare and idle_cores < self.OFF:
            self.spare = False
        elif not self.spare and idle_cores >= self.ON:
            self.spare = True


class HandedCallFailed(Exception):
    """The sibling that served a handed call failed it, or went away while serving it."""


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _from_sibling(transport: asyncio.BaseTransport) -> bool:
    """Whether the process at the other end is a sibling: same user, same parent."""
    sock = transport.get_extra_info("socket")
    try:
        pid, uid, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
    except (OSError, AttributeError):
        return False
    return uid == os.getuid() and _parent_of(pid) == os.getppid()


class _Sibling(asyncio.Protocol):
    """This worker's socket to a sibling: the calls handed to it and their answers."""

    def __init__(self, sharing: CallSharing, index: int) -> None:
        self.sharing = sharing
        self.index = index
        self.transport: asyncio.Transport | None = None
        self._frames = wire.Frames()
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._next = 0
        self._said = 0  # the calls it was serving, as its last answer said
        self._said_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._frames.feed(data)
            for kind, ident, payload in frames:
                if kind != wire.TAKEN:
                    raise ValueError(f"a frame of kind {kind} from a sibling")
                status, serving, response = wire.read_taken(payload)
                self._said, self._said_at = serving, asyncio.get_running_loop().time()
                future = self._waiting.pop(ident, None)
                if future is not None and not future.done():
                    future.set_result((status, response))
        except (ValueError, struct.error) as e:
            log.error(
                "intake worker %d sent a bad answer (%s); its socket is closed", self.index, e
            )
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(HandedCallFailed("the intake worker serving it went away"))
        self.sharing._lost(self)

    @property
    def load(self) -> int:
        said = self._said
        if said and asyncio.get_running_loop().time() - self._said_at >= SIBLING_FRESH_S:
            said = 0
        return max(len(self._waiting), said)

    def hand(
        self, message: bytes, metadata: Mapping[str, str], peer: str
    ) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._next = (self._next + 1) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = future
        payload = wire.call_payload(message, metadata, peer)
        self.transport.write(wire.frame(wire.HAND, self._next, *payload))
        return future


class _Taker(asyncio.Protocol):
    """A sibling's socket to this worker: the calls it hands here, answered."""

    def __init__(self, sharing: CallSharing) -> None:
        self.sharing = sharing
        self.transport: asyncio.Transport | None = None
        self._frames = wire.Frames()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not _from_sibling(transport):
            log.warning("a process that is not a sibling intake worker connected; closed")
            transport.close()
            return
        self.transport = transport  # type: ignore[assignment]
        self.sharing._takers.add(self)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        try:
            for kind, ident, payload in self._frames.feed(data):
                if kind != wire.HAND:
                    raise ValueError(f"a frame of kind {kind} from a sibling")
                self.sharing._take(self, ident, payload)
        except ValueError as e:
            log.error("a sibling intake worker sent a bad call (%s); its socket is closed", e)
            self.transport.close()

    def answer(self, ident: int, payload: bytes) -> None:
        if self.transport is not None:  # (gone: the sibling failed the call itself)
            self.transport.write(wire.frame(wire.TAKEN, ident, payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.sharing._takers.discard(self)


class CallSharing:
    """A worker's gRPC handle that hands calls to its siblings, and serves theirs."""

    def __init__(
        self,
        handle: Handle,
        metrics: Metrics,
        siblings: Siblings,
        spare: Callable[[], bool] | None = None,
    ) -> None:
        self._handle = handle
        self._spare = spare  # None: hand whenever the balance says so
        self._metrics = metrics
        self.siblings = siblings
        self.serving = 0  # calls being served here: this worker's and its siblings'
        self._peers: dict[int, _Sibling] = {}  # connected siblings, by index
        self._takers: set[_Taker] = set()
        self._server: asyncio.AbstractServer | None = None
        self._taking = True
        self._closed = False
        self._taken: set[asyncio.Task[None]] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self._all_connected = asyncio.Event()

    async def start(self) -> None:
        """Listen for the siblings' calls and connect to every sibling (waiting up to
        ``CONNECT_TIMEOUT_S`` for them all)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.siblings.address(self.siblings.index))
        except OSError as e:
            sock.close()
            log.warning("this intake worker serves none of its siblings' gRPC calls: %s", e)
        else:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Taker(self), sock=sock)
        for index in range(self.siblings.count):
            if index != self.siblings.index:
                self._connect_later(index, 0.0)
        try:  # (a sibling listens before it waits here: they all get there)
            await asyncio.wait_for(self._all_connected.wait(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "this intake worker reached %d of its %d siblings in %.0f s; it shares calls "
                "with those, and connects to the others when they listen",
                len(self._peers),
                self.siblings.count - 1,
                CONNECT_TIMEOUT_S,
            )

    def _connect_later(self, index: int, delay: float) -> None:
        if not self._closed:
            asyncio.get_running_loop().call_later(delay, self._connect_now, index)

    def _connect_now(self, index: int) -> None:
        if self._closed or index in self._peers:
            return
        task = asyncio.get_running_loop().create_task(self._connect(index))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:  # (connected here: uvloop takes no abstract address)
            await loop.sock_connect(sock, self.siblings.address(index))
            _, sibling = await loop.create_unix_connection(lambda: _Sibling(self, index), sock=sock)
        except OSError:  # not listening (yet, or any more)
            sock.close()
            self._connect_later(index, RETRY_S)
            return
        if self._closed and sibling.transport is not None:
            sibling.transport.close()
        else:
            self._peers[index] = sibling
            if len(self._peers) == self.siblings.count - 1:
                self._all_connected.set()

    def _lost(self, sibling: _Sibling) -> None:
        if self._peers.get(sibling.index) is sibling:
            del self._peers[sibling.index]
            self._all_connected.clear()
        self._connect_later(sibling.index, RETRY_S)

    # -- this worker's calls -------------------------------------------------------------------
    async def __call__(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        sibling = self._least_busy()
        if sibling is None:
            return await self._serve(message, metadata, peer)
        status, response = await sibling.hand(message, metadata, peer)
        if status == wire.DECLINED:
            self._metrics.shared["declined"].inc()
            return await self._serve(message, metadata, peer)
        if status != wire.OK:
            raise HandedCallFailed(response.decode("utf-8", "replace"))
        self._metrics.shared["handed"].inc()
        return response

    def _least_busy(self) -> _Sibling | None:
        """The sibling to hand the next call to, or None: serve it here."""
        if not self.serving or self._closed or not self._peers:
            return None
        if self._spare is not None and not self._spare():
            return None
        load, _, sibling = min((s.load, i, s) for i, s in self._peers.items())
        return sibling if load < self.serving else None

    async def _serve(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        self.serving += 1
        try:
            return await self._handle(message, metadata, peer)
        finally:
            self.serving -= 1

    # -- the siblings' calls -------------------------------------------------------------------
    def _take(self, taker: _Taker, ident: int, payload: memoryview) -> None:
        if not self._taking:
            taker.answer(ident, wire.taken_payload(wire.DECLINED, self.serving))
            return
        task = asyncio.get_running_loop().create_task(self._serve_taken(taker, ident, payload))
        self._taken.add(task)
        task.add_done_callback(self._taken.discard)

    async def _serve_taken(self, taker: _Taker, ident: int, payload: memoryview) -> None:
        answer = wire.taken_payload(wire.ERROR_FAILED, 0, b"the intake worker serving it stopped")
        try:
            message, metadata, peer = wire.read_call(payload)
            response = await self._serve(message, metadata, peer)
            self._metrics.shared["taken"].inc()
            answer = wire.taken_payload(wire.OK, self.serving, response)
        except Exception as e:
            log.exception("a gRPC call handed by a sibling worker failed")
            answer = wire.taken_payload(wire.ERROR_FAILED, self.serving, str(e).encode())
        finally:  # (cancelled: the caller still gets an answer)
            taker.answer(ident, answer)

    # -- stopping ------------------------------------------------------------------------------
    async def close(self, grace_s: float) -> None:
        """Hand no more calls and decline the siblings' from now on; finish those being served
        (up to ``grace_s``). Calls handed earlier are still answered until ``disconnect``."""
        self._taking = False
        self._closed = True
        for task in self._connecting:
            task.cancel()
        if self._server is not None:
            self._server.close()
        if self._taken:
            await asyncio.wait(set(self._taken), timeout=grace_s)

    def disconnect(self) -> None:
        """Close every socket to and from the siblings (calls handed and unanswered fail)."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for sibling in list(self._peers.values()):
            if sibling.transport is not None:
                sibling.transport.close()
        for taker in list(self._takers):
            if taker.transport is not None:
                taker.transport.close()
