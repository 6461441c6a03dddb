"""Sessions: a micro-batch of an ``http`` destination with ``group_by`` is partitioned by
session key, so that each session is in exactly one Spark task (which then keeps at most one
request of it in flight, seed D1), in log order within each task. Without ``group_by`` nothing
moves and each task is one session.

The key is read from the record as it came in, before any step (each ``group_by`` path's value
as JSON text, a missing value counting as empty, joined by ``KEY_SEPARATOR``): it decides only
which task a record goes to and which session it is sent in. Two ways, by what the source
gives:

- **Ranges of records** (the embedded log, on one machine): no record moves. The batch becomes
  ``defaultParallelism`` buckets; each bucket's task reads every range and keeps the records
  whose key hashes to its bucket (``bucket_records``, DuckDB over the Arrow batches). Every task
  reads the whole batch, which costs less than moving it: a local read is cheaper than passing
  the records through the JVM and Spark's shuffle (measured in ``docs/benchmarks.md``), and the
  embedded log's tasks are a single machine's cores.
- **Records** (Spark's Kafka connector, already in the JVM): ``get_json_object`` per path and
  Spark's ``repartition`` by the key, then ``sortWithinPartitions`` by topic, partition, offset.

The pipeline's sink lays a batch out by these (``headwater.pipeline.sink.session_frame``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headwater.destinations.base import SESSION_COLUMN
from headwater.pipeline.columns import pointer_parts, utf8_or_null

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column

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


@dataclass(frozen=True)
class Buckets:
    """A batch's records split by session key into ``count`` tasks (ranges of records)."""

    count: int
    group_by: list[str]

    def to_json(self) -> str:
        return json.dumps({"count": self.count, "group_by": self.group_by})

    @classmethod
    def from_json(cls, text: str) -> Buckets:
        data = json.loads(text)
        return cls(int(data["count"]), [str(p) for p in data["group_by"]])


def bucket_records(
    batches: Iterable[pa.RecordBatch], buckets: Buckets, bucket: int
) -> Iterator[pa.RecordBatch]:
    """The records of ``batches`` whose session key falls in ``bucket``, with the key as
    ``_hw_session`` (DuckDB reads each path from the value as JSON; a value that is not JSON
    text has the empty key)."""
    import duckdb
    import pyarrow as pa

    from headwater.pipeline.sql import lit

    parts = [
        f"coalesce(try(json_extract_string(text, {lit('/' + '/'.join(pointer_parts(p)))})), '')"
        for p in buckets.group_by
    ]
    key = parts[0] if len(parts) == 1 else f"concat_ws({lit(KEY_SEPARATOR)}, {', '.join(parts)})"
    query = f"SELECT {key} AS k, hash(k) % {buckets.count} = {bucket} AS mine FROM keys"
    con = duckdb.connect()
    con.execute("SET threads = 1")  # a task per core
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            keys = pa.table({"text": utf8_or_null(batch.column("value"))})
            con.register("keys", keys)
            out = con.sql(query).to_arrow_table()
            mine = out.column("mine").combine_chunks()
            chosen = pa.Table.from_batches([batch]).filter(mine)
            if chosen.num_rows:
                session = out.column("k").filter(mine)
                yield from chosen.append_column(SESSION_COLUMN, session).to_batches()
    finally:
        con.close()
