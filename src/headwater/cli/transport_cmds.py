"""``headwater transport``: the transport readers as a server role, and ``status``: per reader
its position (LSN, file, offset), lag and phase per namespace."""

from __future__ import annotations

import time

import click

from headwater.cli.context import (
    cli_config,
    config_option,
    format_option,
    role_options,
    run_server_role,
)
from headwater.cli.output import echo_json, table


@click.group("transport", invoke_without_command=True)
@role_options(
    "Where /healthz listens [default: transport.host].",
    "Its port (0: any free port) [default: transport.port, 8092].",
)
@click.pass_context
def transport_group(
    ctx: click.Context, host: str | None, port: int | None, log_format: str
) -> None:
    """The transport readers (PostgreSQL CDC, files, Kafka). Without a subcommand: run every
    reader of transport.readers until SIGTERM, with /healthz on --host/--port. On the embedded
    log, `headwater up` runs them itself."""
    if ctx.invoked_subcommand is not None:
        return
    from headwater.roles.transport import serve_transport

    run_server_role(ctx, serve_transport, host, port, log_format)


@transport_group.command("status")
@format_option
@config_option
@click.pass_context
def status_cmd(ctx: click.Context, fmt: str) -> None:
    """Per reader: running or not, its position, lag, last error; per namespace its phase
    (copy, sync) and rows."""
    from headwater.transport.reader import read_status

    config = cli_config(ctx)
    rows = []
    for reader in config.transport.readers:
        status = read_status(config.transport_dir(reader.id))
        if fmt == "json":
            echo_json({"id": reader.id, "type": reader.type, **status})
            continue
        updated = status.get("updated_at")
        age = f"{time.time() - updated:.0f}s ago" if updated else "never ran"
        state = "running" if status.get("running") else "stopped"
        lag = status.get("lag_bytes")
        rows.append(
            [
                reader.id,
                reader.type,
                state if updated else "-",
                status.get("position"),
                None if lag is None else f"{lag} B",
                status.get("changes"),
                age,
                status.get("error"),
            ]
        )
        for namespace, entry in sorted(status.get("namespaces", {}).items()):
            count = entry.get("rows", entry.get("lines"))
            rows.append(
                [
                    "",
                    f"  {namespace}",
                    entry.get("phase"),
                    entry.get("position"),
                    entry.get("lag"),
                    count,
                    "",
                    None,
                ]
            )
    if fmt == "text":
        if not config.transport.readers:
            click.echo("no readers: transport.readers is empty")
            return
        headers = ["READER", "TYPE", "STATE", "POSITION", "LAG", "ROWS", "UPDATED", "ERROR"]
        click.echo(table(headers, rows))
