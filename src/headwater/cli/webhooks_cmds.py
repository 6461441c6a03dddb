"""``headwater webhooks``: the webhook workers as a server role, and the commands on the webhook
transport's state: a message's status, the failed messages (list, show, retry) and the
receivers (list, disable, enable)."""

from __future__ import annotations

import datetime as dt

import click

from headwater.cli.context import (
    cli_config,
    config_option,
    format_option,
    role_options,
    run_server_role,
)
from headwater.cli.output import echo_json, table
from headwater.ops.errors import BadInput
from headwater.webhooks.state.base import Attempt, MessageState

REASON_WIDTH = 80


@click.group("webhooks", invoke_without_command=True)
@role_options(
    "Where /healthz listens [default: webhooks.host].",
    "Its port (0: any free port) [default: webhooks.port, 8090].",
)
@click.pass_context
def webhooks_group(ctx: click.Context, host: str | None, port: int | None, log_format: str) -> None:
    """The webhook transport. Without a subcommand: run the webhook workers (FromSender,
    ToReceiver, FromReceiverAsync, ToSender, Failed and the retry schedules) until SIGTERM,
    with /healthz on --host/--port. Several processes may run them (bus: kafka; state: redis,
    or the embedded SQLite state on one machine)."""
    if ctx.invoked_subcommand is not None:
        return
    from headwater.roles.webhooks import serve_webhooks

    run_server_role(ctx, serve_webhooks, host, port, log_format)


def _since(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(
            f"--since {value!r} is not an ISO 8601 time (2026-11-25T10:00:00Z)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def _receiver_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option("--receiver", "-r", default=None, help="Only this receiver's.")(f)


def _since_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--since", default=None, help="Only messages failed at or after this ISO 8601 time."
    )(f)


def _known_receiver(ctx: click.Context, receiver: str | None) -> None:
    config = cli_config(ctx)
    if receiver is not None and config.webhooks.receiver(receiver) is None:
        names = ", ".join(r.name for r in config.webhooks.receivers) or "none"
        raise BadInput(f"no receiver named {receiver!r} in webhooks.receivers ({names})")


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


@webhooks_group.group("failed")
def failed_group() -> None:
    """Messages that FAILED, with why; retry sends them on from the stage that failed."""


def _failed_line(state: MessageState) -> dict[str, object]:
    return {
        "source_id": state.source_id,
        "message_id": state.message_id,
        "receiver": state.receiver,
        "failed_at": state.updated_at,
        "reason": state.reason,
    }


@failed_group.command("list")
@_receiver_option
@_since_option
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True)
@config_option
@format_option
@click.pass_context
def failed_list_cmd(
    ctx: click.Context, receiver: str | None, since: str | None, limit: int, fmt: str
) -> None:
    """One line per failed message, oldest first: source, id, receiver, when, reason."""
    from headwater.webhooks.state import open_state

    with open_state(cli_config(ctx)) as store:
        failed = store.failed(receiver, _since(since), limit)
    if fmt == "json":
        for state in failed:
            echo_json(_failed_line(state))
        return
    rows = [
        (s.source_id, s.message_id, s.receiver, _when(s.updated_at), s.reason[:REASON_WIDTH])
        for s in failed
    ]
    click.echo(table(["SOURCE", "MESSAGE", "RECEIVER", "FAILED AT", "REASON"], rows))


@failed_group.command("show")
@click.argument("source_id")
@click.argument("message_id")
@config_option
@format_option
@click.pass_context
def failed_show_cmd(ctx: click.Context, source_id: str, message_id: str, fmt: str) -> None:
    """One failed message: its status, history and attempts (as ``webhooks status``)."""
    ctx.invoke(status_cmd, source_id=source_id, message_id=message_id, fmt=fmt)


@failed_group.command("retry")
@click.argument("keys", nargs=-1, metavar="[SOURCE_ID/MESSAGE_ID]...")
@_receiver_option
@_since_option
@config_option
@format_option
@click.pass_context
def failed_retry_cmd(
    ctx: click.Context, keys: tuple[str, ...], receiver: str | None, since: str | None, fmt: str
) -> None:
    """Send failed messages on again: the ones named, or every one (of --receiver, since
    --since). Each goes back to the stage it failed in (delivery, poll or callback) and is due
    at once; the running workers take it from the state's schedule."""
    import time

    from headwater.webhooks.state import InvalidTransition, UnknownMessage, open_state

    _known_receiver(ctx, receiver)
    with open_state(cli_config(ctx)) as store:
        if keys:
            wanted = []
            for key in keys:
                source_id, sep, message_id = key.partition("/")
                if not sep or not source_id or not message_id:
                    raise BadInput(f"{key!r} is not SOURCE_ID/MESSAGE_ID")
                wanted.append((source_id, message_id))
        else:
            wanted = [s.key for s in store.failed(receiver, _since(since), limit=1_000_000)]
        retried: list[tuple[str, str, str]] = []
        for source_id, message_id in wanted:
            try:
                _, kind = store.retry(source_id, message_id, time.time())
            except UnknownMessage:
                raise BadInput(
                    f"no webhook message {message_id!r} from source {source_id!r}"
                ) from None
            except InvalidTransition as e:
                raise BadInput(f"{source_id}/{message_id} is {e.current}, not FAILED") from None
            retried.append((source_id, message_id, kind))
    if fmt == "json":
        for source_id, message_id, kind in retried:
            echo_json({"source_id": source_id, "message_id": message_id, "retry": kind})
        return
    click.echo(f"retried {len(retried)} message(s)")


@webhooks_group.group("receivers")
def receivers_group() -> None:
    """The configured receivers: enabled or disabled (a 410 disables one)."""


@receivers_group.command("list")
@config_option
@format_option
@click.pass_context
def receivers_list_cmd(ctx: click.Context, fmt: str) -> None:
    """Each receiver with its URL and whether it is disabled, and why."""
    from headwater.webhooks.state import open_state

    config = cli_config(ctx)
    with open_state(config) as store:
        flags = store.receivers()
    rows = []
    for r in config.webhooks.receivers:
        flag = flags.get(r.name)
        disabled = flag is not None and flag.disabled
        line = {
            "name": r.name,
            "url": r.url,
            "disabled": disabled,
            "reason": flag.reason if disabled and flag else "",
            "since": flag.at if disabled and flag else None,
        }
        if fmt == "json":
            echo_json(line)
        rows.append((r.name, r.url, "disabled" if disabled else "enabled", line["reason"]))
    if fmt != "json":
        click.echo(table(["NAME", "URL", "STATE", "REASON"], rows))


def _set_receiver(ctx: click.Context, name: str, disabled: bool, reason: str) -> None:
    import time

    from headwater.webhooks.state import open_state

    _known_receiver(ctx, name)
    with open_state(cli_config(ctx)) as store:
        store.set_receiver(name, disabled, reason, time.time())
    click.echo(f"{name}: {'disabled' if disabled else 'enabled'}")


@receivers_group.command("disable")
@click.argument("name")
@click.option("--reason", default="disabled by an operator", show_default=True)
@config_option
@click.pass_context
def receivers_disable_cmd(ctx: click.Context, name: str, reason: str) -> None:
    """Hold a receiver's messages (they wait on its topic) until it is enabled."""
    _set_receiver(ctx, name, True, reason)


@receivers_group.command("enable")
@click.argument("name")
@config_option
@click.pass_context
def receivers_enable_cmd(ctx: click.Context, name: str) -> None:
    """Deliver to a receiver again (after a 410 or a disable)."""
    _set_receiver(ctx, name, False, "")
