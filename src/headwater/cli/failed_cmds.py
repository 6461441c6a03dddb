"""``headwater failed ...``: list, show and replay the events the pipeline could not deliver."""

from __future__ import annotations

import click

from headwater.cli.context import cli_config, config_option, format_option
from headwater.cli.output import echo_json, table
from headwater.ops.errors import BadInput

REASON_WIDTH = 80


@click.group("failed")
def failed_group() -> None:
    """The failed store: events a step or a write could not handle, with why."""


def _filters(f: click.decorators.FC) -> click.decorators.FC:
    f = click.option(
        "--since", default=None, help="Only events failed at or after this ISO 8601 time."
    )(f)
    return click.option("--destination", "-d", default=None, help="Only this destination's.")(f)


@failed_group.command("list")
@_filters
@config_option
@format_option
@click.pass_context
def list_cmd(ctx: click.Context, destination: str | None, since: str | None, fmt: str) -> None:
    """One line per failed event: id, destination, step, code, reason."""
    from headwater.pipeline.failed import FailedStore

    events = FailedStore(cli_config(ctx)).events(destination, since)
    if fmt == "json":
        for e in events:
            echo_json(e.to_json(with_value=False))
        return
    rows = [
        (e.id, e.destination, e.step, e.code, e.failed_at, e.reason[:REASON_WIDTH]) for e in events
    ]
    click.echo(table(["ID", "DESTINATION", "STEP", "CODE", "FAILED AT", "REASON"], rows))


@failed_group.command("show")
@click.argument("event_id")
@config_option
@format_option
@click.pass_context
def show_cmd(ctx: click.Context, event_id: str, fmt: str) -> None:
    """Everything about one failed event, its original bytes and headers included."""
    from headwater.pipeline.failed import FailedStore

    found = FailedStore(cli_config(ctx)).get(event_id)
    if found is None:
        raise BadInput(f"no failed event with id {event_id!r} (see: headwater failed list)")
    data = found.to_json()
    if fmt == "json":
        echo_json(data)
        return
    for k, v in data.items():
        click.echo(f"{k}: {v}")


@failed_group.command("replay")
@_filters
@click.option("--id", "ids", multiple=True, help="Only the event with this id (repeatable).")
@config_option
@format_option
@click.pass_context
def replay_cmd(
    ctx: click.Context, destination: str | None, since: str | None, ids: tuple[str, ...], fmt: str
) -> None:
    """Send failed events through their destination again (the same steps, the same
    exactly-once write); the running pipeline picks them up from the destination's replay
    topic."""
    from headwater.pipeline.failed import FailedStore

    config = cli_config(ctx)
    known = {d.id for d in config.pipeline.destinations}
    if destination is not None and destination not in known:
        raise BadInput(
            f"no destination named {destination!r} in pipeline.destinations "
            f"(configured: {', '.join(sorted(known))})"
        )
    store = FailedStore(config)
    events = store.events(destination, since)
    if ids:
        wanted = set(ids)
        events = [e for e in events if e.id in wanted]
        missing = wanted - {e.id for e in events}
        if missing:
            raise BadInput(f"no failed event with id {', '.join(sorted(missing))}")
    counts = store.replay(events)
    if fmt == "json":
        echo_json({"replayed": counts})
        return
    if not counts:
        click.echo("nothing to replay")
    for dest, n in sorted(counts.items()):
        click.echo(f"replayed {n} event(s) to {dest}")
