"""``headwater sql "select ..."``: a query on the embedded DuckDB warehouse that cannot block
the writer.

DuckDB lets one process hold a file for writing, or any number hold it read-only, never both: a
shell or BI tool that keeps ``data/warehouse.duckdb`` open stops every write until it lets go.
This command opens the file read-only only for the duration of one query (retrying briefly while
the writer holds it between batches), prints the rows and closes it, so the writer waits at most
as long as the query runs.
"""

from __future__ import annotations

import json
from typing import Any

import click

from headwater.cli.context import cli_config, config_option
from headwater.cli.output import table
from headwater.ops.warehouse import query, warehouse_file


@click.command("sql")
@click.argument("sql")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table for people; json (one object per row, one per line) for scripts.",
)
@click.option("--destination", "-d", default=None, help="Which DuckDB destination's file.")
@config_option
@click.pass_context
def sql_cmd(ctx: click.Context, sql: str, fmt: str, destination: str | None) -> None:
    """Answer a query on the embedded DuckDB warehouse without blocking the writer."""
    path = warehouse_file(cli_config(ctx), destination)
    columns, rows = query(path, sql)
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(dict(zip(columns, row, strict=True)), default=_json_value))
        return
    click.echo(table(columns, rows))


def _json_value(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
