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
import time
from pathlib import Path
from typing import Any

import click

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError, TransientError
from headwater.ops.context import cli_config, config_option
from headwater.ops.output import table

LOCK_WAIT_S = 10.0
"""How long to keep trying while the writer holds the file (a batch's write takes well under)."""


class WarehouseBusy(TransientError):
    """The warehouse file stayed locked by a writer for the whole wait."""

    code = "HW-SQL-001"


def warehouse_file(config: HeadwaterConfig, destination: str | None) -> Path:
    """The DuckDB file of ``destination`` (default: the first DuckDB destination)."""
    duck = [d for d in config.pipeline.destinations if d.type == "duckdb"]
    if destination is not None:
        duck = [d for d in duck if d.id == destination]
        if not duck:
            raise ConfigError(f"no DuckDB destination named {destination} in pipeline.destinations")
    if duck and duck[0].path is not None:
        return Path(duck[0].path)
    return config.warehouse_path()


def query(
    path: Path, sql: str, wait_s: float | None = None
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run ``sql`` on a read-only connection held only for the query; (column names, rows)."""
    import duckdb

    wait_s = LOCK_WAIT_S if wait_s is None else wait_s

    if not path.exists():
        raise FileNotFoundError(2, "no warehouse yet (no batch has been written)", str(path))
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            con = duckdb.connect(str(path), read_only=True)
            break
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower():
                raise
            if time.monotonic() >= deadline:
                raise WarehouseBusy(
                    f"{path} stayed locked by another process for {wait_s:g} s: {exc}"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    try:
        cursor = con.execute(sql)
        columns = [c[0] for c in cursor.description or []]
        return columns, cursor.fetchall()
    finally:
        con.close()


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
