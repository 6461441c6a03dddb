"""Step 4, routing: which events a destination takes, and into which table.

The destination's topic filter is applied by its source (topics or topic_pattern). Here the
table name template is evaluated per event: the name it gives is the event's table; an empty
name skips the event for this destination; an evaluation error fails it (``HW-PIPE-201``, with
the template's reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from headwater.pipeline import sql
from headwater.pipeline.columns import failure
from headwater.pipeline.fields import Fields
from headwater.pipeline.steps.template import compile_template

STEP = "route"
TEMPLATE_FAILED = "HW-PIPE-201"


@dataclass(frozen=True)
class Route:
    name: str  # SQL: the table routing names (NULL where it failed)
    error: str  # SQL: an ``_hw_error`` value, NULL where routing worked
    headers: tuple[str, ...]  # record headers the template reads


def route(fields: Fields, table_name_template: str) -> Route:
    compiled = compile_template(table_name_template, fields)
    error = sql.NULL
    if compiled.error != sql.NULL:
        failed = failure(STEP, TEMPLATE_FAILED, compiled.error)
        error = f"CASE WHEN {compiled.error} IS NOT NULL THEN {failed} END"
    return Route(compiled.name, error, compiled.headers)


def unless(route: Route, discarded: list[str]) -> Route:
    """``route`` sending the events where any of the ``discarded`` conditions (SQL) holds to no
    table (skipped, as by an empty name), and failing none of them."""
    if not discarded:
        return route
    dropped = sql.any_of(f"COALESCE({c}, false)" for c in discarded)
    return Route(
        f"CASE WHEN {dropped} THEN '' ELSE {route.name} END",
        f"CASE WHEN {dropped} THEN NULL ELSE {route.error} END",
        route.headers,
    )
