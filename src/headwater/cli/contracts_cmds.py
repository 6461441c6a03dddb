"""``headwater contracts check``: validate sample events against a destination's data contracts
locally, printing every violation, before they reach the pipeline."""

from __future__ import annotations

from collections import Counter
from typing import IO, Any

import click
import orjson

from headwater.cli.context import cli_config, config_option, format_option
from headwater.cli.output import echo_json, table
from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput
from headwater.pipeline.config import DestinationConfig

EXIT_REJECTED = 1


@click.group("contracts")
def contracts_group() -> None:
    """Data contracts: the JSON Schema each event type of a destination must meet."""


@contracts_group.command("check")
@click.argument("events", type=click.File("rb"))
@click.option(
    "--type",
    "event_type",
    default=None,
    help="Check every event against this type's contract (default: each event's own type: "
    "its event field, else its event_type field).",
)
@click.option(
    "--source",
    default=None,
    help="The source the events come from: its own contracts apply first (default: none, "
    "only the contracts for every source).",
)
@click.option(
    "--destination",
    "-d",
    default=None,
    help="The destination whose contracts apply (needed when more than one has contracts).",
)
@config_option
@format_option
@click.pass_context
def check_cmd(
    ctx: click.Context,
    events: IO[bytes],
    event_type: str | None,
    source: str | None,
    destination: str | None,
    fmt: str,
) -> None:
    """Validate EVENTS (a file of JSON lines, - for stdin) against the contracts of a
    destination in the config: every violation of each line (line, path, keyword, message),
    then a summary. Exits 1 when any event would be rejected, else 0."""
    from headwater.pipeline.contracts import Contracts, contracts_spec, event_type_of

    index, dest = _destination(cli_config(ctx), destination)
    spec = contracts_spec(dest.contracts, key=f"pipeline.destinations[{index}].contracts")
    contracts = Contracts.compile(spec)

    results: list[dict[str, Any]] = []
    for number, line in enumerate(events, start=1):
        if not line.strip():
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            results.append(_result(number, None, None, "reject", [_not_json(exc)]))
            continue
        kind = event_type
        if kind is None and isinstance(event, dict):
            kind = event_type_of(event, None)
        verdict = contracts.check(kind, event, source)
        found = [v.to_json() for v in verdict.violations]
        results.append(_result(number, kind, verdict.contract, verdict.action, found))

    counts = Counter(r["action"] for r in results)
    summary = {"events": len(results), **{a: counts[a] for a in ("pass", "warn", "reject")}}
    if fmt == "json":
        echo_json({"destination": dest.id, "results": results, "summary": summary})
    else:
        _print_text(dest.id, results, summary)
    if counts["reject"]:
        ctx.exit(EXIT_REJECTED)


def _destination(config: HeadwaterConfig, wanted: str | None) -> tuple[int, DestinationConfig]:
    """The destination (and its index) whose contracts apply."""
    destinations = config.pipeline.destinations
    if wanted is not None:
        for i, d in enumerate(destinations):
            if d.id == wanted:
                if not d.contracts:
                    raise BadInput(f"destination {wanted!r} has no contracts")
                return i, d
        known = ", ".join(d.id for d in destinations)
        raise BadInput(
            f"no destination named {wanted!r} in pipeline.destinations (configured: {known})"
        )
    with_contracts = [(i, d) for i, d in enumerate(destinations) if d.contracts]
    if not with_contracts:
        raise BadInput("no destination in pipeline.destinations has contracts")
    if len(with_contracts) > 1:
        names = ", ".join(d.id for _, d in with_contracts)
        raise BadInput(
            f"several destinations have contracts ({names}): choose one with --destination"
        )
    return with_contracts[0]


def _result(
    line: int, kind: str | None, contract: str | None, action: str, violations: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "line": line,
        "type": kind,
        "contract": contract,
        "action": action,
        "violations": violations,
    }


def _not_json(exc: orjson.JSONDecodeError) -> dict[str, str]:
    return {"path": "", "keyword": "json", "message": f"not JSON: {exc}"}


def _print_text(destination: str, results: list[dict[str, Any]], summary: dict[str, int]) -> None:
    rows = [
        (
            r["line"],
            r["type"],
            r["contract"],
            r["action"],
            v["path"] or "/",
            v["keyword"],
            v["message"],
        )
        for r in results
        for v in r["violations"]
    ]
    if rows:
        click.echo(
            table(["LINE", "TYPE", "CONTRACT", "ACTION", "PATH", "KEYWORD", "MESSAGE"], rows)
        )
    click.echo(
        f"{summary['events']} event(s) against {destination}'s contracts: "
        f"{summary['pass']} pass, {summary['warn']} warn, {summary['reject']} reject"
    )
