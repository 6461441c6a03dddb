"""How the operator commands print: tables and JSON lines (records are rendered by
``headwater.ops.records``, secrets masked by ``headwater.ops.masking``, both shared with the
console)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import click


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; ``None`` shows as ``-``."""
    cells = [[str(h) for h in headers]]
    cells += [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def echo_json(value: object) -> None:
    """Print ``value`` as one line of JSON."""
    click.echo(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
