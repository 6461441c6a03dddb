"""Offset planning of the headwater source (pure functions) and its option errors."""

from __future__ import annotations

import pytest

from headwater.config.model import HeadwaterConfig
from headwater.errors import ConfigError
from headwater.pipeline.source import offsets as off
from headwater.pipeline.source.options import parse_options

A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)


def test_select_topics_by_name_or_pattern_never_internal_by_pattern() -> None:
    names = ["events-x", "events-y", "headwater-failed", "other"]
    assert off.select_topics(names, ["events-y", "missing"], None) == ["events-y"]
    assert off.select_topics(names, None, "events-.*") == ["events-x", "events-y"]
    assert off.select_topics(names, None, ".*") == ["events-x", "events-y", "other"]
    assert off.select_topics(names, ["headwater-failed"], None) == ["headwater-failed"]
    assert off.select_topics(names, None, "events") == []  # matched in full
    # the failed store's topic, wherever pipeline.failed_topic points it
    assert off.select_topics(names, None, "other|events-x", {"other"}) == ["events-x"]
    assert off.select_topics(names, ["other"], None, {"other"}) == ["other"]


def test_spread_is_fair_and_gives_unused_share_to_others() -> None:
    assert off.spread(9, {A0: 100, A1: 100, B0: 100}) == {A0: 3, A1: 3, B0: 3}
    assert off.spread(9, {A0: 1, A1: 100, B0: 100}) == {A0: 1, A1: 4, B0: 4}
    assert off.spread(10, {A0: 2, A1: 3, B0: 0}) == {A0: 2, A1: 3, B0: 0}
    share = off.spread(5, {A0: 100, A1: 100})
    assert sum(share.values()) == 5 and min(share.values()) >= 2


def test_plan_end_respects_cap_target_and_retention() -> None:
    marks = {A0: (0, 10), A1: (5, 8), B0: (0, 0)}
    assert off.plan_end({A0: 2, A1: 5}, marks, None) == {A0: 10, A1: 8, B0: 0}
    assert off.plan_end({A0: 2, A1: 5}, marks, 4) == {A0: 4, A1: 7, B0: 0}
    # AvailableNow: never past the target, partitions the target lacks stay put
    assert off.plan_end({A0: 2, A1: 5}, marks, None, target={A0: 6}) == {A0: 6, A1: 5, B0: 0}
    # retention moved the low watermark past the start: counted from the low watermark
    assert off.plan_end({A1: 1}, marks, 2) == {A0: 1, A1: 6, B0: 0}
    # never before the start, even where a high watermark reads lower
    assert off.plan_end({A0: 12}, marks, None)[A0] == 12


def test_resolve_and_ranges() -> None:
    marks = {A0: (2, 10), B0: (0, 3)}
    assert off.resolve(marks, "earliest") == {A0: 2, B0: 0}
    assert off.resolve(marks, "latest") == {A0: 10, B0: 3}
    assert off.resolve(marks, {"a": {"0": 0}}) == {A0: 2, B0: 0}  # clamped into the log
    assert off.resolve(marks, {"a": {"0": 5}}, unnamed="latest") == {A0: 5, B0: 3}
    assert off.ranges({A0: 2}, {A0: 10, B0: 3}, 4) == [
        off.Range("a", 0, 2, 6),
        off.Range("a", 0, 6, 10),
        off.Range("b", 0, 0, 3),
    ]
    assert off.to_offsets({A0: 1, A1: 2}) == {"a": {"0": 1, "1": 2}}
    assert off.from_offsets({"a": {"0": 1, "1": 2}}) == {A0: 1, A1: 2}


CONFIG = HeadwaterConfig().model_dump_json()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"topics": "a"}, 'needs option "config"'),
        ({"config": "{", "topics": "a"}, "not a valid headwater config"),
        ({"config": CONFIG}, "exactly one of topics or topicPattern"),
        ({"config": CONFIG, "topics": "a", "topicPattern": "b"}, "exactly one of"),
        ({"config": CONFIG, "topics": " , "}, "names no topic"),
        ({"config": CONFIG, "topicPattern": "("}, "topicPattern is not a valid regex"),
        ({"config": CONFIG, "topics": "a", "maxRecordsPerTrigger": "0"}, "at least 1, not 0"),
        ({"config": CONFIG, "topics": "a", "maxRecordsPerTrigger": "x"}, "whole number"),
        ({"config": CONFIG, "topics": "a", "startingOffsets": "first"}, "earliest or latest"),
        ({"config": CONFIG, "topics": "a", "startingOffsets": '{"a": 1}'}, "JSON like"),
        ({"config": CONFIG, "topics": "a", "endingOffsets": "earliest"}, "must be latest or"),
    ],
)
def test_bad_options_are_named(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message if "(" not in message else None) as info:
        parse_options(options)
    assert message in str(info.value)


def test_options_are_case_insensitive_and_parsed() -> None:
    opts = parse_options(
        {
            "config": CONFIG,
            "TOPICS": "a, b",
            "maxrecordspertrigger": "7",
            "startingOffsets": "latest",
        }
    )
    assert opts.topics == ["a", "b"] and opts.max_records_per_trigger == 7
    assert opts.starting == "latest" and opts.ending == "latest"
    assert opts.internal_topics == {"headwater-failed"}
