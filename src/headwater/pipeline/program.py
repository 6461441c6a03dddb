"""A micro-batch's program: what the driver plans (``headwater.pipeline.plan``) and every Spark
task runs (``headwater.pipeline.task``), as plain data that travels as JSON in the sink's
options.

- ``sql``: the steps as one DuckDB query over the task's input relation (``columns.INPUT``);
  ``guarded_sql`` the same query checking every event's JSON first (run on a chunk where the
  usual one met malformed JSON);
- ``learn_sql``: over novel rows only, per routed table, which planned fields had a value
  (``learn_fields``, in order);
- ``headers``: the record headers the query reads; ``functions``: the lookup functions it calls,
  ``settings`` what the enrichments need (``enrichments.register``);
  ``protobuf``: event type -> message type, decoded before the query;
- ``shaping``: the contracts and Python functions run over the input before the query
  (``headwater.pipeline.shaping``), empty when there are none;
- ``tables``: per target table, its ``[column, output column]`` pairs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

LEARN_ROUTED = "routed"
CHUNK_ROWS = 8_192  # rows per output batch and staged part of a task's query (its memory)

# what a task's run does with its rows
WRITE = "write"  # stage the tables' rows, fail the failed ones (not novel)
LEARN = "learn"  # only the summary
FAIL_NOVEL = "fail_novel"  # fail the novel rows a step failed (once learning has ended)
FAIL_ALL = "fail_all"  # fail every routed row (the destination refused the batch)
MODES = (WRITE, LEARN, FAIL_NOVEL, FAIL_ALL)


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of ``MODES``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")


@dataclass(frozen=True)
class Program:
    sql: str
    guarded_sql: str
    learn_sql: str
    learn_fields: list[list[str]]
    headers: list[str]
    functions: list[str] = field(default_factory=list)
    geoip_database: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    shaping: str = ""  # JSON: contracts and Python functions run before the query (shaping.spec)
    protobuf: dict[str, dict[str, str]] = field(default_factory=dict)
    tables: dict[str, list[list[str]]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Program:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)
