"""Sessions on the driver: a micro-batch of an ``http`` destination with ``group_by`` is
partitioned by session key, so that each session is in exactly one Spark task (which then keeps
at most one request of it in flight, seed D1), and sorted back into log order within each task.

The key is read from the record as it came in (``get_json_object`` over the value for each
``group_by`` path, a missing value counting as empty), before any step: it decides only which
task a record goes to and which session it is sent in. When the source gives ranges of records
(the embedded log), the records are read first (``mapInArrow``), since they must move between
tasks; without ``group_by`` nothing moves and each task is one session.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from headwater.bus.layout import SCHEMA_DDL
from headwater.destinations.base import SESSION_COLUMN
from headwater.pipeline.columns import pointer_parts

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from headwater.config.model import HeadwaterConfig

KEY_SEPARATOR = "\x1f"


def json_path(pointer: str) -> str:
    """``/a/b/0`` as Spark's JSON path ``$['a']['b'][0]``."""
    out = "$"
    for part in pointer_parts(pointer):
        if part.isdigit():
            out += f"[{part}]"
        else:
            escaped = part.replace("\\", "\\\\").replace("'", "\\'")
            out += f"['{escaped}']"
    return out


def session_key(group_by: list[str]) -> Column:
    from pyspark.sql import functions as F

    text = F.col("value").cast("string")
    parts = [F.coalesce(F.get_json_object(text, json_path(p)), F.lit("")) for p in group_by]
    return parts[0] if len(parts) == 1 else F.concat_ws(KEY_SEPARATOR, *parts)


def session_frame(
    frame: DataFrame,
    ranges: list[dict[str, Any]] | None,
    config: HeadwaterConfig,
    group_by: list[str],
) -> DataFrame:
    """``frame`` (records, or ranges of records when ``ranges`` is not None) with each
    record's ``_hw_session``, partitioned by it, in log order within each partition."""
    if not group_by:
        return frame
    from headwater.pipeline.sink import records

    if ranges is not None:
        frame = frame.mapInArrow(partial(records, config_json=config.model_dump_json()), SCHEMA_DDL)
    tasks = frame.sparkSession.sparkContext.defaultParallelism
    return (
        frame.withColumn(SESSION_COLUMN, session_key(group_by))
        .repartition(tasks, SESSION_COLUMN)
        .sortWithinPartitions("topic", "partition", "offset")
    )
