"""A transport writer's namespace filter and transform functions: each built-in, Python
functions by import path, chains, control messages, bad records and config errors; on one
decoded message (``apply_message``) and on tiny DataFrames of real transport records
(``apply_to_frame``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from headwater.bus.layout import SCHEMA_DDL
from headwater.transport.functions import (
    FunctionConfigError,
    FunctionError,
    apply_message,
    apply_to_frame,
    check_namespace,
    compare,
    parse_functions,
)
from headwater.transport.message import Change, Mode, Op, encode, record_key

pytestmark = pytest.mark.slow
NS = "shop.public.orders"
SAMPLE = "tests.transport.functions_sample"
TS = 1_764_121_200_000
COLUMNS = [
    {"name": "id", "type": "int4", "key": True},
    {"name": "total", "type": "numeric", "key": False},
    {"name": "status", "type": "text", "key": False},
    {"name": "note", "type": "text", "key": False},
]


def row(i: int, status: str = "paid", op: Op = Op.INSERT, ns: str = NS) -> Change:
    data = {"id": i, "total": f"{i}.50", "status": status, "note": f"note {i}"}
    if op == Op.DELETE:
        return Change(op, ns, TS + i, key={"id": i}, before=data, position=f"0/{i:X}")
    return Change(op, ns, TS + i, data=data, key={"id": i}, position=f"0/{i:X}")


def schema_message(ns: str = NS) -> Change:
    return Change(Op.SCHEMA, ns, TS, columns=COLUMNS, schema=1)


def complete_message(ns: str = NS) -> Change:
    return Change(Op.COMPLETE, ns, TS)


def message(change: Change) -> dict[str, Any]:
    """The decoded value of ``change``'s record."""
    return orjson.loads(encode(change, Mode.SYNC).value)


def chain(*configs: dict[str, Any]) -> list[Any]:
    return parse_functions(list(configs))


# --- one message ------------------------------------------------------------------------------


def test_pick_keeps_the_named_columns_of_data_before_and_unchanged() -> None:
    m = message(row(1, op=Op.UPDATE))
    m["before"] = dict(m["data"])
    m["unchanged"] = ["note", "status"]
    out = apply_message(m, chain({"name": "pick", "fields": ["id", "total", "note"]}))
    assert out is not None
    assert out["data"] == {"id": 1, "total": "1.50", "note": "note 1"}
    assert out["before"] == {"id": 1, "total": "1.50", "note": "note 1"}
    assert out["unchanged"] == ["note"]
    assert out["key"] == {"id": 1}  # the key is not data: pick leaves it
    assert m["data"]["status"] == "paid"  # the input is not changed


def test_omit_removes_the_named_columns() -> None:
    out = apply_message(message(row(2)), chain({"name": "omit", "fields": ["note", "missing"]}))
    assert out is not None
    assert out["data"] == {"id": 2, "total": "2.50", "status": "paid"}


def test_rename_renames_in_data_before_unchanged_and_key() -> None:
    m = message(row(3, op=Op.DELETE))
    m["unchanged"] = ["total"]
    out = apply_message(m, chain({"name": "rename", "fields": {"id": "order_id", "total": "sum"}}))
    assert out is not None
    assert out["key"] == {"order_id": 3}
    assert out["before"] == {"order_id": 3, "sum": "3.50", "status": "paid", "note": "note 3"}
    assert out["unchanged"] == ["sum"]
    assert "data" not in out


def test_rename_swaps_and_a_renamed_column_replaces_an_existing_one() -> None:
    m = message(row(4))
    swap = chain({"name": "rename", "fields": {"status": "note", "note": "status"}})
    out = apply_message(m, swap)
    assert out is not None
    assert (out["data"]["status"], out["data"]["note"]) == ("note 4", "paid")
    over = apply_message(m, chain({"name": "rename", "fields": {"note": "status"}}))
    assert over is not None
    assert over["data"] == {"id": 4, "total": "4.50", "status": "note 4"}


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"name": "pick", "fields": ["id", "total"]}, ["id", "total"]),
        ({"name": "omit", "fields": ["note"]}, ["id", "total", "status"]),
        ({"name": "rename", "fields": {"id": "order_id"}}, ["order_id", "total", "status", "note"]),
    ],
)
def test_a_schema_message_gets_the_same_columns_as_the_rows(
    config: dict[str, Any], names: list[str]
) -> None:
    out = apply_message(message(schema_message()), chain(config))
    assert out is not None
    assert [c["name"] for c in out["columns"]] == names
    assert out["columns"][0]["key"] is True  # the rest of each column is kept


@pytest.mark.parametrize(
    ("field", "operator", "match", "dropped"),
    [
        ("data.status", "==", "test", [2]),
        ("data.status", "!=", "test", [1, 3]),
        ("data.total", ">", 2, [2, 3]),  # numeric text against a number
        ("data.total", ">=", "2.5", [2, 3]),  # text against text: as text
        ("data.total", "<", 2.5, [1]),
        ("data.id", "<=", 2, [1, 2]),
        ("data.note", "=~", r"note [13]$", [1, 3]),
        ("data.id", "=~", "^3$", [3]),  # a number is matched as its JSON
        ("op", "==", "insert", [1, 2, 3]),
        ("namespace", "=~", r"\.orders$", [1, 2, 3]),
        ("ts", ">", TS + 2, [3]),
        ("key.id", "==", 1, [1]),
        ("data.missing", "==", None, [1, 2, 3]),  # missing is null
        ("data.missing", ">", 0, []),  # and not ordered
        ("data.missing", "!=", "x", [1, 2, 3]),
    ],
)
def test_skip_drops_a_message_when_the_comparison_holds(
    field: str, operator: str, match: Any, dropped: list[int]
) -> None:
    skip = chain({"name": "skip", "field": field, "operator": operator, "match": match})
    statuses = {1: "paid", 2: "test", 3: "paid"}
    out = {i: apply_message(message(row(i, statuses[i])), skip) for i in statuses}
    assert [i for i, m in out.items() if m is None] == dropped


def test_compare_rules() -> None:
    assert compare(True, "==", True) and not compare(1, "==", True)  # no bool/int mix
    assert compare("12.50", "==", 12.5) and not compare("12.50", "==", "12.5")
    assert compare(0.1, "==", "0.1")  # by decimal text, not binary float
    assert compare("b", ">", "a")
    with pytest.raises(TypeError, match="cannot compare"):
        compare({"a": 1}, ">", 3)
    with pytest.raises(TypeError, match="cannot compare"):
        compare("abc", "<", 3)


def test_skip_names_itself_when_the_values_cannot_be_compared() -> None:
    skip = chain({"name": "skip", "field": "data.status", "operator": ">", "match": 5})
    with pytest.raises(FunctionError, match=r"HW-TRN-001: function skip data.status > 5"):
        apply_message(message(row(1)), skip)


def test_python_function_changes_or_drops() -> None:
    shout = chain({"name": "python", "function": f"{SAMPLE}:shout"})
    out = apply_message(message(row(1)), shout)
    assert out is not None and out["data"]["note"] == "NOTE 1"
    drop = chain({"name": "python", "function": f"{SAMPLE}:drop_tests"})
    assert apply_message(message(row(1, "test")), drop) is None
    assert apply_message(message(row(2)), drop) is not None


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (
            "boom",
            r"function python tests\.transport\.functions_sample:boom raised "
            r"RuntimeError: boom on \{'id': 1\}",
        ),
        ("not_a_message", r"returned int, not a message \(a dict\) or None"),
    ],
)
def test_python_function_failures_name_the_function(name: str, error: str) -> None:
    with pytest.raises(FunctionError, match=error):
        apply_message(message(row(1)), chain({"name": "python", "function": f"{SAMPLE}:{name}"}))


def test_control_messages_pass_skip_and_python_functions() -> None:
    functions = chain(
        {"name": "skip", "field": "op", "operator": "!=", "match": "insert"},
        {"name": "skip", "field": "namespace", "operator": "=~", "match": "shop"},
        {"name": "python", "function": f"{SAMPLE}:boom"},
    )
    for change in (schema_message(), complete_message()):
        m = message(change)
        assert apply_message(m, functions) == m
    complete = message(complete_message())
    assert apply_message(complete, chain({"name": "pick", "fields": ["id"]})) is complete


def test_a_chain_applies_in_order() -> None:
    functions = chain(
        {"name": "rename", "fields": {"total": "amount"}},
        {"name": "skip", "field": "data.amount", "operator": "<", "match": 2},
        {"name": "python", "function": f"{SAMPLE}:shout"},
        {"name": "pick", "fields": ["id", "amount", "note"]},
    )
    assert apply_message(message(row(1)), functions) is None
    out = apply_message(message(row(2)), functions)
    assert out is not None
    assert out["data"] == {"id": 2, "amount": "2.50", "note": "NOTE 2"}
    assert out["op"] == "insert" and out["namespace"] == NS and out["ts"] == TS + 2


def test_filter_is_not_evaluated_one_message_at_a_time() -> None:
    with pytest.raises(FunctionConfigError, match="runs in apply_to_frame"):
        apply_message(message(row(1)), chain({"name": "filter", "expression": "true"}))


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "loc", "text"),
    [
        ({"name": "upper"}, (0,), "does not match any of the expected tags"),
        ({"name": "pick"}, (0, "pick", "fields"), "Field required"),
        ({"name": "pick", "fields": []}, (0, "pick", "fields"), "at least 1 item"),
        ({"name": "omit", "fields": ["a", "a"]}, (0, "omit", "fields"), "named twice"),
        ({"name": "pick", "fields": ["a"], "field": "x"}, (0, "pick", "field"), "Extra inputs"),
        (
            {"name": "rename", "fields": {"a": "c", "b": "c"}},
            (0, "rename", "fields"),
            "two columns are renamed to 'c'",
        ),
        (
            {"name": "skip", "field": "status", "operator": "==", "match": 1},
            (0, "skip", "field"),
            "use op, namespace, ts, position, or data.<column>",
        ),
        (
            {"name": "skip", "field": "data.", "operator": "==", "match": 1},
            (0, "skip", "field"),
            "not a message field",
        ),
        (
            {"name": "skip", "field": "op", "operator": "~", "match": 1},
            (0, "skip", "operator"),
            "'=='",
        ),
        (
            {"name": "skip", "field": "op", "operator": "=~", "match": "("},
            (0, "skip"),
            "not a valid regular expression",
        ),
        (
            {"name": "skip", "field": "op", "operator": "=~", "match": 3},
            (0, "skip"),
            "needs a regular expression",
        ),
        (
            {"name": "skip", "field": "ts", "operator": ">", "match": None},
            (0, "skip"),
            "needs a number or text",
        ),
        ({"name": "skip", "field": "op", "operator": "=="}, (0, "skip", "match"), "required"),
        ({"name": "filter", "expression": " "}, (0, "filter", "expression"), "empty"),
        (
            {"name": "python", "function": "no_colon"},
            (0, "python", "function"),
            "'no_colon' is not 'module:function'",
        ),
        (
            {"name": "python", "function": "tests.transport.nowhere:f"},
            (0, "python", "function"),
            "module 'tests.transport.nowhere' does not import: ModuleNotFoundError",
        ),
        (
            {"name": "python", "function": f"{SAMPLE}:missing"},
            (0, "python", "function"),
            f"module '{SAMPLE}' has no 'missing'",
        ),
        (
            {"name": "python", "function": f"{SAMPLE}:NOT_CALLABLE"},
            (0, "python", "function"),
            "is not callable",
        ),
    ],
)
def test_config_errors_name_what_is_wrong(
    config: dict[str, Any], loc: tuple[Any, ...], text: str
) -> None:
    with pytest.raises(ValidationError) as info:
        parse_functions([config])
    errors = info.value.errors()
    assert errors[0]["loc"][: len(loc)] == loc, errors
    assert text in str(info.value)


def test_namespace_must_be_a_regular_expression() -> None:
    assert check_namespace(r"shop\.public\..*") == r"shop\.public\..*"
    with pytest.raises(ValueError, match=r"namespace 'shop\.\(' is not a valid regular"):
        check_namespace("shop.(")


def test_config_from_yaml_like_values() -> None:
    functions = parse_functions(
        [
            {"name": "skip", "field": "data.total", "operator": ">", "match": 10},
            {"name": "skip", "field": "data.flag", "operator": "==", "match": True},
            {"name": "python", "function": f"{SAMPLE}:drop_tests"},
        ]
    )
    assert [type(f.match) for f in functions[:2]] == [int, bool]  # type: ignore[union-attr]
    assert functions[2].label == f"python {SAMPLE}:drop_tests"


# --- DataFrames -------------------------------------------------------------------------------


def frame(spark: Any, items: list[Change | bytes], topic: str = "cdc.shop") -> Any:
    """A micro-batch in the source's layout: ``items`` as records of one partition, from
    offset 0 (bytes: a record whose value is those bytes, without headers)."""
    rows = []
    for offset, item in enumerate(items):
        if isinstance(item, bytes):
            key, value, headers, ts = None, item, [], TS
        else:
            mode = Mode.COMPLETE if item.op == Op.COMPLETE else Mode.SYNC
            record = encode(item, mode)
            key, value, ts = record.key, record.value, record.timestamp or TS
            headers = [(k, v) for k, v in record.headers]
        stamp = datetime.fromtimestamp(ts / 1000, UTC)
        rows.append((key, value, topic, 0, offset, stamp, 0, headers))
    return spark.createDataFrame(rows, SCHEMA_DDL)


def run(df: Any, functions: list[dict[str, Any]], namespace: str = ".*") -> list[dict[str, Any]]:
    """What ``apply_to_frame`` keeps, by offset: the decoded value, record key and headers."""
    out = apply_to_frame(df, namespace, parse_functions(functions))
    assert out.schema == df.schema
    rows = sorted(out.collect(), key=lambda r: r["offset"])
    return [
        {
            "offset": r["offset"],
            "message": orjson.loads(r["value"]),
            "key": None if r["key"] is None else bytes(r["key"]),
            "headers": {h["key"]: bytes(h["value"]).decode() for h in r["headers"]},
            "timestamp": r["timestamp"],
        }
        for r in rows
    ]


@pytest.fixture(scope="module")
def batch(spark: Any) -> Any:
    """offsets 0: schema, 1-4: inserts (2 is a test row), 5: update, 6: delete, 7: another
    table's insert, 8: complete."""
    items: list[Change | bytes] = [
        schema_message(),
        row(1),
        row(2, "test"),
        row(3),
        row(4),
        row(5, op=Op.UPDATE),
        row(6, op=Op.DELETE),
        row(7, ns="shop.public.customers"),
        complete_message(),
    ]
    return frame(spark, items).cache()


def offsets(rows: list[dict[str, Any]]) -> list[int]:
    return [r["offset"] for r in rows]


def test_frame_without_functions_is_the_batch(batch: Any) -> None:
    rows = run(batch, [])
    assert offsets(rows) == list(range(9))
    assert rows[1]["headers"] == {"hw-mode": "sync", "hw-op": "insert", "hw-namespace": NS}


def test_frame_namespace_regex_matches_the_whole_namespace(batch: Any) -> None:
    assert offsets(run(batch, [], namespace=r"shop\.public\.orders")) == [0, 1, 2, 3, 4, 5, 6, 8]
    assert offsets(run(batch, [], namespace="shop.public.customers")) == [7]
    assert offsets(run(batch, [], namespace="shop")) == []  # not a prefix match
    assert offsets(run(batch, [], namespace=r"shop\.public\..*")) == list(range(9))
    with pytest.raises(FunctionConfigError, match="HW-TRN-002: namespace"):
        apply_to_frame(batch, "(", [])


def test_frame_pick(batch: Any) -> None:
    rows = run(batch, [{"name": "pick", "fields": ["id", "total"]}])
    assert offsets(rows) == list(range(9))
    assert rows[1]["message"]["data"] == {"id": 1, "total": "1.50"}
    assert rows[6]["message"]["before"] == {"id": 6, "total": "6.50"}
    assert [c["name"] for c in rows[0]["message"]["columns"]] == ["id", "total"]
    assert rows[1]["key"] == record_key({"id": 1})
    assert rows[1]["message"]["position"] == "0/1" and rows[1]["message"]["ts"] == TS + 1
    assert rows[8]["message"] == {"op": "complete", "ts": TS, "namespace": NS}


def test_frame_omit(batch: Any) -> None:
    rows = run(batch, [{"name": "omit", "fields": ["note", "status"]}])
    assert rows[5]["message"]["data"] == {"id": 5, "total": "5.50"}
    assert rows[5]["message"]["op"] == "update"


def test_frame_rename_changes_the_record_key_too(batch: Any) -> None:
    rows = run(batch, [{"name": "rename", "fields": {"id": "order_id"}}])
    assert rows[3]["message"]["data"]["order_id"] == 3
    assert rows[3]["message"]["key"] == {"order_id": 3}
    assert rows[3]["key"] == record_key({"order_id": 3})
    assert rows[6]["key"] == record_key({"order_id": 6})
    assert rows[0]["key"] is None  # a schema message has no key
    assert rows[3]["headers"]["hw-namespace"] == NS


def test_frame_skip_on_a_column(batch: Any) -> None:
    rows = run(batch, [{"name": "skip", "field": "data.status", "operator": "==", "match": "test"}])
    assert offsets(rows) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert rows[1]["message"] == message(row(1))  # kept as it was


def test_frame_skip_on_op_and_namespace(batch: Any) -> None:
    functions = [
        {"name": "skip", "field": "op", "operator": "==", "match": "delete"},
        {"name": "skip", "field": "namespace", "operator": "=~", "match": "customers"},
    ]
    assert offsets(run(batch, functions)) == [0, 1, 2, 3, 4, 5, 8]  # control messages stay
    ordered = [{"name": "skip", "field": "op", "operator": ">=", "match": "read"}]
    assert offsets(run(batch, ordered)) == [0, 1, 2, 3, 4, 6, 7, 8]  # "update" > "read"


def test_frame_filter_expression(batch: Any) -> None:
    expression = "data['status'] = 'paid' AND CAST(data['total'] AS DECIMAL(10, 2)) > 2"
    rows = run(batch, [{"name": "filter", "expression": expression}])
    assert offsets(rows) == [0, 3, 4, 5, 7, 8]  # the delete has no data: dropped
    keys = "op = 'delete' OR key['id'] IN ('1', '6') AND mode = 'sync' AND ts > 0"
    assert offsets(run(batch, [{"name": "filter", "expression": keys}])) == [0, 1, 6, 8]
    nested = "namespace LIKE '%customers' OR position = '0/4' OR size(unchanged) > 0"
    assert offsets(run(batch, [{"name": "filter", "expression": nested}])) == [0, 4, 7, 8]


def test_frame_filter_errors_are_config_errors(batch: Any) -> None:
    unknown = r"HW-TRN-002: function filter \"topic = 'x'\": Spark cannot evaluate it: \[UNRES"
    with pytest.raises(FunctionConfigError, match=unknown):
        apply_to_frame(batch, ".*", chain({"name": "filter", "expression": "topic = 'x'"}))
    with pytest.raises(FunctionConfigError, match=r"evaluate it: \[PARSE_SYNTAX_ERROR\]"):
        apply_to_frame(batch, ".*", chain({"name": "filter", "expression": "op = = 'x'"}))
    with pytest.raises(FunctionConfigError, match="is of type string, not boolean"):
        apply_to_frame(batch, ".*", chain({"name": "filter", "expression": "data['note']"}))


def test_frame_python_function_drops_and_changes(batch: Any) -> None:
    rows = run(
        batch,
        [
            {"name": "python", "function": f"{SAMPLE}:drop_tests"},
            {"name": "python", "function": f"{SAMPLE}:shout"},
        ],
    )
    assert offsets(rows) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert rows[1]["message"]["data"]["note"] == "NOTE 1"
    assert rows[0]["message"] == message(schema_message())  # not called on control messages


def test_frame_changed_namespace_moves_the_header_for_what_follows(batch: Any) -> None:
    functions = [
        {"name": "python", "function": f"{SAMPLE}:to_archive"},
        {"name": "skip", "field": "namespace", "operator": "==", "match": f"archive.{NS}"},
    ]
    rows = run(batch, functions)
    assert offsets(rows) == [0, 7, 8]  # the orders rows moved to archive.<ns>, then skipped
    assert rows[1]["headers"]["hw-namespace"] == "archive.shop.public.customers"
    assert rows[1]["message"]["namespace"] == "archive.shop.public.customers"
    assert rows[0]["headers"]["hw-namespace"] == NS


def test_frame_control_messages_pass_but_obey_the_namespace(batch: Any) -> None:
    functions = [
        {"name": "skip", "field": "op", "operator": "=~", "match": "."},
        {"name": "filter", "expression": "false"},
        {"name": "python", "function": f"{SAMPLE}:boom"},
    ]
    rows = run(batch, functions, namespace=r".*orders")
    assert offsets(rows) == [0, 8]
    assert rows[0]["message"] == message(schema_message())
    assert run(batch, functions, namespace=".*customers") == []


def test_frame_chain_of_spark_and_python_runs(batch: Any) -> None:
    functions = [
        {"name": "rename", "fields": {"total": "amount"}},
        {"name": "filter", "expression": "data['amount'] IS NOT NULL"},
        {"name": "skip", "field": "data.status", "operator": "==", "match": "test"},
        {"name": "skip", "field": "op", "operator": "==", "match": "update"},
        {"name": "python", "function": f"{SAMPLE}:shout"},
        {"name": "pick", "fields": ["id", "amount", "note"]},
        {"name": "filter", "expression": "CAST(data['amount'] AS DOUBLE) < 7"},
    ]
    rows = run(batch, functions, namespace=r"shop\.public\.(orders|customers)")
    assert offsets(rows) == [0, 1, 3, 4, 8]
    assert rows[2]["message"]["data"] == {"id": 3, "amount": "3.50", "note": "NOTE 3"}
    assert [c["name"] for c in rows[0]["message"]["columns"]] == ["id", "amount", "note"]
    assert rows[2]["timestamp"] == batch.where("offset = 3").first()["timestamp"]


@pytest.mark.parametrize(
    "functions",
    [
        [{"name": "pick", "fields": ["id"]}],  # Python
        [{"name": "filter", "expression": "true"}],  # Spark
    ],
)
def test_frame_a_record_that_is_not_a_message_fails_the_batch(
    spark: Any, functions: list[dict[str, Any]]
) -> None:
    from pyspark.errors import PySparkException

    df = frame(spark, [row(1), b"not json", row(3)], topic="cdc.bad")
    with pytest.raises(PySparkException, match=r"HW-TRN-001: record cdc\.bad/0/1: the value is"):
        apply_to_frame(df, ".*", parse_functions(functions)).collect()


def test_frame_a_failing_function_fails_the_batch_naming_it_and_the_record(spark: Any) -> None:
    from pyspark.errors import PySparkException

    df = frame(spark, [complete_message(), row(1)], topic="cdc.boom")
    functions = chain({"name": "python", "function": f"{SAMPLE}:boom"})
    with pytest.raises(
        PySparkException,
        match=r"HW-TRN-001: record cdc\.boom/0/1: function python "
        r"tests\.transport\.functions_sample:boom raised RuntimeError",
    ):
        apply_to_frame(df, ".*", functions).collect()
    unserializable = chain({"name": "python", "function": f"{SAMPLE}:not_json"})
    with pytest.raises(PySparkException, match=r"record cdc\.boom/0/1: the message the"):
        apply_to_frame(df, ".*", unserializable).collect()
