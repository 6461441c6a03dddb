"""``headwater webhooks ...``: the webhook transport's messages, as its state has them."""

from __future__ import annotations

import datetime as dt

import click

from headwater.ops.context import cli_config, config_option, format_option
from headwater.ops.errors import BadInput
from headwater.ops.output import echo_json, table
from headwater.webhooks.state.base import Attempt


@click.group("webhooks")
def webhooks_group() -> None:
    """The webhook transport: messages from senders to receivers and back."""


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def _answer(attempt: Attempt) -> str:
    return attempt.error or attempt.excerpt[:60]


@webhooks_group.command("status")
@click.argument("source_id")
@click.argument("message_id")
@config_option
@format_option
@click.pass_context
def status_cmd(ctx: click.Context, source_id: str, message_id: str, fmt: str) -> None:
    """A message's status, its history and every attempt (time, code, duration, excerpt)."""
    from headwater.webhooks.state import open_state

    with open_state(cli_config(ctx)) as store:
        state = store.get(source_id, message_id)
    if state is None:
        raise BadInput(f"no webhook message {message_id!r} from source {source_id!r}")
    if fmt == "json":
        echo_json(state.to_json())
        return
    click.echo(f"{state.source_id}/{state.message_id} -> {state.receiver}: {state.status}")
    if state.reason:
        click.echo(f"reason: {state.reason}")
    click.echo(table(["AT", "STATUS"], [(_when(t.at), t.status) for t in state.history]))
    if state.attempts:
        rows = [
            (_when(a.at), a.kind, a.status_code or "-", f"{a.duration_ms:.0f}", _answer(a))
            for a in state.attempts
        ]
        click.echo(table(["AT", "KIND", "CODE", "MS", "ANSWER"], rows))
