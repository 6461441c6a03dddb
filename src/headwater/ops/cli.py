"""The ``headwater`` command line."""

from __future__ import annotations

from typing import Any

import click

from headwater import __version__
from headwater.errors import HeadwaterError
from headwater.ops.config_cmds import config_group
from headwater.ops.context import cli_config, config_option, group_config_option
from headwater.ops.log_cmds import log_group
from headwater.ops.up import DEFAULT_HOST, DEFAULT_PORT, run_up

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


@cli.command("up")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port; the URL is printed).",
)
@config_option
@click.pass_context
def up_cmd(ctx: click.Context, host: str, port: int) -> None:
    """Run headwater on this machine until SIGTERM or Ctrl-C.

    Opens the configured bus (the embedded log under data_dir by default) and serves
    GET /healthz (200 "ok" once the bus is open). On SIGTERM or SIGINT it closes the bus, which
    flushes it and persists the writers' offsets, and exits 0.
    """
    config = cli_config(ctx)
    run_up(config, host, port, echo=click.echo)


def main() -> None:
    """Entry point of the ``headwater`` command."""
    cli(prog_name="headwater")


if __name__ == "__main__":
    main()
