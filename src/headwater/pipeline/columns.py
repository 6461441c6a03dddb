"""Column names the pipeline's steps share, and small Column helpers.

A micro-batch keeps the source's columns (Spark's Kafka layout: ``key, value, topic, partition,
offset, timestamp, timestampType, headers``) and gains:

- ``event``: the decoded event, a struct (null when it could not be decoded);
- ``_hw_error``: null, or ``struct<step, code, reason>`` once a step has failed the event (later
  steps pass failed rows through untouched; the writer sends them to the failed store);
- ``_hw_table``: the target table (routing; null or "" skips the event for the destination).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

EVENT = "event"
JSON_TEXT = "_hw_json_text"  # decode: the event's JSON text (raw bytes wrapped)
NOVEL = "_hw_novel"  # decode: the event holds something the carried shape does not know
JSON_WHITESPACE = " \t\r\n"  # what JSON allows around values
ERROR = "_hw_error"
TABLE = "_hw_table"
SOURCE_COLUMNS = (
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
)
ERROR_TYPE = "struct<step:string,code:string,reason:string>"


def with_event(df: DataFrame, event: Column) -> DataFrame:
    """``df`` with a new ``event`` (rows without one keep none), as a projection of its own.

    Steps set one field per call: an update refers to the event several times (a null check,
    the set), and chained in one expression those references would double the expression's
    size with every field; by name, each step's expression stays small."""
    return df.withColumn(EVENT, F.when(F.col(EVENT).isNotNull(), event))


def header(name: str) -> Column:
    """The first value of record header ``name`` as a UTF-8 string (null when absent)."""
    # array_position and get are compiled by Spark's codegen; a filter with a lambda is not
    position = F.array_position(F.col("headers")["key"], F.lit(name))
    return F.get(F.col("headers")["value"], position - 1).cast("string")


def failure(step: str, code: str, reason: Column | str) -> Column:
    """An ``_hw_error`` value."""
    why = reason if isinstance(reason, Column) else F.lit(reason)
    return F.struct(F.lit(step).alias("step"), F.lit(code).alias("code"), why.alias("reason")).cast(
        ERROR_TYPE
    )


def ok() -> Column:
    """The rows no step has failed."""
    return F.col(ERROR).isNull()


def fail_where(condition: Column, step: str, code: str, reason: Column | str) -> Column:
    """The new ``_hw_error``: unchanged where it is set, else this failure where ``condition``."""
    return F.when(F.col(ERROR).isNotNull(), F.col(ERROR)).when(
        condition, failure(step, code, reason)
    )


def json_path(parts: tuple[str, ...] | list[str]) -> str:
    """A Spark JSONPath for the object keys ``parts``: ``$['a']['b']`` (double quotes for keys
    holding a single quote). Raises ``ValueError`` for a key holding both quote characters."""
    out = ["$"]
    for key in parts:
        if "'" not in key:
            out.append(f"['{key}']")
        elif '"' not in key:
            out.append(f'["{key}"]')
        else:
            raise ValueError(f"the key {key!r} holds both quote characters")
    return "".join(out)


def pointer_parts(pointer: str) -> tuple[str, ...]:
    """``/a/b`` (the mapping rules' JSON path form, leading ``/`` optional) as ``("a", "b")``."""
    return tuple(p for p in pointer.strip().split("/") if p)
