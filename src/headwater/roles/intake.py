"""The intake assembled: the collector's servers with the webhook intake on them, in the main
process (``up``, ``collector``) or in one intake worker process forked by ``collector.workers``
(``run_worker``: a listening socket of its own, appending through its link to the process that
holds the log)."""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import signal
import socket
from typing import TYPE_CHECKING

from headwater.bus import Bus
from headwater.config.model import HeadwaterConfig
from headwater.roles.base import on_hangup, stop_on_signals

if TYPE_CHECKING:
    from headwater.collector.service import Collector
    from headwater.collector.sharing import Siblings
    from headwater.webhooks.state import StateStore

log = logging.getLogger(__name__)


def run_worker(
    config: HeadwaterConfig,
    sock: socket.socket,
    grpc_port: int | None,
    link: socket.socket,
    ring: mmap.mmap | None = None,
    siblings: Siblings | None = None,
) -> int:
    """Serve until SIGTERM (or until the main process goes away); the exit code. With
    ``collector.tls``, SIGHUP (passed on by the main process) reloads the certificate."""
    signal.set_wakeup_fd(-1)  # the main process's event loop is not ours
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if config.collector.tls is not None:  # a reload the main process passes on, until served
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(config, sock, grpc_port, link, ring, siblings))
    return 0


async def _serve(
    config: HeadwaterConfig,
    sock: socket.socket,
    grpc_port: int | None,
    link_sock: socket.socket,
    ring: mmap.mmap | None,
    siblings: Siblings | None,
) -> None:
    from headwater.bus import open_bus
    from headwater.collector.link import Link
    from headwater.collector.memory import pace_gc, trim_heap
    from headwater.collector.metrics import Metrics
    from headwater.collector.ring import Ring
    from headwater.collector.server import CollectorServer
    from headwater.collector.service import Collector
    from headwater.collector.sharing import CallSharing, SpareCpu

    stop = asyncio.Event()
    stop_on_signals(stop)
    metrics = Metrics()
    link = await Link.connect(link_sock, metrics.snapshot, Ring(ring) if ring is not None else None)
    embedded = config.bus.backend == "embedded"
    bus = None if embedded else await asyncio.to_thread(open_bus, config)  # its own producer
    bus_config = config.bus.embedded if embedded else config.bus.kafka
    collector = Collector(
        config.collector,
        bus,
        max_record_bytes=bus_config.max_record_bytes,
        link=link,
        metrics=metrics,
    )
    store = await open_webhooks(config, bus, collector)
    host, port = sock.getsockname()[:2]
    sharing = None
    mode = config.collector.share_grpc_calls
    if mode != "never" and siblings is not None and siblings.count > 1:
        spare = SpareCpu() if mode == "auto" else None
        sharing = CallSharing(collector.raccoon_grpc, metrics, siblings, spare)
    server = CollectorServer(collector, host, port, grpc_port, sock=sock, grpc_handle=sharing)
    try:
        await server.start()
        if sharing is not None:
            await sharing.start()
        if server.certificate is not None:
            on_hangup(server.reload_tls)
        gc.collect()
        gc.freeze()  # what start-up made stays out of the collector's walks
        pace_gc(asyncio.get_running_loop())  # see collector.memory
        trim_heap()
        link.ready()
        closed = asyncio.ensure_future(link.closed.wait())
        await asyncio.wait(
            [asyncio.ensure_future(stop.wait()), closed], return_when=asyncio.FIRST_COMPLETED
        )
        if closed.done():
            log.error("the process that holds the log has gone; this intake worker stops")
    finally:
        if sharing is not None:  # the sibling's calls first: its own stop may wait on them
            await sharing.close(config.collector.shutdown_grace_s)
        await server.stop()
        if sharing is not None:
            sharing.disconnect()
        link.close()
        if collector.webhooks is not None:
            await collector.webhooks.close()
        if store is not None:
            store.close()
        if bus is not None:
            await asyncio.to_thread(bus.close)


async def open_webhook_state(config: HeadwaterConfig, bus: Bus | None) -> StateStore:
    """The webhook state, and the topic the intake appends to (created on ``bus``, or, in an
    intake worker, by the process that holds the log)."""
    from headwater.webhooks.routing import Topics
    from headwater.webhooks.state import open_state

    store = await asyncio.to_thread(open_state, config)
    if bus is not None:
        await asyncio.to_thread(bus.create_topic, Topics(config.webhooks.topic_prefix).from_sender)
    return store


async def open_webhooks(
    config: HeadwaterConfig, bus: Bus | None, collector: Collector
) -> StateStore | None:
    """The webhook intake on the collector, when webhooks are configured: the state it
    dedups against and the topic it appends to."""
    if not (config.webhooks.sources or config.webhooks.receivers):
        return None
    from headwater.webhooks.intake import WebhookIntake
    from headwater.webhooks.routing import Topics

    store = await open_webhook_state(config, bus)
    if bus is None and collector.link is not None:
        await collector.link.partitions(Topics(config.webhooks.topic_prefix).from_sender)
    collector.webhooks = WebhookIntake(config.webhooks, store, collector.publisher)
    return store
