"""What a destination knows about its events, carried from batch to batch, and the one frame a
micro-batch becomes from it.

``Knowledge`` holds the events' shape (``headwater.pipeline.shape``: every leaf seen and the kinds
of value it held) and, per routed table, the fields that have held a value in it. ``BatchPlan``
turns a micro-batch into a single DataFrame (``frame``): the steps run as native expressions
against the known shape, and each row carries

- ``_hw_table`` (the routed table, normalised), ``_hw_error`` (why a step failed it, if one did),
- every known table's columns, named and typed as planned against the table as it is (a row
  fills only its own table's columns),
- ``_hw_novel``: the row holds something the knowledge lacks (a key or kind the shape does not
  know, a table never seen, a field never seen in its table).

A batch with no novel row is written as planned. Otherwise the writer widens the knowledge from
the novel rows only (``learn``) and plans again; in the steady state that never happens.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path as FilePath
from typing import Any

from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from headwater.destinations import Destination
from headwater.destinations.base import (
    ARCHIVE_EVENT,
    ARCHIVE_TIMESTAMP,
    ORDER_COLUMN,
    TableSchema,
)
from headwater.pipeline import shape as sh
from headwater.pipeline.columns import (
    ERROR,
    EVENT,
    JSON_TEXT,
    JSON_WHITESPACE,
    NOVEL,
    SOURCE_COLUMNS,
    TABLE,
    failure,
)
from headwater.pipeline.config import DestinationConfig
from headwater.pipeline.steps.context import enrich_context
from headwater.pipeline.steps.decode import json_text, parse
from headwater.pipeline.steps.flatten import Field, fields_of
from headwater.pipeline.steps.lookup_rules import apply_lookups
from headwater.pipeline.steps.mapping import apply_mapping, explicit_types, trace
from headwater.pipeline.steps.routing import route
from headwater.pipeline.steps.typing import SPARK_TYPES, ColumnPlan, column_values, plan_columns
from headwater.pipeline.structs import Path, field_at

ORDER = ORDER_COLUMN
ROUTED = "_hw_routed"  # the table routing named, before normalising (novel tables included)
NOVEL_TEXT = "_hw_novel_text"  # a novel row's JSON text, to learn from
SOURCE = "_hw_source"  # the row's place in the batch (upserts: the last one per key wins)
WRITE_STEP = "write"
NULL_KEY = "HW-PIPE-402"


@dataclass
class Knowledge:
    shape: sh.Shape = field(default_factory=sh.Shape)
    tables: dict[str, set[Path]] = field(default_factory=dict)  # routed name -> fields seen

    def to_json(self) -> str:
        leaves = [
            {"path": list(p), "kinds": sorted(leaf.kinds), "timestamp": leaf.timestamp}
            for p, leaf in self.shape.leaves.items()
        ]
        tables = {t: sorted(list(p) for p in paths) for t, paths in self.tables.items()}
        return json.dumps({"version": 1, "leaves": leaves, "tables": tables})

    @classmethod
    def from_json(cls, text: str) -> Knowledge:
        data = json.loads(text)
        leaves = {
            tuple(x["path"]): sh.Leaf(frozenset(x["kinds"]), bool(x["timestamp"]))
            for x in data["leaves"]
        }
        tables = {t: {tuple(p) for p in paths} for t, paths in data["tables"].items()}
        return cls(sh.Shape(leaves), tables)

    def save(self, path: FilePath) -> None:
        """Write atomically (a restarted writer starts from it instead of inferring)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: FilePath) -> Knowledge:
        """What was saved, or nothing known when there is no file or it cannot be read (it is
        only a hint: the destination's tables are the truth, and novel rows are learned)."""
        try:
            return cls.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return cls()


@dataclass(frozen=True)
class TablePlan:
    routed: str  # the name routing gave
    schema: TableSchema  # the columns this batch writes (names normalised)
    plans: tuple[ColumnPlan, ...]
    columns: tuple[tuple[str, str], ...]  # (table column, frame column)


def steps(
    df: DataFrame,
    config: DestinationConfig,
    shape: sh.Shape,
    *,
    protobuf: dict | None = None,
    geoip_database: object = None,
) -> DataFrame:
    """decode (against ``shape``), context, lookups, routing, mapping: native expressions."""
    out = parse(json_text(df, protobuf or None), shape)
    out = enrich_context(out)
    out = apply_lookups(out, list(config.enrichment), geoip_database)  # type: ignore[arg-type]
    out = route(out, config.table_name_template)
    return apply_mapping(out, config.mapping)


class BatchPlan:
    """One micro-batch's frame, planned from the knowledge and the destination's tables."""

    def __init__(
        self,
        events: DataFrame,
        knowledge: Knowledge,
        config: DestinationConfig,
        destination: Destination,
    ) -> None:
        self.events = events
        self.knowledge = knowledge
        self.config = config
        self.destination = destination
        struct = events.schema[EVENT].dataType
        self.struct = struct if isinstance(struct, StructType) else StructType([])
        origin = trace(config.mapping, list(knowledge.shape.leaves))
        self.fields = fields_of(self.struct, lambda p: knowledge.shape.kinds_of(origin.get(p, p)))
        self.tables = self._plan_tables()

    # -- planning ------------------------------------------------------------------------
    def _plan_tables(self) -> dict[str, TablePlan]:
        dialect = self.destination.dialect
        explicit = explicit_types(self.config.mapping)
        pk = tuple(dialect.normalize(c) for c in self.config.primary_key)
        out: dict[str, TablePlan] = {}
        taken: dict[str, str] = {}  # frame column -> its Spark type
        for routed in sorted(self.knowledge.tables):
            name = dialect.normalize(routed)
            if self.destination.archives_events:
                cols = ((ARCHIVE_EVENT, ARCHIVE_EVENT), (ARCHIVE_TIMESTAMP, ARCHIVE_TIMESTAMP))
                out[routed] = TablePlan(routed, TableSchema(name), (), cols)
                continue
            seen = self.knowledge.tables[routed]
            fields = [f for f in self.fields if f.path in seen]
            plans = plan_columns(fields, dialect, self.destination.table(name), explicit)
            schema = TableSchema(name, {p.column.name: p.column for p in plans}, pk)
            cols = []
            for p in plans:
                spark_type = SPARK_TYPES[p.column.type]
                frame_col = p.column.name
                if taken.setdefault(frame_col, spark_type) != spark_type:
                    frame_col = f"{p.column.name}__{name}"  # same name, other type elsewhere
                    taken[frame_col] = spark_type
                cols.append((p.column.name, frame_col))
            out[routed] = TablePlan(routed, schema, tuple(plans), tuple(cols))
        return out

    # -- novelty -------------------------------------------------------------------------
    def _unseen(self) -> SparkColumn:
        """Per row: its table is unknown, or it has a value in a field its table never had."""
        table = F.col(TABLE)
        known = sorted(self.knowledge.tables)
        out = ~table.isin(*known) if known else F.lit(True)
        if self.destination.archives_events:
            return out
        for f in self.fields:
            value = _leaf(f)
            having = [t for t, seen in self.knowledge.tables.items() if f.path in seen]
            out = out | (value.isNotNull() & (~table.isin(*having) if having else F.lit(True)))
        return out

    def novel(self) -> SparkColumn:
        routed = F.col(ERROR).isNull() & (F.coalesce(F.col(TABLE), F.lit("")) != "")
        return F.col(NOVEL) | (routed & self._unseen())

    # -- the frame -----------------------------------------------------------------------
    def frame(self) -> DataFrame:
        """``_hw_table`` (normalised; "" for skipped and failed rows and rows of tables not
        known yet, which are novel), ``_hw_error``, ``_hw_novel``, ``_hw_order``, every
        table's columns, and ``_hw_source``: the source record (``SOURCE_COLUMNS``) of failed
        rows, for the failed store (null on the others)."""
        table = F.col(TABLE)
        error = F.col(ERROR)
        values: dict[str, SparkColumn] = {}
        for tp in self.tables.values():
            mine = table == tp.routed
            if self.destination.archives_events:
                exprs = dict(_archive_values())
            else:
                exprs = dict(column_values(list(tp.plans), F.col(EVENT)))
                error = self._null_key(error, mine, tp, exprs)
            for column, frame_col in tp.columns:
                previous = values.get(frame_col)
                branch = F.when(mine, exprs[column])
                values[frame_col] = branch if previous is None else F.coalesce(previous, branch)
        normalised = F.lit("")
        for tp in self.tables.values():
            normalised = F.when(table == tp.routed, F.lit(tp.schema.name)).otherwise(normalised)
        out = self.events.withColumn(ERROR, error).withColumn(NOVEL, self.novel())
        source = F.struct(*[F.col(c) for c in SOURCE_COLUMNS])
        novel = F.col(NOVEL)
        return out.select(
            F.when(F.col(ERROR).isNotNull(), source).alias(SOURCE),
            F.when(F.col(ERROR).isNull(), F.col(TABLE)).alias(ROUTED),
            F.when(novel, F.col(JSON_TEXT)).alias(NOVEL_TEXT),
            *[F.when(novel, _leaf(f).isNotNull()).alias(flag) for flag, f in self.flags()],
            F.when(F.col(ERROR).isNull(), normalised).otherwise(F.lit("")).alias(TABLE),
            F.col(ERROR),
            F.col(NOVEL),
            order().alias(ORDER),
            *[v.alias(k) for k, v in values.items()],
        )

    def flags(self) -> list[tuple[str, Field]]:
        """The frame's per-field columns saying, on novel rows, whether the field has a value
        (what a table learns; none for archives, whose tables have no fields)."""
        if self.destination.archives_events:
            return []
        return [(f"_hw_f{i}", f) for i, f in enumerate(self.fields)]

    def summary(self, frame: DataFrame) -> list[Any]:
        """The batch in one small result (the job that computes, and caches, the frame): per
        routed table, ok or failed, novel or not, the row count and, for novel rows, which
        fields had a value."""
        flags = [F.max(F.col(flag)).alias(flag) for flag, _ in self.flags()]
        ok = F.col(ERROR).isNull().alias("ok")
        return (
            frame.groupBy(ROUTED, TABLE, ok, NOVEL)
            .agg(F.count(F.lit(1)).alias("count"), *flags)
            .collect()
        )

    def _null_key(
        self,
        error: SparkColumn,
        mine: SparkColumn,
        tp: TablePlan,
        exprs: dict[str, SparkColumn],
    ) -> SparkColumn:
        pk = tp.schema.primary_key
        if not pk:
            return error
        missing = reduce(
            operator.or_,
            [exprs[c].isNull() if c in exprs else F.lit(True) for c in pk],
        )
        reason = f"the primary key ({', '.join(pk)}) has a null or missing column"
        return F.when(error.isNotNull(), error).when(
            mine & missing, failure(WRITE_STEP, NULL_KEY, reason)
        )


def order() -> SparkColumn:
    """The row's place in the batch: partition, then offset (log order within a partition)."""
    return F.col("partition").cast("long") * F.lit(1 << 40) + F.col("offset")


def _leaf(f: Field) -> SparkColumn:
    return field_at(F.col(EVENT), f.path)


def _archive_values() -> list[tuple[str, SparkColumn]]:
    at = F.col(EVENT).getField("_timestamp")
    return [(ARCHIVE_EVENT, F.to_json(F.col(EVENT))), (ARCHIVE_TIMESTAMP, at)]


# -- learning from novel rows -----------------------------------------------------------------
def learn_shape(frame: DataFrame, shape: sh.Shape, sample: int | None = None) -> bool:
    """Widen ``shape`` with what the novel rows' JSON holds (the first ``sample`` of them,
    inferred here from their text; or all of them, inferred by Spark); True when it changed.
    ``frame`` is the batch's (cached) frame."""
    text = F.col(NOVEL_TEXT)
    is_object = F.ltrim(text, F.lit(JSON_WHITESPACE)).startswith("{")
    rows = frame.where(text.isNotNull() & is_object)
    if sample is not None:
        texts = [r[0] for r in rows.select(text).limit(sample).collect()]
        return shape.merge(sh.infer_texts(texts))
    return shape.merge(sh.infer(rows.select(F.try_parse_json(text).alias("v")), "v"))


def learn_first(df: DataFrame, shape: sh.Shape, sample: int) -> bool:
    """Widen ``shape`` from the first ``sample`` events of a source batch (a writer that knows
    nothing yet starts from this guess instead of a pass in which every row is novel)."""
    text = F.col(JSON_TEXT)
    rows = json_text(df).where(F.col(ERROR).isNull() & text.isNotNull()).select(text)
    return shape.merge(sh.infer_texts(r[0] for r in rows.limit(sample).collect()))


def learn_tables(plan: BatchPlan, summary: list[Any], knowledge: Knowledge) -> bool:
    """Add, per routed table, the fields its novel rows had a value in (from the batch's
    summary); True when a table or a field was new."""
    changed = False
    for row in summary:
        name = row[ROUTED]
        if not row[NOVEL] or not row["ok"] or not name:
            continue
        new_table = name not in knowledge.tables
        seen = knowledge.tables.setdefault(name, set())
        before = len(seen)
        seen.update(f.path for flag, f in plan.flags() if row[flag])
        changed = changed or new_table or len(seen) != before
    return changed


def widen_tables(destination: Destination, plans: dict[str, TablePlan]) -> None:
    """Create the batch's tables and add their missing columns (before anything is written)."""
    if destination.archives_events:
        return
    for tp in plans.values():
        existing = destination.table(tp.schema.name)
        if existing is None or tp.schema.missing_from(existing):
            destination.ensure_table(tp.schema)


__all__ = [
    "ORDER",
    "BatchPlan",
    "Knowledge",
    "TablePlan",
    "learn_shape",
    "learn_tables",
    "steps",
    "widen_tables",
]
