"""The ``headwater`` command line."""

from __future__ import annotations

from typing import Any

import click

from headwater import __version__
from headwater.cli.config_cmds import config_group
from headwater.cli.context import (
    cli_config,
    config_option,
    group_config_option,
    role_options,
    run_server_role,
)
from headwater.cli.contracts_cmds import contracts_group
from headwater.cli.failed_cmds import failed_group
from headwater.cli.log_cmds import log_group
from headwater.cli.logs import setup_logging
from headwater.cli.pipeline_cmds import pipeline_cmd
from headwater.cli.sql_cmds import sql_cmd
from headwater.cli.transport_cmds import transport_group
from headwater.cli.webhooks_cmds import webhooks_group
from headwater.errors import HeadwaterError
from headwater.roles.up import Listen, run

EXIT_ERROR = 1


class HeadwaterGroup(click.Group):
    """Prints headwater's errors as ``error: HW-...: message`` (exit 1), never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HeadwaterError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_ERROR)
        except BrokenPipeError:
            raise  # the reader went away (``| head``): click exits quietly
        except OSError as exc:
            if exc.filename is not None:
                click.echo(f"error: {exc.strerror or exc}: {exc.filename}", err=True)
            else:
                click.echo(f"error: {exc.strerror or exc}", err=True)
            ctx.exit(EXIT_ERROR)


@click.group(cls=HeadwaterGroup, context_settings={"help_option_names": ["-h", "--help"]})
@group_config_option
@click.version_option(__version__, prog_name="headwater")
def cli() -> None:
    """headwater: collect events, keep them on a durable log, deliver them without losing any.

    Every command reads the config file given with --config (on this group or on the command),
    else ./headwater.yaml if present, else the built-in defaults (data under ./data), with
    HEADWATER_* environment variables overriding settings (HEADWATER_BUS__BACKEND=kafka).
    """


cli.add_command(config_group)
cli.add_command(log_group)
cli.add_command(failed_group)
cli.add_command(contracts_group)
cli.add_command(pipeline_cmd)
cli.add_command(sql_cmd)
cli.add_command(webhooks_group)
cli.add_command(transport_group)


def _listen_options(f: Any) -> Any:
    f = click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Logs on stderr as text, or one JSON object per line.",
    )(f)
    f = click.option(
        "--grpc-port",
        type=click.IntRange(0, 65535),
        default=None,
        help="Port of the gRPC server [default: collector.grpc_port].",
    )(f)
    f = click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=None,
        help="HTTP/WebSocket port (0: any free port; the URL is printed) "
        "[default: collector.port, 8080].",
    )(f)
    return click.option(
        "--host", default=None, help="Address to listen on [default: collector.host, 127.0.0.1]."
    )(f)


@cli.command("up")
@_listen_options
@config_option
@click.pass_context
def up_cmd(
    ctx: click.Context, host: str | None, port: int | None, grpc_port: int | None, log_format: str
) -> None:
    """Run headwater on this machine until SIGTERM or Ctrl-C.

    Opens the configured bus (the embedded log under data_dir by default), runs the collector
    on it (GET /healthz answers 200 once it is ready) and the pipeline's destinations in Spark
    local mode (the DuckDB warehouse under data_dir by default). On SIGTERM or SIGINT it stops
    gracefully: in-flight requests finish, WebSockets close with 1001, the running micro-batches
    finish, and the bus is flushed and closed.
    """
    setup_logging("json" if log_format == "json" else "text")
    run(cli_config(ctx), Listen(host, port, grpc_port), echo=click.echo, with_pipeline=True)


@cli.command("collector")
@_listen_options
@config_option
@click.pass_context
def collector_cmd(
    ctx: click.Context, host: str | None, port: int | None, grpc_port: int | None, log_format: str
) -> None:
    """Run the collector alone (with bus: kafka, for scale-out) until SIGTERM or Ctrl-C."""
    setup_logging("json" if log_format == "json" else "text")
    run(cli_config(ctx), Listen(host, port, grpc_port), echo=click.echo)


@cli.command("console")
@role_options(
    "Address to listen on [default: console.host, 127.0.0.1].",
    "Its port (0: any free port; the URL is printed) [default: console.port, 8070].",
)
@click.pass_context
def console_cmd(ctx: click.Context, host: str | None, port: int | None, log_format: str) -> None:
    """Run the operator console alone until SIGTERM: the same pages `headwater up` serves,
    reading the log, the pipeline's status, the failed store and the webhook state where the
    other commands read them. Log in with an admin token (console.admin_token_hashes)."""
    from headwater.roles.console import serve_console

    run_server_role(ctx, serve_console, host, port, log_format)


@cli.command("hash-key")
@click.argument("key")
def hash_key_cmd(key: str) -> None:
    """Print the hashed form of a write key or an admin token, for
    collector.sources[].write_keys or console.admin_token_hashes."""
    from headwater.collector.auth import hash_key

    click.echo(hash_key(key))


def main() -> None:
    """Entry point of the ``headwater`` command."""
    cli(prog_name="headwater")


if __name__ == "__main__":
    main()
