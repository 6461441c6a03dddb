"""``headwater log ...``: inspect and operate the log (topics, records, writer offsets)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any, BinaryIO

import click

from headwater.bus import Bus
from headwater.bus.errors import OffsetOutOfRange, UnknownPartition, UnknownTopic
from headwater.bus.names import check_topic_name
from headwater.bus.records import Record, TopicInfo, TopicPartition
from headwater.cli.appending import Appender, BadLine, Progress, read_batches, stop_on_signals
from headwater.cli.context import cli_config, config_option, format_option, opened_bus
from headwater.cli.output import echo_json, table
from headwater.config.model import HeadwaterConfig
from headwater.ops.errors import BadInput, UnknownGroup
from headwater.ops.lag import group_rows
from headwater.ops.records import record_to_json, record_to_text
from headwater.pipeline.config import DestinationConfig

READ_CHUNK_RECORDS = 500
READ_CHUNK_BYTES = 4 << 20
MAX_REPORTED_BAD_LINES = 50


@click.group("log")
def log_group() -> None:
    """Inspect and operate the log: topics, records, writer (group) offsets."""


# -- topics -----------------------------------------------------------------------------------


@log_group.command("topics")
@config_option
@format_option
@click.pass_context
def topics_cmd(ctx: click.Context, fmt: str) -> None:
    """List topics with their partitions and watermarks.

    LOW is the first offset still on the log, HIGH the offset the next record gets; RECORDS is
    HIGH - LOW (offsets spanned: compaction can leave fewer).
    """
    with opened_bus(ctx, read_only=True) as (_config, bus):
        listing = [(info, _watermarks(bus, info)) for info in bus.topics()]

    if fmt == "json":
        topics = []
        for info, marks in listing:
            partitions = [
                {"partition": p, "low": low, "high": high, "records": high - low}
                for p, (low, high) in enumerate(marks)
            ]
            topics.append(
                {
                    "name": info.name,
                    "partitions": info.partitions,
                    "replication_factor": info.replication_factor,
                    "records": sum(high - low for low, high in marks),
                    "watermarks": partitions,
                }
            )
        echo_json({"topics": topics})
        return
    if not listing:
        click.echo("no topics")
        return
    rows: list[list[object]] = []
    for info, marks in listing:
        total = sum(high - low for low, high in marks)
        rows.append([info.name, info.partitions, "", "", total])
        rows += [["", f"[{p}]", low, high, high - low] for p, (low, high) in enumerate(marks)]
    click.echo(table(["TOPIC", "PARTITIONS", "LOW", "HIGH", "RECORDS"], rows))


def _watermarks(bus: Bus, info: TopicInfo) -> list[tuple[int, int]]:
    return [bus.watermarks(info.name, p) for p in range(info.partitions)]


# -- view -------------------------------------------------------------------------------------


@log_group.command("view")
@click.argument("topic")
@click.option("--partition", "-p", type=click.IntRange(min=0), help="Only this partition.")
@click.option(
    "--from",
    "start",
    type=click.IntRange(min=0),
    help="First offset to show (default: the low watermark of each partition).",
)
@click.option(
    "--to",
    "end",
    type=click.IntRange(min=0),
    help="Stop BEFORE this offset: --to is exclusive (default: the high watermark, "
    "as of the start of the command).",
)
@click.option("--limit", "-n", type=click.IntRange(min=0), help="Show at most N records.")
@config_option
@format_option
@click.pass_context
def view_cmd(
    ctx: click.Context,
    topic: str,
    partition: int | None,
    start: int | None,
    end: int | None,
    limit: int | None,
    fmt: str,
) -> None:
    """Show the records of TOPIC from offset --from up to (not including) --to.

    Every record shows its topic, partition, offset, timestamp (ms and ISO UTC), key, headers and
    value. Keys, values and header values are shown as UTF-8 text where valid, else base64
    (marked: "value (base64)" in text, "value_encoding": "base64" in JSON). Without --partition,
    each partition is shown in turn. --format json prints one JSON object per line.

    \b
    Example: offsets 9 to 15 of partition 0:
      headwater log view events --partition 0 --from 9 --to 16
    """
    if start is not None and end is not None and end < start:
        raise click.BadParameter(f"--to ({end}) is before --from ({start})", param_hint="--to")
    shown = 0
    with opened_bus(ctx, read_only=True) as (_config, bus):
        info = bus.topic(topic)
        partitions = [_check_partition(info, partition)] if partition is not None else None
        for p in partitions if partitions is not None else range(info.partitions):
            low, high = bus.watermarks(topic, p)
            first = low if start is None else start
            if first < low:
                click.echo(
                    f"note: {topic}[{p}] starts at offset {low} (earlier records were deleted); "
                    f"showing from {low}",
                    err=True,
                )
                first = low
            stop = high if end is None else min(end, high)
            budget = None if limit is None else limit - shown
            for record in _read_range(bus, topic, p, first, stop, budget):
                if fmt == "json":
                    echo_json(record_to_json(record))
                else:
                    click.echo(record_to_text(record))
                shown += 1
            if limit is not None and shown >= limit:
                break
    if shown == 0 and fmt != "json":
        click.echo("no records", err=True)


def _read_range(
    bus: Bus, topic: str, partition: int, start: int, stop: int, limit: int | None
) -> Iterator[Record]:
    """Records of one partition with ``start <= offset < stop``, read in bounded chunks."""
    offset = start
    remaining = limit
    while offset < stop and (remaining is None or remaining > 0):
        want = READ_CHUNK_RECORDS if remaining is None else min(READ_CHUNK_RECORDS, remaining)
        records = bus.read(topic, partition, offset, max_records=want, max_bytes=READ_CHUNK_BYTES)
        if not records:
            # A single record larger than the byte budget: take it alone.
            records = bus.read(topic, partition, offset, max_records=1)
            if not records:
                return
        for record in records:
            if record.offset >= stop:
                return
            yield record
            if remaining is not None:
                remaining -= 1
                if remaining == 0:
                    return
        offset = records[-1].offset + 1


def _check_partition(info: TopicInfo, partition: int) -> int:
    if not 0 <= partition < info.partitions:
        raise UnknownPartition(
            f"topic {info.name!r} has partitions 0..{info.partitions - 1}; "
            f"there is no partition {partition}"
        )
    return partition


# -- append -----------------------------------------------------------------------------------


@log_group.command("append")
@click.argument("topic")
@click.option(
    "--key-field",
    "-k",
    metavar="FIELD",
    help="Use this field of each JSON object as the record key (its string value; "
    "a dotted path reaches into nested objects).",
)
@click.option(
    "--partition", "-p", type=click.IntRange(min=0), help="Append every record to this partition."
)
@click.option(
    "--input",
    "-i",
    "source",
    type=click.File("rb"),
    default="-",
    show_default=True,
    help="Read the lines from this file instead of stdin ('-').",
)
@config_option
@format_option
@click.pass_context
def append_cmd(
    ctx: click.Context,
    topic: str,
    key_field: str | None,
    partition: int | None,
    source: BinaryIO,
    fmt: str,
) -> None:
    """Append JSON lines from stdin to TOPIC, one record per line.

    Each record's value is the line's bytes exactly as given (without the line break). Blank
    lines are skipped. The input is read and appended in batches of 1,000 lines (or 4 MiB), so
    it may be of any size; while the log's write queue is full the command waits for it. Each
    batch is checked whole before any of it is appended: when one holds lines that are not
    valid JSON or lack the key field, its bad lines are reported with their numbers, and the
    command stops with the batches before it appended (an input of one batch appends nothing).

    \b
    Whenever it stops early (bad lines, an error, Ctrl-C or SIGTERM), it first waits for the
    batches on their way to the log, then reports how many lines are durable:
      the first N lines are durable; resume with `tail -n +N+1`
    (--format json: durable_lines and resume_line). Lines are appended in input order, so
    resuming there neither loses nor repeats a record. On a terminal, stderr shows progress.
    """
    check_topic_name(topic)
    config = cli_config(ctx)
    bad: list[BadLine] = []
    with stop_on_signals() as stop, opened_bus(ctx, read_only=False, config=config) as (_c, bus):
        if partition is not None:
            _check_append_partition(config, bus, topic, partition)
        appender = Appender(bus, topic, stop.event)
        progress = Progress(fmt == "text")
        batches = read_batches(source, key_field, partition, _max_record_bytes(config), stop.event)
        try:
            while (batch := stop.next_batch(batches)) is not None:
                if batch.bad:
                    bad = batch.bad
                    break
                if not appender.add(batch):
                    break
                progress.show(batch.last, appender.durable_lines, appender.records)
        finally:
            appender.finish()
            progress.done()
    signum = stop.signals[0] if stop.signals else None
    _report_append(topic, appender, bad, signum, fmt)
    if bad:
        raise BadInput(_bad_lines_message(bad, appender.durable_lines))
    if appender.error is not None:
        raise appender.error
    if signum is not None:
        ctx.exit(128 + signum)


def _resume(durable_lines: int) -> str:
    return (
        f"the first {durable_lines} lines are durable; resume with `tail -n +{durable_lines + 1}`"
    )


def _bad_lines_message(bad: list[BadLine], durable_lines: int) -> str:
    what = f"{len(bad)} bad line{'s' if len(bad) != 1 else ''} on stdin"
    if durable_lines == 0:
        return f"{what}; nothing was appended"
    return f"{what}; {_resume(durable_lines)} once they are fixed"


def _report_append(
    topic: str, appender: Appender, bad: list[BadLine], signum: int | None, fmt: str
) -> None:
    """The summary of an append, and when it stopped early, why and where to resume."""
    if bad:
        reason = "bad lines"
    elif appender.error is not None:
        reason = "error"
    elif signum is not None:
        reason = signal.Signals(signum).name
    else:
        reason = None
    summary = [
        {
            "partition": p,
            "count": s.count,
            "first_offset": s.first_offset,
            "last_offset": s.last_offset,
        }
        for p, s in sorted(appender.partitions.items())
    ]
    if fmt == "json":
        report: dict[str, object] = {
            "topic": topic,
            "appended": appender.records,
            "durable_lines": appender.durable_lines,
            "partitions": summary,
        }
        if reason is not None:
            report.update(stopped=reason, resume_line=appender.durable_lines + 1)
        if bad:
            report["errors"] = [{"line": b.line, "message": b.message} for b in bad]
        if appender.error is not None:
            report["error"] = str(appender.error)
        if appender.beyond:
            report["also_appended_lines"] = [list(span) for span in appender.beyond]
        echo_json(report)
        return
    for item in bad[:MAX_REPORTED_BAD_LINES]:
        click.echo(f"line {item.line}: {item.message}", err=True)
    if len(bad) > MAX_REPORTED_BAD_LINES:
        click.echo(f"... and {len(bad) - MAX_REPORTED_BAD_LINES} more bad lines", err=True)
    if reason is None or appender.records:
        n = appender.records
        click.echo(f"appended {n} record{'s' if n != 1 else ''} to {topic}")
        for item in summary:
            click.echo(
                f"  {topic}[{item['partition']}]: {item['count']} at offsets "
                f"{item['first_offset']}..{item['last_offset']}"
            )
    if reason is not None and not bad:
        click.echo(f"stopped ({reason}): {_resume(appender.durable_lines)}", err=True)
    for first, last in appender.beyond:
        click.echo(
            f"warning: lines {first}..{last} were appended too, after a batch that failed: "
            "resuming as above appends them again",
            err=True,
        )


def _max_record_bytes(config: HeadwaterConfig) -> int:
    if config.bus.backend == "kafka":
        return config.bus.kafka.max_record_bytes
    return config.bus.embedded.max_record_bytes


def _check_append_partition(config: HeadwaterConfig, bus: Bus, topic: str, partition: int) -> None:
    """A partition that does not exist would fail the append: check it before appending."""
    try:
        info = bus.topic(topic)
    except UnknownTopic:
        auto = (
            config.bus.kafka.auto_create_topics
            if config.bus.backend == "kafka"
            else config.bus.embedded.auto_create_topics
        )
        if not auto:
            raise
        info = bus.create_topic(topic)
    _check_partition(info, partition)


# -- offsets ----------------------------------------------------------------------------------


@log_group.command("offsets")
@click.option("--group", "-g", help="Only this group (writer).")
@config_option
@format_option
@click.pass_context
def offsets_cmd(ctx: click.Context, group: str | None, fmt: str) -> None:
    """Each group's (writer's) committed offset, high watermark and lag per partition.

    COMMITTED is the next offset the group will read; LAG is HIGH minus that. A partition of a
    topic the group reads but has not committed on shows no COMMITTED; its lag counts from the
    low watermark.
    """
    with opened_bus(ctx, read_only=True) as (_config, bus):
        groups = bus.groups()
        if group is not None:
            if group not in groups:
                known = ", ".join(groups) if groups else "none"
                raise UnknownGroup(
                    f"group {group!r} has no committed offsets (groups with offsets: {known})"
                )
            groups = [group]
        report = [(g, group_rows(bus, g)) for g in groups]

    if fmt == "json":
        echo_json(
            {
                "groups": [
                    {
                        "group": g,
                        "lag": sum(r["lag"] or 0 for r in rows),
                        "partitions": rows,
                    }
                    for g, rows in report
                ]
            }
        )
        return
    if not report:
        click.echo("no groups have committed offsets")
        return
    lines = [
        [g, r["topic"], r["partition"], r["committed"], r["high"], r["lag"]]
        for g, rows in report
        for r in rows
    ]
    click.echo(table(["GROUP", "TOPIC", "PARTITION", "COMMITTED", "HIGH", "LAG"], lines))


# -- set-offset -------------------------------------------------------------------------------


class OffsetParam(click.ParamType):
    """An offset: a number, ``earliest`` (the low watermark) or ``latest`` (the high one)."""

    name = "offset"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) or value in ("earliest", "latest"):
            return value
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is not an offset (a number, earliest or latest)", param, ctx)
        if number < 0:
            self.fail(f"{number} is negative", param, ctx)
        return number


@log_group.command("set-offset")
@click.option("--group", "-g", required=True, help="The group (writer) to move.")
@click.argument("topic")
@click.argument("partition", type=click.IntRange(min=0))
@click.argument("offset", type=OffsetParam())
@config_option
@format_option
@click.pass_context
def set_offset_cmd(
    ctx: click.Context, group: str, topic: str, partition: int, offset: int | str, fmt: str
) -> None:
    """Set the committed offset of GROUP on TOPIC PARTITION to OFFSET.

    OFFSET is the next offset the group reads (a number, earliest or latest). To mark the record
    at offset 14 acknowledged (skip it), set 15; to replay from offset 9, set 9. It must lie
    within [LOW, HIGH] of the partition.

    GROUP may name a mirror destination (apply: upsert): its own offsets, kept in the
    destination, are set (records below are skipped; it never goes back past what its query
    already read).
    """
    config = cli_config(ctx)
    mirror = next(
        (d for d in config.pipeline.destinations if d.id == group and d.apply == "upsert"), None
    )
    with opened_bus(ctx, read_only=mirror is not None, config=config) as (_config, bus):
        info = bus.topic(topic)
        _check_partition(info, partition)
        low, high = bus.watermarks(topic, partition)
        if offset == "earliest":
            target = low
        elif offset == "latest":
            target = high
        else:
            assert isinstance(offset, int)
            target = offset
        if not low <= target <= high:
            raise OffsetOutOfRange(
                f"offset {target} is outside {topic}[{partition}]'s range [{low}, {high}] "
                "(low watermark to high watermark)"
            )
        tp = TopicPartition(topic, partition)
        if mirror is not None:  # a mirror keeps its own offsets, in its destination
            previous = _mark_mirror(config, mirror, topic, partition, target)
        else:
            previous = bus.committed(group, [topic]).get(tp)
            bus.commit(group, {tp: target})

    lag = high - target
    if fmt == "json":
        echo_json(
            {
                "group": group,
                "topic": topic,
                "partition": partition,
                "previous": previous,
                "committed": target,
                "high": high,
                "lag": lag,
            }
        )
        return
    before = "none" if previous is None else str(previous)
    click.echo(
        f"group {group}: {topic}[{partition}] committed offset {before} -> {target} (lag {lag})"
    )


def _mark_mirror(
    config: HeadwaterConfig, dest: DestinationConfig, topic: str, partition: int, target: int
) -> int | None:
    """Set a mirror destination's own next offset; the previous one."""
    from headwater.destinations import open_destination
    from headwater.transport.apply import mirror_of

    destination = mirror_of(open_destination(dest, config.data_dir))
    try:
        previous = destination.writer_offsets(dest.id).get((topic, partition))
        destination.mark_offsets(dest.id, {(topic, partition): target})
        return previous
    finally:
        destination.close()


# -- compact ----------------------------------------------------------------------------------


@log_group.command("compact")
@click.argument("topic", required=False)
@config_option
@format_option
@click.pass_context
def compact_cmd(ctx: click.Context, topic: str | None, fmt: str) -> None:
    """Compact the closed segments of TOPIC (default: every topic).

    Keeps the latest record per key below the lowest committed offset of the writers. The active
    segment is never compacted. With the Kafka backend the broker compacts topics whose
    cleanup.policy is compact, so there is nothing to do here.
    """
    with opened_bus(ctx, read_only=False) as (config, bus):
        if topic is not None:
            bus.topic(topic)
        results = bus.compact(topic)

    kafka = config.bus.backend == "kafka"
    if fmt == "json":
        echo_json(
            {
                "backend": config.bus.backend,
                "results": [r._asdict() for r in results],
                **(
                    {"note": "the Kafka broker compacts topics with cleanup.policy=compact"}
                    if kafka
                    else {}
                ),
            }
        )
        return
    if kafka and not results:
        click.echo("nothing to do: the Kafka broker compacts topics with cleanup.policy=compact")
        return
    compacted = [r for r in results if r.segments > 0]
    if not compacted:
        click.echo(
            f"nothing to compact in {len(results)} partition{'s' if len(results) != 1 else ''} "
            "(only closed segments are compacted)"
        )
        return
    rows = [
        [
            r.topic,
            r.partition,
            r.segments,
            f"{r.records_before} -> {r.records_after}",
            f"{r.bytes_before} -> {r.bytes_after}",
        ]
        for r in compacted
    ]
    click.echo(table(["TOPIC", "PARTITION", "SEGMENTS", "RECORDS", "BYTES"], rows))
