"""Running headwater's server roles: ``headwater up`` (everything on one machine) and
``headwater collector`` (the collector alone, for scale-out with ``bus: kafka``).

Both open the configured bus, serve the collector (``/healthz`` answers 200 once it is ready;
``/readyz`` also names, under ``up``, each destination that is failing) and run until
SIGTERM or SIGINT; then they stop gracefully: new requests are refused, in-flight ones finish,
WebSockets close with 1001, and the bus is flushed and closed (persisting offsets). With
``collector.tls`` or ``console.tls``, SIGHUP reloads the certificates; open connections stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headwater.bus import Bus, open_bus
from headwater.config.model import HeadwaterConfig
from headwater.ops.masking import redact_dsn
from headwater.pipeline.config import DestinationConfig
from headwater.roles.base import describe_bus, on_hangup, remove_signals, stop_on_signals
from headwater.roles.intake import open_webhook_state, open_webhooks, run_worker

if TYPE_CHECKING:
    from headwater.collector.host import LogHost
    from headwater.collector.metrics import Metrics
    from headwater.collector.server import CollectorServer
    from headwater.collector.service import Collector
    from headwater.collector.tls import ServerCertificate
    from headwater.collector.workers import IntakeWorkers
    from headwater.pipeline.runner import Pipeline
    from headwater.webhooks.state import StateStore


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listen:
    """Where the servers listen (None: as configured under ``collector``)."""

    host: str | None = None
    port: int | None = None
    grpc_port: int | None = None


async def serve(
    config: HeadwaterConfig,
    listen: Listen = Listen(),
    echo: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
    with_pipeline: bool = False,
    with_webhooks: bool | None = None,
    workers: IntakeWorkers | None = None,
) -> None:
    """Run the collector on the configured bus (and, ``with_pipeline``, the pipeline's
    destinations; ``with_webhooks``, by default with the pipeline, the webhook workers) until
    ``stop`` is set (by SIGTERM/SIGINT when this runs in the main thread). With ``workers``
    (already forked) the intake runs in them and this process holds the log for them."""
    from headwater.collector.tls import server_certificate

    stop = stop or asyncio.Event()
    console_tls = (
        server_certificate(config.console.tls, "console.tls") if _console(config) else None
    )
    installed = stop_on_signals(stop)
    bus: Bus | None = None
    front: _Front | None = None
    if config.collector.tls is not None or console_tls is not None:
        installed += on_hangup(lambda: _reload_tls(front, console_tls))
    pipeline: Pipeline | None = None
    store: StateStore | None = None
    webhook_workers: asyncio.Task[None] | None = None
    readers: asyncio.Task[None] | None = None
    workers_stop = asyncio.Event()
    sites = contextlib.AsyncExitStack()
    try:
        if config.bus.backend == "embedded":
            config.data_dir.mkdir(parents=True, exist_ok=True)
        bus = await asyncio.to_thread(open_bus, config)
        echo(f"headwater: bus open: {describe_bus(config)}")
        front = await (
            _InProcess.start(config, bus, listen)
            if workers is None
            else _Workers.start(config, bus, workers)
        )
        store = front.store
        ws = front.url.replace("http", "ws", 1)
        if workers is not None:
            echo(f"headwater: intake in {workers.count} worker processes on one port")
        echo(f"headwater: health at {front.url}/healthz")
        echo(f"headwater: readiness (every destination writing) at {front.url}/readyz")
        echo(
            f"headwater: events: {ws}/api/v1/events (Raccoon WebSocket), POST {front.url}"
            "/api/v1/events, /v1/batch (Segment), /api/s/{type} (Jitsu), /v1/logs (OTLP)"
        )
        if front.grpc_port is not None:
            tls = " (TLS, ALPN h2)" if config.collector.tls is not None else ""
            echo(f"headwater: gRPC EventService on {front.host}:{front.grpc_port}{tls}")
        if store is not None:
            echo(f"headwater: webhooks: POST {front.url}/webhooks/{{source_id}}")
        if with_webhooks is None:
            with_webhooks = with_pipeline
        if with_webhooks and store is not None and config.webhooks.receivers:
            from headwater.webhooks.worker import Workers

            runner = Workers(config.webhooks, bus, store)
            webhook_workers = asyncio.create_task(runner.run(workers_stop), name="webhooks")
            webhook_workers.add_done_callback(lambda _: stop.set())  # they end early on errors
            names = ", ".join(r.name for r in config.webhooks.receivers)
            echo(f"headwater: webhook workers running (receivers: {names})")
        if with_pipeline and config.transport.readers:
            from headwater.transport.runner import Readers

            transport = Readers(config, bus)
            readers = asyncio.create_task(transport.run(workers_stop), name="transport")
            echo(f"headwater: transport readers running ({', '.join(transport.names)})")
        if with_pipeline:
            from headwater.delivery.metrics import METRICS

            pipeline = await asyncio.to_thread(start_pipeline, config, echo)
            front.set_readiness(pipeline_readiness(pipeline))
            front.metrics.also.append(METRICS.registry)
        if _console(config):
            from headwater.console.app import Console
            from headwater.console.site import console_site

            console = Console(config, bus, front.metrics, pipeline, store)  # type: ignore[arg-type]
            url = await sites.enter_async_context(
                console_site(console, config.console.host, config.console.port, console_tls)
            )
            echo(f"headwater: console at {url}/")
        else:
            echo("headwater: no console (console.admin_token_hashes is empty)")
        echo("headwater: ready (stop with Ctrl-C or SIGTERM)")
        await stop.wait()
        echo("headwater: stopping")
    finally:
        await sites.aclose()
        if front is not None:
            await front.stop()
        elif workers is not None:
            await workers.stop(config.collector.shutdown_grace_s)
        for task, what in ((webhook_workers, "webhook workers"), (readers, "transport readers")):
            if task is not None:
                workers_stop.set()
                try:
                    await task
                except Exception as e:
                    log.error("the %s failed: %r", what, e)
        if store is not None:
            store.close()
        if pipeline is not None:
            await asyncio.to_thread(pipeline.stop)
        if bus is not None:
            await asyncio.to_thread(bus.close)
        remove_signals(installed)
    echo("headwater: stopped")


def _console(config: HeadwaterConfig) -> bool:
    """Whether ``up`` serves the console (an admin token can log in)."""
    return bool(config.console.admin_token_hashes)


def _reload_tls(front: _Front | None, console: ServerCertificate | None) -> None:
    """SIGHUP: the intake's and the console's certificates read again."""
    if front is not None:
        front.reload_tls()
    if console is not None:
        console.reload()


class _Front:
    """Where the intake runs: in this process, or in forked workers."""

    url: str
    host: str
    grpc_port: int | None
    store: StateStore | None = None
    metrics: Metrics | LogHost

    def set_readiness(self, readiness: Callable[[], dict[str, str]]) -> None:
        raise NotImplementedError

    def reload_tls(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError


class _InProcess(_Front):
    def __init__(self, collector: Collector, server: CollectorServer) -> None:
        self.collector = collector
        self.server = server
        self.metrics = collector.metrics

    @classmethod
    async def start(cls, config: HeadwaterConfig, bus: Bus, listen: Listen) -> _InProcess:
        from headwater.collector.server import CollectorServer
        from headwater.collector.service import Collector

        cfg = config.collector
        embedded = config.bus.backend == "embedded"
        collector = Collector(
            cfg,
            bus,
            max_record_bytes=(
                config.bus.embedded if embedded else config.bus.kafka
            ).max_record_bytes,
            log_dir=config.log_dir() if embedded else None,
        )
        server = CollectorServer(
            collector,
            listen.host or cfg.host,
            cfg.port if listen.port is None else listen.port,
            cfg.grpc_port if listen.grpc_port is None else listen.grpc_port,
        )
        front = cls(collector, server)
        try:
            front.store = await open_webhooks(config, bus, collector)
            await server.start()
        except BaseException:
            await front.stop()
            raise
        front.url, front.host, front.grpc_port = server.url, server.host, server.grpc_port
        return front

    def set_readiness(self, readiness: Callable[[], dict[str, str]]) -> None:
        self.collector.readiness = readiness

    def reload_tls(self) -> None:
        self.server.reload_tls()

    async def stop(self) -> None:
        await self.server.stop()
        if self.collector.webhooks is not None:
            await self.collector.webhooks.close()


class _Workers(_Front):
    def __init__(self, config: HeadwaterConfig, workers: IntakeWorkers, host: LogHost) -> None:
        self.config = config
        self.workers = workers
        self.log_host = host
        self.metrics = host
        self.url, self.host, self.grpc_port = workers.url, workers.host, workers.grpc_port
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, config: HeadwaterConfig, bus: Bus, workers: IntakeWorkers) -> _Workers:
        from headwater.collector.admission import Admission
        from headwater.collector.host import LogHost
        from headwater.collector.limits import Connections
        from headwater.collector.memory import trim_heap

        cfg = config.collector
        host = LogHost(
            bus,
            Connections(cfg.raccoon.max_connections, cfg.raccoon.max_connections_per_identity),
        )
        front = cls(config, workers, host)
        embedded = config.bus.backend == "embedded"
        admission = Admission(
            bus,
            cfg.admission,
            config.log_dir() if embedded else None,
            on_change=lambda refusal: host.tell({"refusal": refusal}),
        )
        try:
            if config.webhooks.sources or config.webhooks.receivers:
                front.store = await open_webhook_state(config, bus)
            await workers.serve(host)
            trim_heap()
        except BaseException:
            await front.stop()
            raise
        front._tasks = [
            asyncio.create_task(admission.run(), name="admission"),
            asyncio.create_task(workers.watch(host), name="intake-workers"),
        ]
        return front

    def set_readiness(self, readiness: Callable[[], dict[str, str]]) -> None:
        self.log_host.readiness = readiness

    def reload_tls(self) -> None:
        self.workers.send(signal.SIGHUP)  # each worker reloads its own contexts

    async def stop(self) -> None:
        await self.workers.stop(self.config.collector.shutdown_grace_s)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await asyncio.to_thread(self.log_host.close)


def describe_destination(config: HeadwaterConfig, dest: DestinationConfig) -> str:
    """Where a destination's rows land, for people."""
    if dest.type == "duckdb":
        where = f"DuckDB at {dest.path or config.warehouse_path()}"
    elif dest.dsn:
        where = f"{dest.type} at {redact_dsn(dest.dsn)}"
    else:
        where = f"{dest.type} under {dest.path or config.data_dir / dest.type / dest.id}"
    return f"{where}, table {dest.table_name_template!r}"


def start_pipeline(config: HeadwaterConfig, echo: Callable[[str], None]) -> Pipeline:
    """Start Spark (local mode by default) and every destination's query."""
    from headwater.pipeline.runner import Pipeline
    from headwater.pipeline.spark import spark_session

    echo(f"headwater: starting Spark ({config.pipeline.spark.master})")
    spark = spark_session(config.pipeline.spark, kafka=config.bus.backend == "kafka")
    pipeline = Pipeline(config, spark, echo=echo)
    pipeline.start()
    for dest in config.pipeline.destinations:
        echo(f"headwater: rows of {dest.id}: {describe_destination(config, dest)}")
    return pipeline


def pipeline_readiness(pipeline: Pipeline) -> Callable[[], dict[str, str]]:
    """For ``/readyz``: the destinations that are failing and why (empty: all healthy)."""
    from headwater.pipeline.status import unhealthy

    return lambda: unhealthy(pipeline.status.all())


def run(
    config: HeadwaterConfig,
    listen: Listen,
    echo: Callable[[str], None] = print,
    *,
    with_pipeline: bool = False,
    with_webhooks: bool | None = None,
) -> None:
    """Run ``serve`` to completion on uvloop where it is installed, with the intake in
    ``collector.workers`` processes forked first when there are more than one."""
    from headwater.collector.memory import paced
    from headwater.collector.tls import server_certificate
    from headwater.collector.workers import IntakeWorkers, worker_count

    # read and checked before workers fork: a bad file is one error naming it, not theirs
    server_certificate(config.collector.tls, "collector.tls")
    workers = None
    count = worker_count(config.collector)
    if count > 1:
        cfg = config.collector
        workers = IntakeWorkers(
            config,
            listen.host or cfg.host,
            cfg.port if listen.port is None else listen.port,
            cfg.grpc_port if listen.grpc_port is None else listen.grpc_port,
            count,
            run_worker,
        )
        workers.start()
    main = paced(
        serve(
            config,
            listen,
            echo,
            with_pipeline=with_pipeline,
            with_webhooks=with_webhooks,
            workers=workers,
        )
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio's loop also works
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
