"""What a destination knows about its events, carried from batch to batch, and the program a
micro-batch runs, planned from it on the driver.

``Knowledge`` holds the events' shape (``headwater.pipeline.shape``: every leaf seen and the kinds
of value it held) and, per routed table, the fields that have held a value in it. ``plan``
turns it, the destination's config and its tables as they are into a ``Program``: one DuckDB
query that each Spark task runs over its rows (``headwater.pipeline.task``), in which the steps
are native expressions decided here, once per batch:

decode (against the shape) -> context -> lookups -> routing -> mapping -> flatten and type.

Per row the query gives the target table, the error of the step that failed it, whether the row
is *novel* (it holds something the knowledge lacks: a key or kind the shape does not know, a
table never seen, a field never seen in its table) and every table's columns, typed as planned
against the table as it is. A batch with no novel row is written as planned. Otherwise the tasks
report what the novel rows hold, the knowledge widens (``Knowledge.learn``) and the batch is
planned again; in the steady state that never happens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

from headwater.destinations import Destination
from headwater.destinations.base import (
    ARCHIVE_EVENT,
    ARCHIVE_TIMESTAMP,
    RECORD_COLUMNS,
    SESSION_COLUMN,
    TableSchema,
)
from headwater.pipeline import shape as sh
from headwater.pipeline import shaping as shaping_steps
from headwater.pipeline import sql
from headwater.pipeline.columns import (
    ERROR,
    INPUT,
    JSON_TEXT,
    NOVEL,
    ORDER,
    PARSED,
    ROUTED,
    ROW,
    SHAPE_ERROR,
    TABLE,
    failure,
)
from headwater.pipeline.config import DestinationConfig, PipelineConfig
from headwater.pipeline.fields import Field, Fields, any_present, as_json, present
from headwater.pipeline.program import LEARN_ROUTED, Program
from headwater.pipeline.steps import context, decode, functions, lookup_rules, mapping, routing
from headwater.pipeline.steps.protobuf import load_types
from headwater.pipeline.steps.typing import ColumnPlan, column_value, plan_columns

Path = sh.Path
WRITE_STEP = "write"
DELIVER_STEP = "deliver"  # a delivering destination gave the event up (the failed store)
NULL_KEY = "HW-PIPE-402"
_DERR = "_hw_derr"  # decode's error
_ROUTE = "_hw_r"  # the table routing names
_RERR = "_hw_rerr"  # routing's error


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
        return json.dumps({"version": 2, "leaves": leaves, "tables": tables})

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

    def learn(
        self,
        leaves: Mapping[str, Mapping[Path, sh.Leaf]],
        seen: Mapping[str, Iterable[Path]],
        config: DestinationConfig,
    ) -> bool:
        """Widen with what novel rows held: per routed table, the leaves their JSON had
        (``leaves``, before any step) and the fields that had a value in them (``seen``, the
        planned fields after the steps); True when anything was new."""
        before = self.to_json()
        for routed, found in leaves.items():
            self.shape.merge(found)
            if routed:
                table = self.tables.setdefault(routed, set())
                table.update(mapping.trace(config.mapping, list(found)))
        for routed, paths in seen.items():
            if routed:
                self.tables.setdefault(routed, set()).update(paths)
        return self.to_json() != before


@dataclass(frozen=True)
class TablePlan:
    routed: str  # the name routing gave
    schema: TableSchema  # the columns this batch writes (names normalised)
    plans: tuple[ColumnPlan, ...]
    columns: tuple[tuple[str, str], ...]  # (table column, output column)


@dataclass(frozen=True)
class BatchPlan:
    program: Program
    tables: dict[str, TablePlan]  # routed name -> its plan


def plan(
    knowledge: Knowledge,
    config: DestinationConfig,
    destination: Destination,
    pipeline: PipelineConfig,
    state_dir: FilePath | None = None,
) -> BatchPlan:
    """The batch's program and table plans (pure: reads the destination's tables only);
    ``state_dir``: where the destination's state files go (the fingerprints seen)."""
    protobuf = load_types(pipeline.protobuf) if pipeline.protobuf else {}
    shape = knowledge.shape
    fields = decode.fields(shape)
    fields = context.enrich(fields)
    seen = state_dir / f"{config.id}.fingerprints" if state_dir is not None else None
    rules = list(config.enrichment)
    enriched = lookup_rules.apply(fields, rules, pipeline.geoip_database, seen)
    fields, lookups = enriched.fields, enriched.lookups
    applied = functions.apply(fields, config.functions if config.apply == "append" else [])
    fields = applied.fields
    route = routing.route(fields, config.table_name_template)
    route = routing.unless(route, [d.condition for d in enriched.drops] + applied.drops)
    shaping = _shaping(config)
    fields = mapping.apply(fields, config.mapping)
    tables = _plan_tables(knowledge, fields, config, destination)

    has_proto = bool(protobuf)

    def stages(error: str) -> list[str]:
        return [
            f"SELECT *, {decode.json_text(has_proto)} AS {sql.ident(JSON_TEXT)}",
            f"SELECT *, {error} AS {sql.ident(_DERR)}",
            f"SELECT *, CASE WHEN {sql.ident(_DERR)} IS NULL THEN {decode.parse(shape)} END "
            f"AS {sql.ident(PARSED)}",
            *[
                f"SELECT *, {call.function}({call.argument}) AS {sql.ident(call.column)}"
                for call in lookups
            ],
            *applied.stages,
            f"SELECT *, {route.name} AS {sql.ident(_ROUTE)}, {route.error} AS {sql.ident(_RERR)}",
        ]

    last = (
        f"SELECT *, {_error(tables, destination, bool(shaping))} AS {sql.ident(ERROR)}, "
        f"{_novel(shape, knowledge, fields, destination)} AS {sql.ident(NOVEL)}"
    )
    outputs = _outputs(tables, fields, destination)
    usual, guarded = (
        _query([*stages(decode.error(has_proto, g)), last], outputs) for g in (False, True)
    )
    learned = sorted(fields)
    flags = [
        f"bool_or({present(fields[p])}) AS {sql.ident(f'f{i}')}" for i, p in enumerate(learned)
    ]
    learn = _query(
        stages(decode.error(has_proto, True)),
        ", ".join([f"{sql.ident(_ROUTE)} AS {sql.ident(LEARN_ROUTED)}", *flags]),
        where=f"{sql.ident(_DERR)} IS NULL GROUP BY 1",
    )
    headers = sorted(
        {
            *decode.HEADERS,
            *context.HEADERS,
            *(lookup_rules.HEADERS if lookups else ()),
            *route.headers,
            *(shaping_steps.headers_read(shaping) if shaping else ()),
        }
    )
    program = Program(
        sql=usual,
        guarded_sql=guarded,
        learn_sql=learn,
        learn_fields=[list(p) for p in learned],
        headers=headers,
        functions=sorted({c.function for c in lookups}),
        geoip_database=str(pipeline.geoip_database) if pipeline.geoip_database else None,
        settings=enriched.settings,
        shaping=json.dumps(shaping) if shaping else "",
        protobuf={t: m.to_json() for t, m in protobuf.items()},
        tables={tp.schema.name: [list(c) for c in tp.columns] for tp in tables.values()},
    )
    return BatchPlan(program, tables)


def _shaping(config: DestinationConfig) -> dict[str, Any]:
    """What runs before the query (contracts, Python functions), as the program carries it;
    empty when nothing does."""
    python = [f.function for f in config.functions if f.name == "python"]
    if config.apply != "append" or not (python or config.contracts):
        return {}
    contracts: dict[str, Any] = {}
    if config.contracts:
        from headwater.pipeline.contracts import contracts_spec

        contracts = contracts_spec(config.contracts)
    return shaping_steps.spec(python, contracts, shaping_steps.import_roots(python))


def _query(stages: list[str], outputs: str, where: str = "") -> str:
    """``stages`` (each a ``SELECT ...`` of the one before it) and then ``outputs``."""
    ctes = []
    prev = INPUT
    for i, stage in enumerate(stages):
        ctes.append(f"s{i} AS ({stage} FROM {prev})")
        prev = f"s{i}"
    tail = f" WHERE {where}" if where else ""
    return f"WITH {', '.join(ctes)} SELECT {outputs} FROM {prev}{tail}"


# -- tables ---------------------------------------------------------------------------------
def _plan_tables(
    knowledge: Knowledge, fields: Fields, config: DestinationConfig, destination: Destination
) -> dict[str, TablePlan]:
    dialect = destination.dialect
    explicit = mapping.explicit_types(config.mapping)
    pk = tuple(dialect.normalize(c) for c in config.primary_key)
    out: dict[str, TablePlan] = {}
    outputs: dict[tuple[str, str, str | None], str] = {}  # (name, type, sql type) -> output
    for routed in sorted(knowledge.tables):
        name = dialect.normalize(routed)
        if destination.archives_events:
            names = (ARCHIVE_EVENT, ARCHIVE_TIMESTAMP, *_delivered(destination))
            cols = tuple((n, f"c_{n.strip('_')}") for n in names)
            out[routed] = TablePlan(routed, TableSchema(name), (), cols)
            continue
        seen = knowledge.tables[routed]
        planned = [f for f in fields.values() if f.path in seen]
        plans = plan_columns(planned, dialect, destination.table(name), explicit)
        schema = TableSchema(name, {p.column.name: p.column for p in plans}, pk)
        cols = []
        for p in plans:  # tables share an output column where a column is alike in both
            key = (p.column.name, p.column.type.value, p.column.sql_type)
            cols.append((p.column.name, outputs.setdefault(key, f"c{len(outputs)}")))
        out[routed] = TablePlan(routed, schema, tuple(plans), tuple(cols))
    return out


# -- per row: error, novelty, outputs ----------------------------------------------------------
def _routed() -> str:
    return sql.ident(_ROUTE)


def _error(tables: Mapping[str, TablePlan], destination: Destination, shaped: bool) -> str:
    parts = [sql.ident(_DERR), sql.ident(_RERR)]
    if shaped:  # contracts and Python functions judged first
        parts.insert(0, sql.ident(SHAPE_ERROR))
    null_keys = []
    for tp in tables.values():
        pk = tp.schema.primary_key
        if not pk or destination.archives_events:
            continue
        values = {p.column.name: column_value(p) for p in tp.plans}
        missing = sql.any_of(f"({values[c]}) IS NULL" if c in values else sql.TRUE for c in pk)
        reason = sql.lit(f"the primary key ({', '.join(pk)}) has a null or missing column")
        null_keys.append(
            (
                f"{_routed()} = {sql.lit(tp.routed)} AND {missing}",
                failure(WRITE_STEP, NULL_KEY, reason),
            )
        )
    if null_keys:
        parts.append(sql.case(null_keys))
    return f"COALESCE({', '.join(parts)})"


def _novel(shape: sh.Shape, knowledge: Knowledge, fields: Fields, destination: Destination) -> str:
    """Decoded rows that hold what the shape lacks, or rows routed to a table not known or
    holding a field their table never had."""
    routed = _routed()
    known = sorted(knowledge.tables)
    unseen = [f"NOT {sql.in_list(routed, known)}"]
    if not destination.archives_events:
        for path, f in fields.items():
            having = [t for t, paths in knowledge.tables.items() if path in paths]
            if len(having) == len(known) and known:
                continue  # every known table has it; an unknown table is novel anyway
            unseen.append(f"({present(f)} AND NOT {sql.in_list(routed, having)})")
    table_novel = f"({routed} IS NOT NULL AND {routed} != '' AND {sql.any_of(unseen)})"
    return f"({sql.ident(_DERR)} IS NULL AND ({decode.novel(shape)} OR {table_novel}))"


def _outputs(tables: Mapping[str, TablePlan], fields: Fields, destination: Destination) -> str:
    routed = _routed()
    error = sql.ident(ERROR)
    novel = sql.ident(NOVEL)
    normalised = sql.case(
        [(f"{routed} = {sql.lit(tp.routed)}", sql.lit(tp.schema.name)) for tp in tables.values()],
        "''",
    )
    out = [
        f"CASE WHEN {error} IS NULL THEN {normalised} ELSE '' END AS {sql.ident(TABLE)}",
        f"{error} AS {error}",
        f"COALESCE({novel}, false) AS {novel}",
        f"CASE WHEN {novel} THEN {routed} END AS {sql.ident(ROUTED)}",
        f"CASE WHEN {novel} THEN {sql.ident(JSON_TEXT)} END AS {sql.ident(JSON_TEXT)}",
        sql.ident(ROW),
        f'("partition"::BIGINT * 1099511627776 + "offset") AS {sql.ident(ORDER)}',
    ]
    values: dict[str, list[tuple[str, str]]] = {}
    for tp in tables.values():
        if destination.archives_events:
            exprs = {ARCHIVE_EVENT: archive_json(fields), ARCHIVE_TIMESTAMP: _stamp(fields)}
            exprs |= {n: sql.ident(n) for n in _delivered(destination)}
        else:
            exprs = {p.column.name: column_value(p) for p in tp.plans}
        for column, output in tp.columns:
            values.setdefault(output, []).append(
                (f"{routed} = {sql.lit(tp.routed)}", exprs[column])
            )
    for output, branches in values.items():
        value = branches[0][1] if len(tables) == 1 else sql.case(branches)
        out.append(f"{value} AS {sql.ident(output)}")
    return ", ".join(out)


def _delivered(destination: Destination) -> tuple[str, ...]:
    """The input columns an archive's rows carry too: a delivering destination's tasks need
    each row's session and, for the failed store, its record."""
    return (SESSION_COLUMN, *RECORD_COLUMNS) if destination.delivers else ()


def _stamp(fields: Fields) -> str:
    stamp = fields.get(("_timestamp",))
    return stamp.sql if stamp is not None else "NULL::TIMESTAMPTZ"


def archive_json(fields: Fields) -> str:
    """The event as JSON text, rebuilt from its fields (objects nested again, arrays and
    objects kept whole as they came, null and missing values left out)."""
    tree: dict[str, Any] = {}
    for path, f in fields.items():
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if isinstance(child, Field):  # a value where objects go too: the objects win
                child = node[part] = {}
            node = child
        if path[-1] not in node:
            node[path[-1]] = f
    return _object(tree)


def _object(tree: Mapping[str, Any]) -> str:
    members = []
    for name, node in tree.items():
        key = sql.lit(json.dumps(name) + ":")
        if isinstance(node, Field):
            members.append(f"CASE WHEN {present(node)} THEN {key} || {as_json(node)} END")
        else:
            leaves = _leaves(node)
            members.append(f"CASE WHEN {any_present(leaves)} THEN {key} || {_object(node)} END")
    if not members:
        return "'{}'"
    return f"('{{' || concat_ws(',', {', '.join(members)}) || '}}')"


def _leaves(tree: Mapping[str, Any]) -> Fields:
    out: Fields = {}
    for node in tree.values():
        if isinstance(node, Field):
            out[node.path] = node
        else:
            out.update(_leaves(node))
    return out


def widen_tables(destination: Destination, plans: Iterable[TablePlan]) -> None:
    """Create the batch's tables and add their missing columns (before anything is written)."""
    if destination.archives_events:
        return
    for tp in plans:
        existing = destination.table(tp.schema.name)
        if existing is None or tp.schema.missing_from(existing):
            destination.ensure_table(tp.schema)
