"""The options of ``spark.read(Stream).format("headwater")``, parsed once with clear errors.

- ``config``: the HeadwaterConfig as JSON (required): which bus, where;
- ``topics`` (comma-separated names) or ``topicPattern`` (a regex matched in full);
- ``maxRecordsPerTrigger``: most records per micro-batch (shared fairly by the partitions);
- ``startingOffsets``: ``earliest`` (default), ``latest`` or ``{"topic": {"0": 5}}``;
- ``endingOffsets`` (batch reads): ``latest`` (default) or explicit offsets;
- ``recordsPerTask``: the largest range one Spark task reads (default 100,000);
- ``layout``: ``kafka`` (default: the records, in the layout of Spark's Kafka source) or
  ``ranges``: one row per task's range (``RANGES_SCHEMA_DDL``), for a consumer that reads the
  records itself from the bus (the pipeline's sink, which so keeps them out of the JVM);
  ``busName`` labels those rows (which bus they are on: the reader of the rows knows the buses);
- ``alsoRead``: more topics on other buses, read by the same source (one query's one source,
  one set of offsets): JSON ``[{"config": {...}, "topics": ["..."], "busName": "..."}]``
  (the pipeline reads a destination's replay topic, in the failed store, this way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError

DEFAULT_RECORDS_PER_TASK = 100_000
KAFKA, RANGES = "kafka", "ranges"


@dataclass(frozen=True)
class Feed:
    """Topics of one bus a source reads."""

    config_json: str
    topics: list[str] | None
    pattern: str | None
    bus_name: str
    internal_topics: frozenset[str]


@dataclass(frozen=True)
class SourceOptions:
    config_json: str
    topics: list[str] | None
    pattern: str | None
    max_records_per_trigger: int | None
    starting: str | dict[str, dict[str, int]]
    ending: str | dict[str, dict[str, int]]
    records_per_task: int
    internal_topics: frozenset[str]
    layout: str = KAFKA
    bus_name: str = ""
    also: tuple[Feed, ...] = ()

    @property
    def feeds(self) -> tuple[Feed, ...]:
        main = Feed(
            self.config_json, self.topics, self.pattern, self.bus_name, self.internal_topics
        )
        return (main, *self.also)

    @property
    def config(self) -> HeadwaterConfig:
        return HeadwaterConfig.from_trusted_json(self.config_json)


def _positive(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {name} must be a whole number, not {raw!r}") from None
    if value < 1:
        raise ConfigError(f"option {name} must be at least 1, not {value}")
    return value


def _offsets(options: Mapping[str, str], name: str, words: tuple[str, ...]) -> Any:
    raw = options.get(name, words[0]).strip()
    if raw in words:
        return raw
    try:
        value = json.loads(raw)
        ok = isinstance(value, dict) and all(
            isinstance(parts, dict) and all(isinstance(o, int) for o in parts.values())
            for parts in value.values()
        )
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"option {name} must be {' or '.join(words)} or JSON like "
            f'{{"topic": {{"0": 42}}}}, not {raw!r}'
        )
    return {t: {str(p): int(o) for p, o in parts.items()} for t, parts in value.items()}


def parse_options(options: Mapping[str, str]) -> SourceOptions:
    """Validate the options (keys are case-insensitive in Spark; ours are given as written)."""
    opts = {k.lower(): v for k, v in options.items()}
    config_json = opts.get("config")
    if not config_json:
        raise ConfigError('the headwater source needs option "config" (HeadwaterConfig as JSON)')
    try:
        config = HeadwaterConfig.from_trusted_json(config_json)
    except ValueError as e:
        raise ConfigError(f"option config is not a valid headwater config: {e}") from None
    topics_raw, pattern = opts.get("topics"), opts.get("topicpattern")
    if (topics_raw is None) == (pattern is None):
        raise ConfigError("give the headwater source exactly one of topics or topicPattern")
    topics = None
    if topics_raw is not None:
        topics = [t.strip() for t in topics_raw.split(",") if t.strip()]
        if not topics:
            raise ConfigError("option topics names no topic")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"option topicPattern is not a valid regex: {e}") from None
    layout = opts.get("layout", KAFKA)
    if layout not in (KAFKA, RANGES):
        raise ConfigError(f"option layout must be {KAFKA} or {RANGES}, not {layout!r}")
    return SourceOptions(
        layout=layout,
        bus_name=opts.get("busname", ""),
        also=_also(opts.get("alsoread")),
        config_json=config_json,
        topics=topics,
        pattern=pattern,
        max_records_per_trigger=_positive(opts, "maxrecordspertrigger", None),
        starting=_offsets(opts, "startingoffsets", ("earliest", "latest")),
        ending=_offsets(opts, "endingoffsets", ("latest",)),
        records_per_task=_positive(opts, "recordspertask", DEFAULT_RECORDS_PER_TASK)
        or DEFAULT_RECORDS_PER_TASK,
        internal_topics=frozenset({config.pipeline.failed_topic}),
    )


def _also(raw: str | None) -> tuple[Feed, ...]:
    if raw is None:
        return ()
    try:
        feeds = json.loads(raw)
        out = []
        for f in feeds:
            config = HeadwaterConfig.from_trusted_json(json.dumps(f["config"]))
            topics = [str(t) for t in f["topics"]]
            internal = frozenset({config.pipeline.failed_topic})
            out.append(Feed(config.model_dump_json(), topics, None, str(f["busName"]), internal))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"option alsoRead is not a list of feeds: {e}") from None
    return tuple(out)
