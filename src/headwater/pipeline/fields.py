"""The flat event: what the steps work on, one ``Field`` per leaf path.

A destination's batch is planned on the driver (``headwater.pipeline.plan``): decode turns the
carried shape into one ``Field`` per leaf of the events' JSON, and each later step (context,
lookups, routing, mapping, typing) maps that ``Fields`` dict to a new one, in pure Python. A
field is a SQL expression over the task's input (``sql``), the form that expression gives the
value in (``form``) and the kinds of value it can hold (``kinds``), so every decision that
depends on types is taken once per batch, here, and per row only a native expression runs:

- ``text``: VARCHAR, the content of a JSON string;
- ``timestamp``: TIMESTAMPTZ (text that was always an ISO 8601 date-time);
- ``bigint``, ``double``, ``boolean``: one kind of JSON scalar, converted;
- ``json``: VARCHAR holding the value's raw JSON text (objects and arrays kept whole, and
  leaves whose values have several kinds): its kind is read per row from the text.

Steps that combine fields of different forms (a mapping's move onto an existing field) bring
them to ``json``, which holds any value without loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from headwater.destinations.types import ColumnType
from headwater.pipeline import sql
from headwater.pipeline.shape import BOOL, FLOAT64, INT64, JSON, STRING, Path, lattice_type

TEXT, TIMESTAMP, BIGINT, DOUBLE, BOOLEAN, RAW = (
    "text",
    "timestamp",
    "bigint",
    "double",
    "boolean",
    "json",
)
ISO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # timestamps as text: UTC, microseconds


@dataclass(frozen=True)
class Field:
    path: Path
    sql: str  # the value per row (NULL where the event has none)
    form: str  # how ``sql`` gives the value (see the module docstring)
    kinds: frozenset[str]  # the kinds its non-null values can have

    @property
    def type(self) -> ColumnType:
        """The lattice type every value of the field fits."""
        if self.form == TIMESTAMP:
            return ColumnType.TIMESTAMP
        return lattice_type(self.kinds)

    @property
    def json_text(self) -> bool:
        """Stored as JSON text (it holds objects or arrays kept whole)."""
        return JSON in self.kinds

    def at(self, path: Path) -> Field:
        return replace(self, path=path)


Fields = dict[Path, Field]


def present(f: Field) -> str:
    return f"({f.sql} IS NOT NULL)"


# the first character of raw JSON text per kind: '"', 't' and 'f', '{' and '[', '-' and digits
_FIRST_CHARS = {
    STRING: (34,),
    BOOL: (102, 116),
    JSON: (91, 123),
    INT64: (45, *range(48, 58)),
    FLOAT64: (45, *range(48, 58)),
}
_ALL_CHARS = frozenset(c for codes in _FIRST_CHARS.values() for c in codes)


def kind_in(f: Field, kinds: frozenset[str] | set[str] | tuple[str, ...]) -> str:
    """Per row: the value is null or of one of ``kinds``. One-kind forms decide it here; raw
    JSON by its first character (one ``ascii`` per row), and a number is INT64 when it has no
    fraction or exponent."""
    wanted = frozenset(kinds)
    if f.form != RAW:
        return sql.TRUE if f.kinds <= wanted else f"({f.sql} IS NULL)"
    if f.kinds <= wanted:
        return sql.TRUE
    x = f.sql
    allowed = frozenset(c for k in wanted for c in _FIRST_CHARS[k])
    if INT64 in wanted and FLOAT64 not in wanted:  # an integer: no fraction, no exponent
        fraction = f"(contains({x}, '.') OR contains({x}, 'e') OR contains({x}, 'E'))"
        numbers = ", ".join(map(str, _FIRST_CHARS[INT64]))
        rest = sorted(allowed - set(_FIRST_CHARS[INT64]))
        test = f"(ascii({x}) IN ({numbers}) AND NOT {fraction})"
        if rest:
            test = f"({test} OR ascii({x}) IN ({', '.join(map(str, rest))}))"
        return f"({x} IS NULL OR {test})"
    forbidden = sorted(_ALL_CHARS - allowed)
    if len(forbidden) < len(allowed):
        return f"({x} IS NULL OR ascii({x}) NOT IN ({', '.join(map(str, forbidden))}))"
    return f"({x} IS NULL OR ascii({x}) IN ({', '.join(map(str, sorted(allowed)))}))"


def as_text(f: Field) -> str:
    """The value as text: strings as themselves, timestamps in ISO 8601 (UTC), numbers and
    booleans as JSON writes them, objects and arrays as their JSON text."""
    if f.form == TEXT:
        return f.sql
    if f.form == TIMESTAMP:
        return f"strftime({f.sql}, {sql.lit(ISO_FORMAT)})"
    if f.form == RAW:
        return f"CASE WHEN ascii({f.sql}) = 34 THEN ({f.sql}::JSON)->>'$' ELSE {f.sql} END"
    return f"{f.sql}::VARCHAR"


def as_json(f: Field) -> str:
    """The value as JSON text."""
    if f.form == RAW:
        return f.sql
    if f.form in (TEXT, TIMESTAMP):
        return f"to_json({as_text(f)})::VARCHAR"
    return f"{f.sql}::VARCHAR"


def to_raw(f: Field) -> Field:
    """The same field in the ``json`` form."""
    if f.form == RAW:
        return f
    return Field(f.path, as_json(f), RAW, f.kinds)


def timestamp_of(text: str) -> str:
    """ISO 8601 text as TIMESTAMPTZ (NULL when it is not one)."""
    return f"COALESCE(TRY_CAST({text} AS TIMESTAMPTZ), TRY_CAST(upper({text}) AS TIMESTAMPTZ))"


def choose(condition: str, then: Field | None, otherwise: Field | None, path: Path) -> Field:
    """Per row ``then`` where ``condition`` holds, else ``otherwise`` (a missing one is null);
    forms that differ meet in ``json``."""
    sides = [f for f in (then, otherwise) if f is not None]
    kinds = frozenset().union(*(f.kinds for f in sides))
    forms = {f.form for f in sides}
    if len(forms) > 1:
        then = to_raw(then) if then is not None else None
        otherwise = to_raw(otherwise) if otherwise is not None else None
    form = next(iter(forms)) if len(forms) == 1 else RAW
    a = then.sql if then is not None else sql.NULL
    b = otherwise.sql if otherwise is not None else sql.NULL
    return Field(path, f"(CASE WHEN {condition} THEN {a} ELSE {b} END)", form, kinds)


def under(path: Path, prefix: Path) -> bool:
    """``path`` is ``prefix`` or below it."""
    return path[: len(prefix)] == prefix


def subtree(fields: Fields, prefix: Path) -> Fields:
    """The fields at or below ``prefix``, keyed by their path below it (``()`` for a leaf at
    ``prefix`` itself)."""
    return {p[len(prefix) :]: f for p, f in fields.items() if under(p, prefix)}


def any_present(fields: Fields) -> str:
    return sql.any_of(present(f) for f in fields.values())


def set_subtree(fields: Fields, prefix: Path, values: Fields, condition: str | None) -> Fields:
    """``fields`` with the subtree at ``prefix`` replaced by ``values`` (keyed by their path
    below ``prefix``) where ``condition`` holds (always when None), kept where it does not. A
    leaf above ``prefix`` (a value where an object now goes) is nulled where it is replaced."""
    old = subtree(fields, prefix)
    out: Fields = {}
    for p, f in fields.items():
        if under(p, prefix):
            continue
        if len(p) < len(prefix) and prefix[: len(p)] == p:  # a value above the new object
            if condition is None:
                continue
            out[p] = choose(condition, None, f, p)
            continue
        out[p] = f
    for rest in sorted(set(old) | set(values), key=lambda r: (len(r), r)):
        path = (*prefix, *rest)
        new, before = values.get(rest), old.get(rest)
        if condition is None:
            if new is not None:
                out[path] = new.at(path)
            continue
        out[path] = choose(condition, new, before, path)
    return out
