"""Functions on event destinations, run in-process as a Spark task runs them: Python functions
before the query (change, drop, fan out, fail), then pick, omit, rename, sql and filter in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tests.pipeline.shaping_functions import my_shaping

from headwater.config.model import HeadwaterConfig
from headwater.pipeline.shaping import derived_id
from headwater.pipeline.steps.functions import FunctionExpressionError, referenced
from headwater.testing.pipeline import Processed, process, source_table

MODULE = "tests.pipeline.shaping_functions.my_shaping"


def run(tmp_path: Path, events: list[Any], functions: list[dict[str, Any]]) -> Processed:
    dest = {"type": "files", "format": "jsonl.gz", "path": str(tmp_path / "files")}
    return process(source_table(events), {**dest, "functions": functions}, path=tmp_path)


def landed(out: Processed) -> list[dict[str, Any]]:
    return [json.loads(r["event"]) for r in out.rows()]


def test_a_python_function_changes_drops_fans_out_and_fails_events(tmp_path: Path) -> None:
    events = [{"event": "a"}, {"event": "boom"}, {"event": "drop"}, {"event": "fan", "n": 1}]
    out = run(tmp_path, events, [{"name": "python", "function": f"{MODULE}:enrich"}])
    rows = landed(out)
    assert [(r["event"], r.get("touched"), r.get("part")) for r in rows] == [
        ("a", True, None),
        ("fan", None, 0),
        ("fan", None, 1),
        ("fan", None, 2),
    ]
    # each event made of one gets its own id, derived from the record's, the same every run
    ids = [r["eventn_ctx"]["event_id"] for r in rows]
    assert ids == ["ev-0", *(derived_id("ev-3", k) for k in range(3))]
    assert len(set(ids)) == 4
    assert run(tmp_path / "again", events, [{"name": "python", "function": f"{MODULE}:enrich"}])
    assert out.errors() == {
        1: ("HW-PIPE-511", f"function python {MODULE}:enrich raised ValueError: no boom")
    }
    [failed] = out.failed
    assert failed.step == "function"
    assert json.loads(failed.value) == {"event": "boom"}  # the record as it came
    assert out.summary.dropped == 1


def test_derived_ids_are_stable_across_runs(tmp_path: Path) -> None:
    fn = [{"name": "python", "function": f"{MODULE}:enrich"}]
    first = landed(run(tmp_path / "1", [{"event": "fan"}], fn))
    second = landed(run(tmp_path / "2", [{"event": "fan"}], fn))
    assert [r["eventn_ctx"]["event_id"] for r in first] == [
        r["eventn_ctx"]["event_id"] for r in second
    ]


def test_a_function_that_takes_a_context_gets_the_records(tmp_path: Path) -> None:
    out = run(
        tmp_path, [{"event": "a"}], [{"name": "python", "function": f"{MODULE}:with_context"}]
    )
    [row] = landed(out)
    assert (row["seen_id"], row["seen_type"]) == ("ev-0", "track")


def test_a_function_that_returns_no_event_fails_it(tmp_path: Path) -> None:
    out = run(
        tmp_path, [{"event": "a"}], [{"name": "python", "function": f"{MODULE}:not_an_event"}]
    )
    assert not out.rows()
    [(code, reason)] = out.errors().values()
    assert code == "HW-PIPE-511" and "returned str" in reason


def test_a_fixed_function_lands_what_it_failed(tmp_path: Path) -> None:
    fn = [{"name": "python", "function": f"{MODULE}:enrich"}]
    assert run(tmp_path / "1", [{"event": "boom"}], fn).errors()
    my_shaping.BROKEN["on"] = False
    try:
        out = run(tmp_path / "2", [{"event": "boom"}], fn)
    finally:
        my_shaping.BROKEN["on"] = True
    assert not out.errors()
    assert [r["event"] for r in landed(out)] == ["boom"]


def test_sql_sets_fields_of_the_type_its_value_has(tmp_path: Path) -> None:
    events = [
        {
            "event": "buy",
            "properties": {"revenue": 10, "plan": "pro", "when": "2024-05-01T10:00:00Z"},
        },
        {"event": "buy", "properties": {"revenue": "n/a"}},
        {"event": "view"},
    ]
    functions = [
        {"name": "sql", "field": "/revenue_usd", "expression": "properties.revenue * 1.1"},
        {"name": "sql", "field": "/plan", "expression": "upper(properties.plan)"},
        {"name": "sql", "field": "/big", "expression": "revenue_usd > 5"},
        {"name": "sql", "field": "/day", "expression": "date_trunc('day', properties.when)"},
        {"name": "sql", "field": "/nothing", "expression": "properties.missing"},
    ]
    out = run(tmp_path, events, functions)
    rows = landed(out)
    assert rows[0]["revenue_usd"] == pytest.approx(11.0)
    assert rows[0]["plan"] == "PRO" and rows[0]["big"] is True
    assert rows[0]["day"].startswith("2024-05-01T00:00:00")
    # text that is no number: the value cannot be computed, NULL, the event lands
    assert "revenue_usd" not in rows[1] and rows[1]["properties"]["revenue"] == "n/a"
    assert "revenue_usd" not in rows[2]
    assert all("nothing" not in r for r in rows)
    assert not out.errors()


def test_filter_skips_events_and_counts_them(tmp_path: Path) -> None:
    events = [{"event": "a"}, {"event": "heartbeat"}, {"n": 1}]
    out = run(tmp_path, events, [{"name": "filter", "expression": "event <> 'heartbeat'"}])
    assert [r.get("event") for r in landed(out)] == ["a"]  # NULL <> 'heartbeat' is not true
    assert out.summary.skipped == 2
    assert not out.errors()


def test_pick_omit_and_rename_work_on_json_paths(tmp_path: Path) -> None:
    event = {"event": "a", "user": {"id": "u1", "email": "x@y"}, "secret": 1}
    functions = [
        {"name": "omit", "fields": ["/secret", "/user/email"]},
        {"name": "rename", "fields": {"/user/id": "/user_id"}},
        {"name": "pick", "fields": ["/event", "/user_id", "/eventn_ctx"]},
    ]
    [row] = landed(run(tmp_path, [event], functions))
    assert row == {"event": "a", "user_id": "u1", "eventn_ctx": {"event_id": "ev-0"}}


def test_functions_run_in_order_python_first(tmp_path: Path) -> None:
    functions = [
        {"name": "python", "function": f"{MODULE}:enrich"},
        {"name": "sql", "field": "/flag", "expression": "touched AND true"},
        {"name": "filter", "expression": "flag"},
    ]
    out = run(tmp_path, [{"event": "a"}, {"event": "fan"}], functions)
    assert [r["event"] for r in landed(out)] == ["a"]  # the fanned-out ones are not touched


def test_the_expressions_references_come_from_duckdbs_parser() -> None:
    assert referenced('properties.revenue * 1.1 + "a b".c') == [
        ("properties", "revenue"),
        ("a b", "c"),
    ]
    with pytest.raises(FunctionExpressionError, match="does not parse"):
        referenced("properties.revenue *")


def test_an_expression_whose_types_do_not_bind_fails_the_plan_naming_it(tmp_path: Path) -> None:
    functions = [{"name": "sql", "field": "/x", "expression": "event + 1"}]  # text + number
    with pytest.raises(FunctionExpressionError, match="function sql /x"):
        run(tmp_path, [{"event": "a"}], functions)


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        (
            [
                {"name": "sql", "field": "/x", "expression": "1"},
                {"name": "python", "function": f"{MODULE}:enrich"},
            ],
            "python functions run first",
        ),
        ([{"name": "skip", "field": "op", "operator": "==", "match": "x"}], "on events use filter"),
        ([{"name": "python", "function": "no_such_module:f"}], "does not import"),
        ([{"name": "python", "function": f"{MODULE}:nope"}], "has no 'nope'"),
        ([{"name": "sql", "field": "/x", "expression": "nosuchfn(event)"}], "nosuchfn"),
        ([{"name": "filter", "expression": "event <>"}], "does not parse"),
    ],
)
def test_bad_functions_are_config_errors(functions: list[dict[str, Any]], message: str) -> None:
    dest = {"id": "w", "type": "duckdb", "functions": functions}
    with pytest.raises(ValidationError, match=message):
        HeadwaterConfig.model_validate({"pipeline": {"destinations": [dest]}})


def test_sql_is_not_for_mirrors() -> None:
    dest = {
        "id": "m",
        "type": "duckdb",
        "apply": "upsert",
        "functions": [{"name": "sql", "field": "/x", "expression": "1"}],
    }
    with pytest.raises(ValidationError, match="not on an apply: upsert mirror"):
        HeadwaterConfig.model_validate({"pipeline": {"destinations": [dest]}})


def test_a_delivering_run_holds_and_sends_each_made_event_once(tmp_path: Path) -> None:
    """A destination that delivers sends the rows its plan describes and holds the novel ones
    for a run after learning (``only``): when one event of three made of a record is novel,
    only that one is held, and the run after sends only it."""
    from headwater.destinations import open_destination
    from headwater.pipeline.plan import Knowledge, plan
    from headwater.pipeline.task import LEARN, WRITE, TaskRun

    fn = [{"name": "python", "function": f"{MODULE}:fan_novel"}]
    spec = {"id": "wh", "type": "files", "format": "jsonl.gz", "path": str(tmp_path / "f")}
    config = HeadwaterConfig.model_validate(
        {"data_dir": str(tmp_path), "pipeline": {"destinations": [{**spec, "functions": fn}]}}
    )
    dest = config.pipeline.destinations[0]
    destination = open_destination(dest, config.data_dir)
    known = Knowledge()

    def program() -> Any:
        return plan(known, dest, destination, config.pipeline, tmp_path).program

    def learn(source: Any) -> None:
        found = TaskRun(program(), "wh", LEARN).run(source.to_batches())
        known.learn(found.leaves, found.seen, dest)

    sent: list[tuple[str, int]] = []

    def on_rows(tables: dict[str, Any]) -> None:
        for rows in tables.values():
            for text in rows.column("event").to_pylist():
                event = json.loads(text)
                sent.append((event["event"], event["part"]))

    try:
        learn(source_table([{"event": "a"}, {"event": "b"}]))  # the plan knows no "extra"
        source = source_table([{"event": "a"}, {"event": "b", "novel": True}])
        first = TaskRun(program(), "wh", WRITE, on_rows, hold_novel=True).run(source.to_batches())
        assert sorted(sent) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
        assert len(first.held) == 1  # b's third event alone
        learn(source)
        TaskRun(program(), "wh", WRITE, on_rows, only=first.held).run(source.to_batches())
        assert sorted(sent) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    finally:
        destination.close()


def test_a_trusted_config_is_read_without_importing_functions_or_duckdb(tmp_path: Path) -> None:
    """Spark's driver-side processes read the config as JSON: they import neither its Python
    functions nor DuckDB (which parses the SQL expressions where the config is loaded)."""
    import subprocess
    import sys

    dest = {
        "id": "wh",
        "type": "files",
        "path": str(tmp_path / "f"),
        "functions": [
            {"name": "python", "function": "not_a_module_here:fn"},
            {"name": "sql", "field": "/x", "expression": "properties.a + 1"},
            {"name": "filter", "expression": "event <> 'x'"},
        ],
    }
    text = json.dumps({"data_dir": str(tmp_path), "pipeline": {"destinations": [dest]}})
    script = (
        "import sys; from headwater.config.model import HeadwaterConfig as C; "
        "c = C.from_trusted_json(sys.stdin.read()); "
        "print(len(c.pipeline.destinations[0].functions), 'duckdb' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=text, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["3", "False"]
    with pytest.raises(ValidationError, match="not_a_module_here"):
        HeadwaterConfig.model_validate_json(text)  # loaded as a user's config: imported
