"""``headwater pipeline step``: a mirror destination stopped by a bad change (``on_error: stop``)
is stepped through by hand, one message at a time, from its own offsets.

Each message is taken from the destination's topics in order (topic, partition, offset), after
the writer's own offsets (``_headwater_offsets`` in the destination), goes through the same
namespace filter and functions, and is applied with the offset moved past it in one
transaction. A message that fails stops the step, its offset unmoved, with the error: fix the
cause, or mark it done with ``headwater log set-offset --group <destination>``. The
destination's query, started again, skips what a step applied.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from headwater.bus import open_bus
from headwater.bus.base import Bus
from headwater.bus.records import Record
from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError, HeadwaterError
from headwater.pipeline.config import DestinationConfig
from headwater.transport.apply import CHANGES, CHANGES_TABLE
from headwater.transport.functions import FilterFunction, apply_message
from headwater.transport.mirror import MirrorWriter, add_change


@dataclass(frozen=True)
class Stepped:
    topic: str
    partition: int
    offset: int
    outcome: str  # applied, skipped (namespace, control), dropped (a function), failed
    op: str = ""
    namespace: str = ""
    error: str = ""


def mirror_destination(config: HeadwaterConfig, destination_id: str) -> DestinationConfig:
    """The configured destination, which must be a mirror (``apply: upsert``)."""
    for dest in config.pipeline.destinations:
        if dest.id == destination_id:
            if dest.apply != "upsert":
                raise ConfigError(
                    f"destination {destination_id!r} appends events; step works on mirror "
                    "destinations (apply: upsert)"
                )
            if any(isinstance(f, FilterFunction) for f in dest.functions):
                raise ConfigError(
                    f"destination {destination_id!r} has a filter function (Spark SQL), which "
                    "a step cannot evaluate outside Spark"
                )
            return dest
    known = ", ".join(d.id for d in config.pipeline.destinations) or "none"
    raise ConfigError(f"no destination {destination_id!r} in pipeline.destinations ({known})")


def step(
    config: HeadwaterConfig, destination_id: str, count: int, echo: Callable[[Stepped], None]
) -> bool:
    """Apply the next ``count`` messages one by one; False when one failed (and stopped)."""
    dest = mirror_destination(config, destination_id)
    writer = MirrorWriter(config, dest)
    try:
        destination = writer.destination
        marks = destination.writer_offsets(dest.id)
        with open_bus(config, read_only=True) as bus:
            for record in _next(bus, dest, marks, count):
                done = _one(writer, record)
                echo(done)
                if done.outcome == "failed":
                    return False
        return True
    finally:
        writer.close()


def _next(
    bus: Bus, dest: DestinationConfig, marks: dict[tuple[str, int], int], count: int
) -> Iterator[Record]:
    pattern = None if dest.topics else re.compile(dest.topic_pattern)
    topics = [
        t
        for t in bus.topics()
        if (t.name in dest.topics if dest.topics else pattern and pattern.fullmatch(t.name))
    ]
    left = count
    for info in topics:
        for p in range(info.partitions):
            low, high = bus.watermarks(info.name, p)
            offset = max(low, marks.get((info.name, p), 0))
            while left and offset < high:
                for r in bus.read(info.name, p, offset, max_records=left):
                    yield r
                    left -= 1
                    offset = r.offset + 1
                    if not left:
                        return


def _one(writer: MirrorWriter, r: Record) -> Stepped:
    dest, destination = writer.dest, writer.destination
    at = (r.topic, r.partition)
    done = {at: r.offset + 1}
    base = {"topic": r.topic, "partition": r.partition, "offset": r.offset}
    op = namespace = ""
    try:
        message = orjson.loads(r.value)
        if not isinstance(message, dict) or "op" not in message:
            raise ValueError("not a transport message (no op)")
        op, namespace = str(message["op"]), str(message.get("namespace"))
        if not re.fullmatch(dest.namespace, namespace):
            destination.mark_offsets(dest.id, done)
            return Stepped(**base, outcome="skipped", op=op, namespace=namespace)
        if op not in ("schema", "complete") and dest.functions:
            message = apply_message(message, dest.functions)
            if message is None:
                destination.mark_offsets(dest.id, done)
                return Stepped(**base, outcome="dropped", op=op, namespace=namespace)
        if op == "schema":
            writer.schemas.learn(namespace, message["columns"])
            writer.schemas.save()
        if op in ("schema", "complete"):
            destination.mark_offsets(dest.id, done)
            return Stepped(**base, outcome="skipped", op=op, namespace=namespace)
        table = writer.table(message["namespace"])
        destination.ensure_mirror(table)
        columns: dict[str, list[Any]] = {name: [] for name in CHANGES.names}
        add_change(columns, message, r.topic, r.partition, r.offset)
        rows = pa.table(columns, schema=CHANGES)
        parts = destination.stage(dest.id, 0, f"step-{r.offset}", {CHANGES_TABLE: rows})
        destination.apply_changes(dest.id, None, parts, [table], done)
        return Stepped(**base, outcome="applied", op=op, namespace=namespace)
    except (HeadwaterError, ValueError, KeyError, TypeError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Stepped(**base, outcome="failed", op=op, namespace=namespace, error=first_line)
