"""How the operator commands print: tables, JSON lines, configuration with secrets hidden
(records are rendered by ``headwater.ops.records``, which the console shares)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import click

OutputFormat = Literal["text", "json"]

_SECRET_KEY = re.compile(r"password|secret|token|credential|\.pem$|oauthbearer\.config", re.I)


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


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with secrets (passwords, tokens, keys) replaced by ``***``."""
    if isinstance(value, Mapping):
        return {
            k: "***" if isinstance(k, str) and _SECRET_KEY.search(k) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
