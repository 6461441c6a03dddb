"""The gRPC intake: Raccoon's ``EventService/SendEvent`` on its own port.

The method is served through a generic handler with no generated stubs. The request reaches
``handle`` as the raw bytes the client sent, so it goes through the same decoder as the
WebSocket and REST intakes and a bad request is answered with a normal ``SendEventResponse``
(``STATUS_ERROR``/``CODE_BAD_REQUEST`` and a reason), as Raccoon answers it. ``handle`` returns
the serialized response; a ``Rejected`` it raises is answered with its code and reason, and any
other exception with ``CODE_INTERNAL_ERROR`` (and logged). A message over ``max_message_bytes``
is refused by gRPC itself before it is read: the client gets ``RESOURCE_EXHAUSTED`` with gRPC's
message naming both sizes.

``handle`` gets the call's metadata (keys are lowercase on the wire already; binary ``-bin``
entries are left out; the first value of a repeated key wins) and the peer's IP address.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import unquote

# gRPC's core installs fork handlers unless told not to. headwater up forks while its server
# threads run (to start Spark's JVM), and there the handlers are skipped half-way ("other threads
# are calling into gRPC"): seen on CI, the child then died before it could exec java. headwater
# never uses gRPC in a forked child, so the handlers are off unless the environment says otherwise.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
from grpc import aio

from headwater.collector.errors import Code, Rejected
from headwater.collector.protocols import raccoon

log = logging.getLogger(__name__)

_INTERNAL = Rejected(
    "the collector failed to handle the request",
    status=500,
    code=Code.INTERNAL_ERROR,
    kind="internal",
)

Handle = Callable[[bytes, Mapping[str, str], str], Awaitable[bytes]]
"""``handle(request bytes, metadata, peer ip) -> serialized SendEventResponse``."""


def peer_ip(peer: str) -> str:
    """The IP address in a gRPC peer string (``ipv4:127.0.0.1:5555``, ``ipv6:[::1]:5555``,
    possibly percent-encoded); "" for other transports (``unix:...``)."""
    kind, _, address = unquote(peer).partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0]
    if kind == "ipv6":
        host = address.rpartition(":")[0] if "]" in address else address
        return host.removeprefix("[").removesuffix("]")
    return ""


def _metadata(context: aio.ServicerContext) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


class GrpcServer:
    """Serves ``EventService/SendEvent`` with ``handle``; ``start`` binds, ``stop`` drains."""

    def __init__(
        self,
        handle: Handle,
        host: str,
        port: int,
        max_message_bytes: int,
        *,
        share_port: bool = False,
    ) -> None:
        self.handle = handle
        self.share_port = share_port  # intake workers share one port (SO_REUSEPORT)
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self._server: aio.Server | None = None

    async def _send_event(self, request: bytes, context: aio.ServicerContext) -> bytes:
        metadata = _metadata(context)
        try:
            return await self.handle(request, metadata, peer_ip(context.peer()))
        except Rejected as e:
            return raccoon.error_response_bytes(e)
        except Exception:
            log.exception("SendEvent from %s failed", context.peer())
            return raccoon.error_response_bytes(_INTERNAL)

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (``port`` 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("the gRPC server is already started")
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                # a port another process holds is an error, not a silent share (intake
                # workers share the port their parent reserved)
                ("grpc.so_reuseport", 1 if self.share_port else 0),
            ]
        )
        method = grpc.unary_unary_rpc_method_handler(self._send_event)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(raccoon.SERVICE_NAME, {"SendEvent": method}),)
        )
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as e:
            bound, problem = 0, f": {e}"
        else:
            problem = ""
        if not bound:
            await server.stop(None)  # never started; stopping it frees its resources now
            raise OSError(f"the gRPC server cannot listen on {address}{problem}")
        await server.start()
        self._server = server
        self.port = bound
        log.info("gRPC server listening on %s:%d", self.host, bound)
        return bound

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let calls in flight finish for up to ``grace`` seconds, then
        cancel what is left."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace)
        await server.wait_for_termination()
