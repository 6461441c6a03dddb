"""Reading the embedded DuckDB warehouse while headwater writes it (``headwater sql``, the
console's tables).

DuckDB lets one process hold a file for writing, or any number hold it read-only, never both: a
shell or BI tool that keeps ``data/warehouse.duckdb`` open stops every write until it lets go.
``query`` opens the file read-only only for the duration of one query (retrying briefly while
the writer holds it between batches) and closes it, so the writer waits at most as long as the
query runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError, TransientError

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
