"""Shaping through Spark: a destination with a Python function kept beside the config (which
Spark's Python workers import from there), an sql function and a filter. Events the function
fails go to the failed store with its exception; once it is fixed, ``headwater failed replay``
lands them, once; a fanned-out event lands as each of its parts, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.pipeline.test_replay import append_events, cli_json, rows, run_pipeline, write_config

SHAPING = """\
from pathlib import Path

FIXED = Path(__file__).with_name("fixed")


def shape(event):
    if event["n"] % 4 == 0 and not FIXED.exists():
        raise ValueError(f"cannot shape {event['n']}")
    if event["n"] % 5 == 0:
        return [dict(event, part=k) for k in range(2)]
    return dict(event, shaped=True)
"""

FUNCTIONS = [
    {"name": "python", "function": "user_shaping:shape"},
    {"name": "sql", "field": "/double", "expression": "n * 2"},
    {"name": "filter", "expression": "kind <> 'heartbeat'"},
]


def test_a_failing_function_is_fixed_and_its_events_replayed_once(
    spark: Any, tmp_path: Path
) -> None:
    (tmp_path / "user_shaping.py").write_text(SHAPING)
    config = write_config(tmp_path / "headwater.yaml", "events", functions=FUNCTIONS)
    kinds = {7: "heartbeat"}
    append_events(config, [{"n": n, "kind": kinds.get(n, "click")} for n in range(1, 13)])

    run_pipeline(spark, config)
    # 4, 8 and 12 failed; 7 skipped by the filter; 5 and 10 made two events each
    got = rows(config, "select n, part, double, shaped from events order by n, part")
    assert [r[0] for r in got] == [1, 2, 3, 5, 5, 6, 9, 10, 10, 11]
    assert all(r[2] == 2 * r[0] for r in got)
    assert [(r[1], r[3]) for r in got if r[0] == 5] == [(0, None), (1, None)]
    ids = rows(config, "select eventn_ctx_event_id from events")
    assert len({i for (i,) in ids}) == len(ids)

    failed = cli_json(config, "failed", "list", "--destination", "warehouse")
    assert sorted(f["reason"] for f in failed) == sorted(
        f"function python user_shaping:shape raised ValueError: cannot shape {n}"
        for n in (4, 8, 12)
    )
    assert {f["step"] for f in failed} == {"function"}

    (tmp_path / "fixed").touch()  # the fix
    assert cli_json(config, "failed", "replay", "--destination", "warehouse") == [
        {"replayed": {"warehouse": 3}}
    ]
    run_pipeline(spark, config)
    replayed = "select n, double from events where n % 4 = 0 order by n"
    assert rows(config, replayed) == [(4, 8), (8, 16), (12, 24)]
    again = run_pipeline(spark, config)
    assert again.queries[0].writer.written == 0
    assert rows(config, "select count(*) from events") == [(13,)]
