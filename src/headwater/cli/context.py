"""What every command shares: ``--config``, ``--format``, loading the config, opening the bus;
and what the server roles' commands share: their options, and running the role."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from headwater.bus import Bus, open_bus
from headwater.config.loader import load_config
from headwater.config.model import HeadwaterConfig

if TYPE_CHECKING:
    from headwater.roles.base import Serve

F = TypeVar("F", bound=Callable[..., Any])

CONFIG_ENV = "HEADWATER_CONFIG"
_CONFIG_KEY = "headwater.config_path"
_CONFIG_HELP = "Config file (default: ./headwater.yaml if present, else the built-in defaults)."


def _store_config(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # ctx.meta is shared by the whole command chain: the innermost --config given wins.
    if value is not None:
        ctx.meta[_CONFIG_KEY] = value


def _config_option(**extra: object) -> Callable[[F], F]:
    return click.option(  # type: ignore[return-value]
        "--config",
        "-c",
        type=click.Path(dir_okay=False, path_type=Path),
        expose_value=False,
        callback=_store_config,
        help=_CONFIG_HELP,
        **extra,  # type: ignore[arg-type]
    )


def group_config_option(f: F) -> F:
    """``--config`` on the ``headwater`` group; also read from ``HEADWATER_CONFIG``."""
    return _config_option(envvar=CONFIG_ENV, show_envvar=True)(f)


def config_option(f: F) -> F:
    """``--config`` on a command; overrides the group's."""
    return _config_option()(f)


def format_option(f: F) -> F:
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="text for people; json for scripts.",
    )(f)


def role_options(host_help: str, port_help: str) -> Callable[[F], F]:
    """A server role's ``--host``, ``--port``, ``--log-format`` and ``--config``."""

    def decorate(f: F) -> F:
        f = config_option(f)
        f = click.option("--log-format", type=click.Choice(["text", "json"]), default="text")(f)
        f = click.option("--port", type=click.IntRange(0, 65535), default=None, help=port_help)(f)
        return click.option("--host", default=None, help=host_help)(f)

    return decorate


def run_server_role(
    ctx: click.Context, serve: Serve, host: str | None, port: int | None, log_format: str
) -> None:
    """Log as ``--log-format`` says, and run the role ``serve`` serves until it stops."""
    from headwater.cli.logs import setup_logging
    from headwater.roles.base import run_role

    setup_logging("json" if log_format == "json" else "text")
    run_role(serve, cli_config(ctx), host, port, click.echo)


def config_path(ctx: click.Context) -> Path | None:
    """The ``--config`` given (on the group or the command), if any."""
    return cast(Path | None, ctx.meta.get(_CONFIG_KEY))


def cli_config(ctx: click.Context) -> HeadwaterConfig:
    """Load the config the command line names (raises ``ConfigError``)."""
    return load_config(config_path(ctx))


@contextmanager
def opened_bus(
    ctx: click.Context, *, read_only: bool, config: HeadwaterConfig | None = None
) -> Iterator[tuple[HeadwaterConfig, Bus]]:
    """The configured bus, closed (flushed, offsets persisted) on the way out."""
    if config is None:
        config = cli_config(ctx)
    bus = open_bus(config, read_only=read_only)
    try:
        yield config, bus
    finally:
        bus.close()
