"""A transport writer's namespace filter and transform functions: which messages a destination
receives, and in what shape (seed "Namespace Filtering" and "functions").

A destination has ``namespace``, a regular expression that must match a message's whole
namespace (default ``.*``; read from the ``hw-namespace`` header, without parsing the value),
and ``functions``, applied in order to each message that passes it::

    functions:
      - {name: rename, fields: {total: amount}}     # in data, before, unchanged, and the key
      - {name: pick, fields: [id, amount, status]}  # the data columns kept
      - {name: omit, fields: [status]}              # the data columns removed
      - {name: skip, field: data.status, operator: "==", match: test}   # dropped when true
      - {name: filter, expression: "CAST(data['amount'] AS DECIMAL(12,2)) > 10"}  # kept when true
      - {name: python, function: "my_package.transforms:redact"}   # dict in, dict or None out

The functions see the message as the JSON object of the record's value
(:mod:`headwater.transport.message`). ``pick``, ``omit`` and ``rename`` change the columns of
``data``, ``before`` and ``unchanged`` alike (``rename`` also those of ``key``), and the
``columns`` of a ``schema`` message, so that what a writer learns of a table's columns matches
the rows it gets. Otherwise the control messages (``schema``, ``complete``) pass every function
unchanged: ``skip``, ``filter`` and Python functions neither drop nor see them. They still obey
the namespace filter.

``skip`` drops a message when ``<field> <operator> <match>`` is true. Note: Transporter's
``skip`` did the opposite (it kept the messages for which the comparison held); here
``filter`` keeps and ``skip`` drops. ``field`` is ``op``, ``namespace``, ``ts``, ``position``,
or a column: ``data.<column>``, ``key.<column>``, ``before.<column>`` (more dots go into nested
objects). A missing field is null: ``==`` is true only for ``match: null``, ``!=`` only for a
non-null match, and the ordering and ``=~`` operators are false. A number compares with a
number, or with text that holds one (PostgreSQL's numeric values arrive as text); text with
text; anything else is an error. ``=~`` searches the regular expression in the value (in its
JSON text when the value is not text).

``filter`` is a Spark SQL boolean expression evaluated by Spark over these columns:
``op``, ``namespace``, ``mode`` (the ``hw-mode`` header), ``position`` (strings), ``ts`` (long,
milliseconds), ``schema`` (int), ``unchanged`` (array<string>), and ``key``, ``data``,
``before`` as ``map<string,string>``: ``data['status'] = 'paid'``. Map values are text:
strings as they are, numbers and booleans as their JSON text, nested objects and arrays as
JSON (``CAST(data['total'] AS DECIMAL(12,2)) > 10``, ``get_json_object(data['address'],
'$.city')``). The message is kept where the expression is true; false or NULL drops it (as in a
``WHERE`` clause), so a filter on ``data`` drops deletes, which have no ``data``, unless it
says otherwise (``op = 'delete' OR ...``).

:func:`apply_to_frame` runs the chain on a micro-batch in the source's record layout: the
namespace filter, ``filter`` and ``skip`` on ``op`` or ``namespace`` as Spark expressions, the
others in Python over Arrow (``mapInArrow``). A record whose value is not a transport message,
and a function that fails on one, fail the batch with :class:`FunctionError` naming the
function and the record's topic/partition/offset; nothing is dropped silently.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import orjson
from pydantic import Field, TypeAdapter, ValidationInfo, field_validator, model_validator

from headwater.config.base import Section
from headwater.errors import ConfigError, TerminalError
from headwater.transport.message import HEADER_MODE, HEADER_NAMESPACE, HEADER_OP, Op, record_key

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame

Message = dict[str, Any]
PythonCallable = Callable[[Message], Message | None]

CONTROL_OPS = frozenset({Op.SCHEMA.value, Op.COMPLETE.value})
CATCH_ALL = ".*"
_ORDERING = frozenset({">", ">=", "<", "<="})
_SCALAR_FIELDS = frozenset({"op", "ts", "namespace", "position"})
_ROW_FIELDS = frozenset({"data", "key", "before"})
_OPS = frozenset(op.value for op in Op)
_RECORD = "__hw_record"
IMPORTS = "imports"  # a validation context key: False, Python functions are not imported


def trusted(info: ValidationInfo) -> bool:
    """Validating a config checked where it was loaded, read again in Spark's processes: its
    Python functions are not imported nor its SQL parsed again."""
    return bool(info.context) and info.context.get(IMPORTS) is False


_MESSAGE_DDL = (
    "op string, ts long, namespace string, position string, schema int, "
    "unchanged array<string>, key map<string,string>, data map<string,string>, "
    "before map<string,string>"
)


class FunctionError(TerminalError):
    """A transform function failed on a record, or the record is not a transport message."""

    code = "HW-TRN-001"


class FunctionConfigError(ConfigError):
    """A namespace filter or function cannot be used as configured (an import path that does
    not import, a filter expression Spark rejects)."""

    code = "HW-TRN-002"


# --- the functions ------------------------------------------------------------------------


class _ColumnsFunction(Section):
    """``pick`` and ``omit``: a list of data columns, each kept or removed."""

    fields: list[str]
    keeps: ClassVar[bool]  # True: the listed columns are kept; False: they are removed

    @field_validator("fields")
    @classmethod
    def _fields(cls, v: list[str]) -> list[str]:
        return _names(v)

    @property
    def label(self) -> str:
        return f"{self.name} {self.fields}"  # type: ignore[attr-defined]

    @functools.cached_property
    def _column(self) -> Callable[[str], str | None]:
        listed, keeps = frozenset(self.fields), self.keeps
        return lambda c: c if (c in listed) == keeps else None

    def apply(self, message: Message) -> Message:
        """``message`` with the listed columns kept (pick) or removed (omit)."""
        return _reshape(message, self._column, key=False)


class PickFunction(_ColumnsFunction):
    name: Literal["pick"]
    fields: list[str] = Field(
        min_length=1, description="The data columns kept (in data, before and unchanged)."
    )
    keeps: ClassVar[bool] = True


class OmitFunction(_ColumnsFunction):
    name: Literal["omit"]
    fields: list[str] = Field(
        min_length=1, description="The data columns removed (from data, before and unchanged)."
    )
    keeps: ClassVar[bool] = False


class RenameFunction(Section):
    name: Literal["rename"]
    fields: dict[str, str] = Field(
        min_length=1,
        description="Old column name -> new name, in data, before, unchanged and the key; a "
        "renamed column replaces one that already has the new name.",
    )

    @field_validator("fields")
    @classmethod
    def _targets(cls, v: dict[str, str]) -> dict[str, str]:
        _names([*v, *v.values()], unique=False)
        targets: set[str] = set()
        for new in v.values():
            if new in targets:
                raise ValueError(f"two columns are renamed to {new!r}")
            targets.add(new)
        return v

    @property
    def label(self) -> str:
        return f"rename {self.fields}"

    @functools.cached_property
    def _column(self) -> Callable[[str], str | None]:
        names = self.fields
        return lambda c: names.get(c, c)

    def apply(self, message: Message) -> Message:
        """``message`` with its columns renamed."""
        return _reshape(message, self._column, key=True)


class SkipFunction(Section):
    name: Literal["skip"]
    field: str = Field(
        description="What is compared: op, namespace, ts, position, or a column as "
        "data.<column>, key.<column> or before.<column> (more dots for nested objects)."
    )
    operator: Literal["==", "!=", ">", ">=", "<", "<=", "=~"] = Field(
        description="How: ==, !=, >, >=, <, <=, or =~ (the match is a regular expression)."
    )
    match: bool | int | float | str | None = Field(
        description="The value compared with; the message is dropped when the comparison holds."
    )

    @field_validator("field")
    @classmethod
    def _path(cls, v: str) -> str:
        root, _, rest = v.partition(".")
        if root in _SCALAR_FIELDS and not rest:
            return v
        if root in _ROW_FIELDS and rest and all(rest.split(".")):
            return v
        raise ValueError(
            f"{v!r} is not a message field: use op, namespace, ts, position, or "
            "data.<column>, key.<column>, before.<column>"
        )

    @model_validator(mode="after")
    def _match(self) -> SkipFunction:
        m = self.match
        if self.operator == "=~":
            if not isinstance(m, str):
                raise ValueError("match: the =~ operator needs a regular expression (text)")
            try:
                re.compile(m)
            except re.error as e:
                raise ValueError(f"match {m!r} is not a valid regular expression: {e}") from None
        elif self.operator in _ORDERING and (m is None or isinstance(m, bool)):
            raise ValueError(f"match: {self.operator} needs a number or text, not {m!r}")
        return self

    @property
    def label(self) -> str:
        return f"skip {self.field} {self.operator} {self.match!r}"

    def apply(self, message: Message) -> Message | None:
        """None (dropped) when the comparison holds, else ``message``."""
        if message.get("op") in CONTROL_OPS:
            return message
        value = _lookup(message, self.field)
        try:
            hit = compare(value, self.operator, self.match)
        except (TypeError, InvalidOperation) as e:
            raise FunctionError(f"function {self.label}: {e}") from None
        return None if hit else message


class FilterFunction(Section):
    name: Literal["filter"]
    expression: str = Field(
        min_length=1,
        description="A boolean expression: on transport messages (apply: upsert) Spark SQL over "
        "op, namespace, mode, position, ts, schema, unchanged, and key, data, before (maps of "
        "column to text); on events DuckDB SQL over their fields. Kept where it is true.",
    )

    @field_validator("expression")
    @classmethod
    def _blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("the expression is empty")
        return v

    @property
    def label(self) -> str:
        return f"filter {self.expression!r}"

    def apply(self, message: Message) -> Message | None:
        """Not available one message at a time: Spark evaluates it (:func:`apply_to_frame`)."""
        raise FunctionConfigError(
            f"function {self.label} is a Spark SQL expression: it runs in apply_to_frame, "
            "not on one message in Python"
        )


class SqlFunction(Section):
    name: Literal["sql"]
    field: str = Field(
        min_length=1, description="Event destinations: the JSON path of the field set, /a/b."
    )
    expression: str = Field(
        min_length=1,
        description="A DuckDB SQL expression over the event's fields (properties.revenue * "
        "1.1); its value is the field's.",
    )

    @property
    def label(self) -> str:
        return f"sql {self.field} = {self.expression!r}"

    def apply(self, message: Message) -> Message | None:
        """Not available on transport messages: it runs in an event destination's query."""
        raise FunctionConfigError(
            f"function {self.label} runs in an event destination's query, not on transport messages"
        )


class PythonFunction(Section):
    name: Literal["python"]
    function: str = Field(
        description="module:function, importable where the pipeline runs; it gets the "
        "message (a dict) and returns it (changed or not), a new one, or None to drop it."
    )

    @field_validator("function")
    @classmethod
    def _importable(cls, v: str, info: ValidationInfo) -> str:
        if trusted(info):
            return v
        try:
            load_function(v)
        except FunctionConfigError as e:
            raise ValueError(e.message) from None
        return v

    @property
    def label(self) -> str:
        return f"python {self.function}"

    def apply(self, message: Message) -> Message | None:
        """What the function returns for ``message`` (control messages pass unchanged)."""
        if message.get("op") in CONTROL_OPS:
            return message
        try:
            fn = load_function(self.function)
        except FunctionConfigError as e:
            raise FunctionError(e.message) from None
        try:
            out = fn(message)
        except Exception as e:
            raise FunctionError(f"function {self.label} raised {type(e).__name__}: {e}") from e
        if out is None:
            return None
        if not isinstance(out, dict):
            raise FunctionError(
                f"function {self.label} returned {type(out).__name__}, not a message (a dict) "
                "or None"
            )
        if out.get("op") not in _OPS or not isinstance(out.get("namespace"), str):
            raise FunctionError(
                f"function {self.label} returned a message without a valid op "
                f"({out.get('op')!r}) or namespace ({out.get('namespace')!r})"
            )
        return out


FunctionConfig = Annotated[
    PickFunction
    | OmitFunction
    | RenameFunction
    | SkipFunction
    | FilterFunction
    | SqlFunction
    | PythonFunction,
    Field(discriminator="name"),
]
_FUNCTIONS: TypeAdapter[list[FunctionConfig]] = TypeAdapter(list[FunctionConfig])


def parse_functions(value: Any) -> list[FunctionConfig]:
    """A destination's ``functions`` from its config value (pydantic ``ValidationError`` names
    what is wrong, e.g. ``0.skip.operator``)."""
    return _FUNCTIONS.validate_python(value)


def check_namespace(pattern: str) -> str:
    """``pattern`` if it is a valid namespace regular expression, else ``ValueError``: a
    validator for a destination's ``namespace``."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"namespace {pattern!r} is not a valid regular expression: {e}") from None
    return pattern


@functools.cache
def load_function(path: str) -> PythonCallable:
    """The callable at ``module:function`` (``module:Class.method`` too), imported once per
    process; :class:`FunctionConfigError` names the path and what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise FunctionConfigError(f"python function {path!r} is not 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise FunctionConfigError(
            f"python function {path!r}: module {module_name!r} does not import: "
            f"{type(e).__name__}: {e}"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FunctionConfigError(
                f"python function {path!r}: module {module_name!r} has no {attr!r}"
            ) from None
    if not callable(obj):
        raise FunctionConfigError(f"python function {path!r} is not callable")
    return obj


def apply_message(message: Message, functions: Sequence[FunctionConfig]) -> Message | None:
    """The chain on one decoded message (the JSON object of a record's value): the message
    the writer gets, or None when a function dropped it. ``filter`` is not available here
    (:class:`FunctionConfigError`): Spark evaluates it, in :func:`apply_to_frame`. A function
    that fails raises :class:`FunctionError` naming it."""
    out: Message | None = message
    for function in functions:
        out = function.apply(out)
        if out is None:
            return None
    return out


# --- comparison (skip) ----------------------------------------------------------------------


def compare(value: Any, operator: str, match: Any) -> bool:
    """Whether ``value <operator> match`` holds, by the rules of ``skip`` (module docstring);
    ``TypeError`` when the two cannot be compared."""
    if operator == "=~":
        if value is None:
            return False
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        return re.search(match, text) is not None
    if operator in ("==", "!="):
        return _equal(value, match) == (operator == "==")
    if value is None or match is None:
        return False
    a, b = _number(value), _number(match)
    if a is not None and b is not None and (_is_number(value) or _is_number(match)):
        left: Any
        right: Any
        left, right = a, b
    elif isinstance(value, str) and isinstance(match, str):
        left, right = value, match
    else:
        raise TypeError(
            f"cannot compare {value!r} ({type(value).__name__}) with {match!r} "
            f"({type(match).__name__})"
        )
    if operator == ">":
        return bool(left > right)
    if operator == ">=":
        return bool(left >= right)
    if operator == "<":
        return bool(left < right)
    return bool(left <= right)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(v: Any) -> Decimal | None:
    """``v`` as a number: a number, or text that holds one; else None."""
    if _is_number(v):
        return Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
    if isinstance(v, str):
        try:
            return Decimal(v.strip())
        except InvalidOperation:
            return None
    return None


def _equal(value: Any, match: Any) -> bool:
    if isinstance(value, bool) or isinstance(match, bool):
        return isinstance(value, bool) and isinstance(match, bool) and value == match
    if _is_number(value) or _is_number(match):
        a, b = _number(value), _number(match)
        return a is not None and b is not None and a == b
    return bool(value == match)


def _lookup(message: Message, path: str) -> Any:
    node: Any = message
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


# --- reshaping (pick, omit, rename) ---------------------------------------------------------


def _names(v: list[str], unique: bool = True) -> list[str]:
    for name in v:
        if not name:
            raise ValueError("a column name is empty")
    if unique and len(set(v)) != len(v):
        raise ValueError("a column is named twice")
    return v


def _reshape(message: Message, column: Callable[[str], str | None], *, key: bool) -> Message:
    """``message`` with each column ``c`` of its rows (and of a schema message's ``columns``)
    renamed to ``column(c)``, or removed where that is None; the key's columns too if ``key``."""
    op = message.get("op")
    if op == Op.COMPLETE:
        return message
    out = dict(message)
    if op == Op.SCHEMA:
        columns = message.get("columns")
        if isinstance(columns, list):
            reshaped = []
            for c in columns:
                if not isinstance(c, dict):
                    reshaped.append(c)
                elif (new := column(c.get("name", ""))) is not None:
                    reshaped.append({**c, "name": new})
            out["columns"] = reshaped
        return out
    for part in ("data", "before", "key") if key else ("data", "before"):
        row = message.get(part)
        if isinstance(row, dict):
            out[part] = _reshape_row(row, column)
    unchanged = message.get("unchanged")
    if isinstance(unchanged, list):
        out["unchanged"] = [n for c in unchanged if (n := column(c)) is not None]
    return out


def _reshape_row(row: dict[str, Any], column: Callable[[str], str | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    renamed: set[str] = set()
    for name, value in row.items():
        new = column(name)
        if new is None or (new == name and name in renamed):
            continue  # removed, or a renamed column took this name
        if new != name:
            renamed.add(new)
        out[new] = value
    return out


# --- DataFrames -----------------------------------------------------------------------------


def apply_to_frame(df: DataFrame, namespace: str, functions: Sequence[FunctionConfig]) -> DataFrame:
    """``df`` (records in the source's layout: ``key``, ``value``, ``topic``, ``partition``,
    ``offset``, ``headers``, ...) without the records outside ``namespace`` or dropped by a
    function, and with the new ``value`` of those a function changed (and their record ``key``
    and ``hw-op``/``hw-namespace`` headers where the message's key, op or namespace changed).
    Same columns, same types.

    Consecutive functions Spark can evaluate (``filter``; ``skip`` on ``op`` or ``namespace``
    with a text match) run as Spark expressions, the others in one ``mapInArrow`` pass per run
    of them. Raises :class:`FunctionConfigError` now for a bad namespace or filter expression;
    the returned frame raises :class:`FunctionError` (inside a Spark exception) when evaluated
    on a record that is not a transport message or that a function fails on."""
    from pyspark.sql import functions as F

    try:
        check_namespace(namespace)
    except ValueError as e:
        raise FunctionConfigError(str(e)) from None
    out = df
    if namespace not in (CATCH_ALL, f"^{CATCH_ALL}$"):
        ns = F.coalesce(_header(HEADER_NAMESPACE), F.lit(""))
        out = out.where(ns.rlike(f"^(?:{namespace})$"))
    for in_spark, run in _runs(functions):
        if in_spark:
            out = _spark_run(out, run)
        else:
            out = out.mapInArrow(_ArrowChain(tuple(run)), out.schema)
    return out


def _in_spark(function: FunctionConfig) -> bool:
    if isinstance(function, FilterFunction):
        return True
    return (
        isinstance(function, SkipFunction)
        and function.field in ("op", "namespace")
        and isinstance(function.match, str)
    )


def _runs(functions: Sequence[FunctionConfig]) -> list[tuple[bool, list[FunctionConfig]]]:
    """``functions`` cut into runs of those Spark evaluates and those Python does."""
    runs: list[tuple[bool, list[FunctionConfig]]] = []
    for f in functions:
        spark = _in_spark(f)
        if runs and runs[-1][0] == spark:
            runs[-1][1].append(f)
        else:
            runs.append((spark, [f]))
    return runs


def _header(name: str) -> Column:
    """The first value of record header ``name`` as text (NULL when absent)."""
    from pyspark.sql import functions as F

    match = F.filter("headers", lambda h: h["key"] == F.lit(name))
    return F.get(match, 0)["value"].cast("string")


def _skip_condition(function: SkipFunction, value: Column) -> Column:
    """True where ``function`` drops the record (``value``: the op or namespace)."""
    from pyspark.sql import functions as F

    m = F.lit(function.match)
    conditions = {
        "==": lambda: value == m,
        "!=": lambda: value != m,
        ">": lambda: value > m,
        ">=": lambda: value >= m,
        "<": lambda: value < m,
        "<=": lambda: value <= m,
        "=~": lambda: value.rlike(str(function.match)),
    }
    return F.coalesce(conditions[function.operator](), F.lit(False))


def _spark_run(df: DataFrame, run: Sequence[FunctionConfig]) -> DataFrame:
    """``df`` through ``skip`` on headers and ``filter`` expressions, in order."""
    from pyspark.errors import AnalysisException, ParseException
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType

    if not any(isinstance(f, FilterFunction) for f in run):  # headers only
        control = F.coalesce(_header(HEADER_OP).isin(*CONTROL_OPS), F.lit(False))
        for f in run:
            assert isinstance(f, SkipFunction)
            value = _header(HEADER_OP if f.field == "op" else HEADER_NAMESPACE)
            df = df.where(control | ~_skip_condition(f, value))
        return df

    columns = df.columns
    message = F.from_json(F.col("value").cast("string"), _MESSAGE_DDL)
    framed = df.select(
        F.struct(*[F.col(f"`{c}`") for c in columns]).alias(_RECORD),
        message.alias("__hw_message"),
        _header(HEADER_MODE).alias("mode"),
    ).select(_RECORD, "__hw_message.*", "mode")
    not_message = F.concat(
        F.lit(f"{FunctionError.code}: record "),
        F.col(f"{_RECORD}.topic"),
        F.lit("/"),
        F.col(f"{_RECORD}.partition").cast("string"),
        F.lit("/"),
        F.col(f"{_RECORD}.offset").cast("string"),
        F.lit(": the value is not a transport message (a JSON object with an op)"),
    )
    control = F.col("op").isin(*CONTROL_OPS)
    for f in run:
        if isinstance(f, SkipFunction):
            keep = ~_skip_condition(f, F.col(f.field))
        else:
            assert isinstance(f, FilterFunction)
            try:
                expression = F.expr(f.expression)
                kind = framed.select(expression).schema[0].dataType
            except (AnalysisException, ParseException) as e:
                raise FunctionConfigError(
                    f"function {f.label}: Spark cannot evaluate it: {_first_line(e)} (columns: "
                    "op, namespace, mode, position, ts, schema, unchanged, key, data, before)"
                ) from None
            if not isinstance(kind, BooleanType):
                raise FunctionConfigError(
                    f"function {f.label} is of type {kind.simpleString()}, not boolean"
                )
            keep = F.coalesce(expression, F.lit(False))
        framed = framed.where(
            F.when(F.col("op").isNull(), F.raise_error(not_message)).otherwise(control | keep)
        )
    return framed.select(f"{_RECORD}.*")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class _ArrowChain:
    """The ``mapInArrow`` function of a run of Python-evaluated functions."""

    def __init__(self, functions: tuple[FunctionConfig, ...]) -> None:
        self.functions = functions
        self.transforms = not all(isinstance(f, SkipFunction) for f in functions)
        # only these can change a message's key (and so its record key)
        self.rekeys = any(isinstance(f, RenameFunction | PythonFunction) for f in functions)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield self.batch(batch)

    def batch(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` without the dropped records, with the changed ones' new values."""
        import pyarrow as pa

        schema = batch.schema
        values = batch.column(schema.get_field_index("value")).to_pylist()
        keep: list[int] = []
        new_values: list[bytes] = []
        new_keys: dict[int, bytes | None] = {}
        new_headers: dict[int, tuple[str, str]] = {}
        for i, raw in enumerate(values):
            try:
                message = _message(raw)
                op, ns = message["op"], message["namespace"]
                key = record_key(message.get("key")) if self.rekeys else None
                out = apply_message(message, self.functions)
                if out is None:
                    continue
                if self.transforms:
                    try:
                        new_values.append(orjson.dumps(out))
                    except TypeError as e:
                        raise FunctionError(
                            f"the message the functions returned is not JSON: {e}"
                        ) from None
                    j = len(keep)
                    if self.rekeys and (new_key := record_key(out.get("key"))) != key:
                        new_keys[j] = new_key
                    if out["op"] != op or out["namespace"] != ns:
                        new_headers[j] = (out["op"], out["namespace"])
            except FunctionError as e:
                raise FunctionError(f"record {_where(batch, i)}: {e.message}") from e
            keep.append(i)
        if len(keep) == batch.num_rows and not self.transforms:
            return batch
        out_batch = batch.take(pa.array(keep, type=pa.int64()))
        columns = list(out_batch.columns)
        if self.transforms:
            index = schema.get_field_index("value")
            columns[index] = pa.array(new_values, type=schema.field(index).type)
        if new_keys:
            index = schema.get_field_index("key")
            keys = columns[index].to_pylist()
            for j, k in new_keys.items():
                keys[j] = k
            columns[index] = pa.array(keys, type=schema.field(index).type)
        if new_headers:
            index = schema.get_field_index("headers")
            headers = columns[index].to_pylist()
            for j, (op, ns) in new_headers.items():
                headers[j] = _set_headers(headers[j], {HEADER_OP: op, HEADER_NAMESPACE: ns})
            columns[index] = pa.array(headers, type=schema.field(index).type)
        return pa.RecordBatch.from_arrays(columns, schema=schema)


def _message(raw: bytes | None) -> Message:
    """The message a record's value holds; :class:`FunctionError` when it holds none."""
    if raw is None:
        raise FunctionError("the value is empty, not a transport message")
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise FunctionError(f"the value is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise FunctionError("the value is not a JSON object")
    if message.get("op") not in _OPS or not isinstance(message.get("namespace"), str):
        raise FunctionError("the value is not a transport message (no valid op or namespace)")
    return message


def _where(batch: pa.RecordBatch, i: int) -> str:
    parts = []
    for name in ("topic", "partition", "offset"):
        index = batch.schema.get_field_index(name)
        parts.append("?" if index < 0 else str(batch.column(index)[i].as_py()))
    return "/".join(parts)


def _set_headers(
    headers: list[dict[str, Any]] | None, values: dict[str, str]
) -> list[dict[str, Any]]:
    """``headers`` (Arrow's ``{"key", "value"}`` structs) with ``values`` set."""
    out = []
    pending = dict(values)
    for h in headers or []:
        if h["key"] in values:
            if h["key"] in pending:
                out.append({"key": h["key"], "value": pending.pop(h["key"]).encode()})
            continue
        out.append(h)
    out.extend({"key": k, "value": v.encode()} for k, v in pending.items())
    return out
