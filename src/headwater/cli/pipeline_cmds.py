"""``headwater pipeline``: run the destinations' Spark queries; ``headwater pipeline status``:
how each destination's writer is doing, as the running pipeline last wrote it;
``headwater pipeline pause``/``resume``: hold a destination's query and start it again;
``headwater pipeline optimize``/``vacuum``: maintenance of a Delta destination's tables."""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from headwater.cli.context import cli_config, config_option, format_option
from headwater.cli.logs import setup_logging
from headwater.cli.output import echo_json, table

if TYPE_CHECKING:
    from headwater.pipeline.status import DestinationStatus, Pause


@click.group("pipeline", invoke_without_command=True)
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
    Ctrl-C; a micro-batch in progress finishes first. A destination that fails is retried with
    backoff until it works again (see ``headwater pipeline status``)."""
    if ctx.invoked_subcommand is not None:
        return
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
    spark = spark_session(config.pipeline.spark, kafka=config.bus.backend == "kafka")
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


@pipeline_cmd.command("status")
@format_option
@config_option
@click.pass_context
def status_cmd(ctx: click.Context, fmt: str) -> None:
    """Each destination's writer: state, last successful batch, attempts, last error; and
    the destinations paused (with ``headwater pipeline pause``)."""
    from headwater.pipeline.status import as_json, paused, read_status, status_path

    config = cli_config(ctx)
    status = read_status(config)
    pauses = paused(config)
    if status is None:
        if fmt == "json":
            click.echo("[]")
        else:
            click.echo(f"no pipeline status yet ({status_path(config)} does not exist)")
            for dest, p in sorted(pauses.items()):
                click.echo(f"{dest}: paused {_pause_text(p)}")
        return
    now = time.time()
    if fmt == "json":
        click.echo(as_json(status.destinations, now, pauses))
        return
    rows = []
    for s in status.destinations:
        since = s.seconds_since_success(now)
        error = f"{s.last_error_code}: {s.last_error}" if s.last_error_code else s.last_error
        rows.append(
            (
                s.destination,
                s.state,
                _when(s.last_success_at),
                None if since is None else f"{since:.0f}",
                s.attempts,
                s.consecutive_failures,
                _batch_text(s),
                _pause_text(pauses[s.destination]) if s.destination in pauses else None,
                error,
            )
        )
    headers = ("destination", "state", "last success", "seconds since", "attempts", "failures")
    click.echo(table((*headers, "last batch", "paused", "last error"), rows))
    if not _alive(status.pid):
        click.echo(f"(written by process {status.pid}, which is no longer running)")


def _batch_text(s: DestinationStatus) -> str | None:
    b = s.last_batch
    if b is None:
        return None
    return f"#{b.batch_id}: {b.written} rows in {b.duration_s:.2f} s"


def _pause_text(p: Pause) -> str:
    return f"since {_when(p.at)} by {p.by}"


def _when(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pipeline_cmd.command("pause")
@click.argument("destination")
@click.option("--by", default=None, help="Who pauses it, shown in the status [default: user].")
@config_option
@click.pass_context
def pause_cmd(ctx: click.Context, destination: str, by: str | None) -> None:
    """Pause DESTINATION: the running pipeline (any process on this machine) stops its query
    after the batch in progress, within about a second, and starts it again from where it
    stopped on `headwater pipeline resume`. A pipeline started later keeps it paused."""
    from headwater.pipeline.status import pause, paused

    config = cli_config(ctx)
    if pause(config, destination, by or _user()):
        click.echo(f"destination {destination}: paused")
        return
    earlier = paused(config).get(destination)
    since = f" {_pause_text(earlier)}" if earlier else ""
    click.echo(f"destination {destination}: paused already{since}")


@pipeline_cmd.command("resume")
@click.argument("destination")
@config_option
@click.pass_context
def resume_cmd(ctx: click.Context, destination: str) -> None:
    """Resume DESTINATION: the running pipeline starts its query again from its checkpoint
    (every event that arrived meanwhile is written, once)."""
    from headwater.pipeline.status import resume

    if resume(cli_config(ctx), destination):
        click.echo(f"destination {destination}: resumed")
    else:
        click.echo(f"destination {destination}: not paused")


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name, no passwd entry (a container)
        return "headwater pipeline pause"


@pipeline_cmd.command("step")
@click.option("--destination", "-d", "destination", required=True, help="A mirror destination.")
@click.option(
    "--count", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="Messages."
)
@format_option
@config_option
@click.pass_context
def step_cmd(ctx: click.Context, destination: str, count: int, fmt: str) -> None:
    """Apply a mirror destination's next COUNT messages one at a time, from its own offsets
    (for on_error: stop). Stops at a message that fails, with its error (exit 1): fix the
    cause, or mark it done with `headwater log set-offset --group DESTINATION`."""
    from dataclasses import asdict

    from headwater.transport.step import Stepped, step

    def show(s: Stepped) -> None:
        if fmt == "json":
            echo_json(asdict(s))
            return
        what = f"{s.topic}[{s.partition}]@{s.offset} {s.op} {s.namespace}".rstrip()
        click.echo(f"{what}: {s.outcome}{': ' + s.error if s.error else ''}")

    if not step(cli_config(ctx), destination, count, show):
        ctx.exit(1)


@contextlib.contextmanager
def _delta_tables(
    ctx: click.Context, destination: str, tables: tuple[str, ...]
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The configured Delta destination ``destination``, opened (a clear error otherwise), and
    its tables ``tables`` (all of them when none is named), loaded."""
    from headwater.destinations import open_destination

    config = cli_config(ctx)
    dest = next((d for d in config.pipeline.destinations if d.id == destination), None)
    if dest is None:
        known = ", ".join(d.id for d in config.pipeline.destinations) or "none"
        raise click.BadParameter(f"no destination {destination!r} (configured: {known})")
    if dest.type != "delta":
        raise click.BadParameter(f"destination {destination!r} is {dest.type}, not delta")
    d = open_destination(dest, config.data_dir)
    try:
        yield d, {t: d.delta_table(t) for t in tables or d.tables()}
    finally:
        d.close()


def _maintained(results: list[Any], fmt: str) -> None:
    if fmt == "json":
        for r in results:
            echo_json(r.to_json())
        return
    rows = [(r.table, r.action, r.files_added, r.files_removed, r.version) for r in results]
    click.echo(table(("table", "action", "files added", "files removed", "version"), rows))


@pipeline_cmd.command("optimize")
@click.argument("destination")
@click.option("--table", "-t", "tables", multiple=True, help="Only this table (repeatable).")
@click.option(
    "--zorder",
    "zorder",
    multiple=True,
    help="Z-order by this column (repeatable) [default: the destination's options.zorder_by].",
)
@format_option
@config_option
@click.pass_context
def optimize_cmd(
    ctx: click.Context, destination: str, tables: tuple[str, ...], zorder: tuple[str, ...], fmt: str
) -> None:
    """Compact the small files of DESTINATION's Delta tables into files of about
    options.target_file_mb (a version of its own per table; the rows do not change), optionally
    Z-ordered. Safe while the pipeline writes."""
    from headwater.destinations.delta.maintenance import optimize

    with _delta_tables(ctx, destination, tables) as (d, loaded):
        _maintained(optimize(loaded, d.options, list(zorder) or None), fmt)


@pipeline_cmd.command("vacuum")
@click.argument("destination")
@click.option("--table", "-t", "tables", multiple=True, help="Only this table (repeatable).")
@click.option(
    "--retention-hours",
    type=click.IntRange(min=0),
    default=168,
    show_default=True,
    help="Keep every file a version this recent needs (time travel and slow readers).",
)
@click.option("--dry-run", is_flag=True, help="Count the files, delete nothing.")
@format_option
@config_option
@click.pass_context
def vacuum_cmd(
    ctx: click.Context,
    destination: str,
    tables: tuple[str, ...],
    retention_hours: int,
    dry_run: bool,
    fmt: str,
) -> None:
    """Delete the files of DESTINATION's Delta tables that no version within the retention
    needs: those compaction replaced, and files never committed (a crashed task's)."""
    from headwater.destinations.delta.maintenance import vacuum

    with _delta_tables(ctx, destination, tables) as (_, loaded):
        _maintained(vacuum(loaded, retention_hours, dry_run), fmt)
