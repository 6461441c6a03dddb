"""``headwater pipeline``: run the destinations' Spark queries."""

from __future__ import annotations

import signal
import threading

import click

from headwater.ops.context import cli_config, config_option
from headwater.ops.logs import setup_logging


@click.command("pipeline")
@click.option("--once", is_flag=True, help="Catch every destination up once, then exit.")
@click.option(
    "--destination", "-d", "destinations", multiple=True, help="Only this one (repeatable)."
)
@click.option("--master", default=None, help="Spark master URL [default: pipeline.spark.master].")
@click.option(
    "--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@config_option
@click.pass_context
def pipeline_cmd(
    ctx: click.Context,
    once: bool,
    destinations: tuple[str, ...],
    master: str | None,
    log_format: str,
) -> None:
    """Run the configured destinations' queries (Spark local mode by default) until SIGTERM or
    Ctrl-C; a micro-batch in progress finishes first."""
    setup_logging(log_format)
    config = cli_config(ctx)
    if master is not None:
        spark_cfg = config.pipeline.spark.model_copy(update={"master": master})
        config = config.model_copy(
            update={"pipeline": config.pipeline.model_copy(update={"spark": spark_cfg})}
        )
    from headwater.pipeline.runner import Pipeline
    from headwater.pipeline.spark import spark_session

    click.echo(f"headwater: starting Spark ({config.pipeline.spark.master})")
    spark = spark_session(config.pipeline.spark)
    pipeline = Pipeline(config, spark, list(destinations) or None, echo=click.echo)
    if once:
        pipeline.run_once()
        for q in pipeline.queries:
            q.writer.close()
        click.echo("headwater: every destination has caught up")
        return
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pipeline.start()
    click.echo("headwater: pipeline running (stop with Ctrl-C or SIGTERM)")
    while not stop.wait(1.0):
        broken = pipeline.failed()
        if broken:
            for dest, exc in broken:
                click.echo(f"error: destination {dest} stopped: {exc}", err=True)
            break
    click.echo("headwater: stopping")
    pipeline.stop()
    click.echo("headwater: stopped")
    if pipeline.failed():
        ctx.exit(1)
