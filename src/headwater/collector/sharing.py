"""gRPC calls shared between intake workers.

An HTTP/2 connection lives in one intake worker, so the calls of a client that multiplexes them
over one connection (Raccoon's gRPC clients do) would all be served by one process while its
siblings idle. Only the framing needs the connection: decoding a call, encoding its events and
appending them do not. So a worker serving more calls than its sibling hands the next call to
it (``HAND`` over its link; the process holding the links passes it on, ``collector.host``),
and the sibling serves it as its own and answers with the response message. The worker that
owns the connection answers the client either way.

Which calls are handed: a call is served here unless more calls are being served here than
the sibling serves (its count comes with each answer, forgotten after ``SIBLING_FRESH_S``), and
than this worker has handed and not had answered. One call at a time is never handed; calls
in flight are spread so each process serves about half.

A sibling that is stopping, or that has none to hand on to, declines a call before starting it,
and it is served here. A sibling that goes away while serving one fails it: the client gets an
error (its outcome is unknown, as when the collector itself stops mid-call) and sends it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from headwater.collector import wire
from headwater.collector.grpc_server import Handle
from headwater.collector.link import Link
from headwater.collector.metrics import Metrics

log = logging.getLogger(__name__)

SIBLING_FRESH_S = 1.0


class HandedCallFailed(Exception):
    """The sibling that served a handed call failed it, or went away while serving it."""


class CallSharing:
    """A worker's gRPC handle that hands calls to its sibling, and serves the sibling's."""

    def __init__(self, handle: Handle, link: Link, metrics: Metrics) -> None:
        self._handle = handle
        self._link = link
        self._metrics = metrics
        self.serving = 0  # calls being served here: this worker's and its sibling's
        self.handed = 0  # this worker's calls its sibling is serving
        self._sibling = 0  # the calls the sibling serves, as its last answer said
        self._sibling_at = 0.0
        self._taking = True
        self._taken: set[asyncio.Task[None]] = set()
        link.on_take = self._take

    async def __call__(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        if self._should_hand():
            return await self._hand(message, metadata, peer)
        return await self._serve(message, metadata, peer)

    def _should_hand(self) -> bool:
        if not self.serving:
            return False
        sibling = self.handed
        if (
            self._sibling > sibling
            and asyncio.get_running_loop().time() - self._sibling_at < SIBLING_FRESH_S
        ):
            sibling = self._sibling
        return sibling < self.serving

    async def _serve(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        self.serving += 1
        try:
            return await self._handle(message, metadata, peer)
        finally:
            self.serving -= 1

    async def _hand(self, message: bytes, metadata: Mapping[str, str], peer: str) -> bytes:
        self.handed += 1
        try:
            status, sibling, response = await self._link.hand(message, metadata, peer)
        finally:
            self.handed -= 1
        if status == wire.DECLINED:
            self._metrics.shared["declined"].inc()
            return await self._serve(message, metadata, peer)
        self._sibling = sibling
        self._sibling_at = asyncio.get_running_loop().time()
        if status != wire.OK:
            raise HandedCallFailed(response.decode("utf-8", "replace"))
        self._metrics.shared["handed"].inc()
        return response

    # -- the sibling's calls -----------------------------------------------------------------
    def _take(self, ident: int, payload: memoryview) -> None:
        if not self._taking:
            self._link.answer_take(ident, wire.taken_payload(wire.DECLINED, self.serving))
            return
        task = asyncio.get_running_loop().create_task(self._serve_taken(ident, payload))
        self._taken.add(task)
        task.add_done_callback(self._taken.discard)

    async def _serve_taken(self, ident: int, payload: memoryview) -> None:
        answer = wire.taken_payload(wire.ERROR_FAILED, 0, b"the intake worker serving it stopped")
        try:
            message, metadata, peer = wire.read_call(payload)
            response = await self._serve(message, metadata, peer)
            self._metrics.shared["taken"].inc()
            answer = wire.taken_payload(wire.OK, self.serving, response)
        except Exception as e:
            log.exception("a gRPC call handed by the sibling worker failed")
            answer = wire.taken_payload(wire.ERROR_FAILED, self.serving, str(e).encode())
        finally:  # (cancelled: the caller still gets an answer)
            self._link.answer_take(ident, answer)

    async def close(self, grace_s: float) -> None:
        """Decline the sibling's calls from now on; finish those being served (up to
        ``grace_s``)."""
        self._taking = False
        if self._taken:
            await asyncio.wait(set(self._taken), timeout=grace_s)
