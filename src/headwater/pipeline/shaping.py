"""The steps that run in Python before a task's query: data contracts, then Python functions.

They see each event as the client sent it (the JSON object of the record's value, or its
protobuf payload decoded), before the query's steps (decode, context, enrichments, the SQL
functions, routing, mapping, typing), and they change what the query reads:

- **contracts** (``headwater.pipeline.contracts``): the event's type names its JSON Schema; an
  event that breaks an ``enforce`` contract (or has no contract where ``"*"`` is ``reject``)
  fails with every violation (step ``contract``, ``HW-PIPE-501``); under ``warn`` it goes on with
  the violations in its ``_hw_violations`` field;
- **Python functions** (``{name: python, function: "module:function"}``), in order: each gets
  the event (a dict) and, if it takes a second argument, the record's context (event id, type,
  receive time, source, client IP, user agent); it returns the event (changed or not), ``None``
  (the event is dropped, counted), or a list of events (one event becomes several: each gets an
  event id derived from the record's, stable, so a replayed batch makes the same rows). A
  function that raises, or returns anything else, fails the event (step ``function``,
  ``HW-PIPE-511``) with the function's name and the exception, and the failed store keeps the
  original record: ``headwater failed replay`` runs it again once the function is fixed.

Per Arrow batch of the task's input this module parses only the events it has to (every event
when any step is configured), and builds the query's input again with ``take`` over the rows
kept (a row per event made, pointing at its record: ``Shaped.origin``) and the changed events'
JSON as their text. Records that are not a JSON object are left as they are: the decode step
fails them, or keeps them as bytes, as it would without these steps.
"""

from __future__ import annotations

import functools
import inspect
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from headwater.bus import context
from headwater.pipeline import contracts as _contracts
from headwater.pipeline.columns import PROTO_JSON, SHAPE_ERROR, UTF8, header

CONTRACT_STEP = "contract"
CONTRACT_BROKEN = "HW-PIPE-501"
FUNCTION_STEP = "function"
FUNCTION_FAILED = "HW-PIPE-511"
VIOLATIONS = "_hw_violations"
HEADERS = (context.TYPE, context.EVENT_ID, context.CONTENT_TYPE)
CONTEXT_HEADERS = {
    "event_id": context.EVENT_ID,
    "type": context.TYPE,
    "received_at": context.RECEIVED_AT,
    "source": context.SOURCE,
    "source_ip": context.CLIENT_IP,
    "user_agent": context.USER_AGENT,
    "protocol": context.PROTOCOL,
}
_DERIVED = uuid.UUID("8a4c2f61-3d0e-4a57-9b1c-6f2e5d7a9c03")  # namespace of derived event ids
_ERROR_TYPE = pa.struct([("step", pa.string()), ("code", pa.string()), ("reason", pa.string())])
_JSON = "application/json"


def spec(
    functions: Sequence[str], contracts: Mapping[str, Any] | None, path: Sequence[str]
) -> dict:
    """The shaping a program carries: Python function paths, the contracts' spec (schemas
    inline), and the folders their modules are imported from."""
    return {"python": list(functions), "contracts": contracts or {}, "path": list(path)}


def import_roots(functions: Sequence[str]) -> list[str]:
    """The folders the Python functions' modules were imported from, when not from an installed
    package (a module beside the config): the tasks' workers import them from there too."""
    roots = []
    for path in functions:
        module = sys.modules.get(path.partition(":")[0])
        file = getattr(module, "__file__", None)
        if module is None or file is None or "site-packages" in file:
            continue
        root = Path(file).resolve().parent
        for _ in range(module.__name__.count(".") + (Path(file).name == "__init__.py")):
            root = root.parent
        if str(root) not in roots:
            roots.append(str(root))
    return roots


def headers_read(shaping: Mapping[str, Any]) -> tuple[str, ...]:
    """The record headers these steps read."""
    if not shaping.get("python") and not shaping.get("contracts"):
        return ()
    return tuple(sorted({*HEADERS, *CONTEXT_HEADERS.values()}))


@dataclass
class Shaped:
    """The query's input after these steps, and which record each of its rows came from."""

    table: pa.Table
    origin: np.ndarray  # row -> the source row it came from
    dropped: int = 0  # events a function dropped
    derived: int = 0  # events made by a function beyond one per record
    index: np.ndarray | None = None  # row -> which of its record's events it is (-1: the only)


@dataclass
class _Out:
    rows: list[int] = field(default_factory=list)  # source row of each output row
    texts: list[bytes | None] = field(default_factory=list)  # new JSON (None: as it was)
    ids: list[str | None] = field(default_factory=list)  # new event id (None: as it was)
    errors: list[tuple[str, str, str] | None] = field(default_factory=list)
    one_each: bool = False  # a row per record, in order
    made: dict[int, int] = field(default_factory=dict)  # row -> k: the record's k-th event

    def add(
        self,
        row: int,
        text: bytes | None = None,
        event_id: str | None = None,
        error: tuple[str, str, str] | None = None,
    ) -> None:
        self.rows.append(row)
        self.texts.append(text)
        self.ids.append(event_id)
        self.errors.append(error)


class Shaper:
    """The configured steps, loaded once per Python worker (``for_spec``)."""

    def __init__(self, shaping: Mapping[str, Any]) -> None:
        for folder in shaping.get("path", []):
            if folder not in sys.path:
                sys.path.append(folder)
        self.functions = [_Function(p) for p in shaping.get("python", [])]
        self.contracts: Any = None
        if shaping.get("contracts"):
            self.contracts = _contracts.Contracts.compile(shaping["contracts"])

    @classmethod
    def for_spec(cls, text: str) -> Shaper:
        return _shaper(text)

    def shape(self, table: pa.Table) -> Shaped:
        """``table`` (the query's input, one row per record) after the steps."""
        texts = _event_texts(table)
        contracts, functions = self.contracts, self.functions
        with_context = any(fn.takes_context for fn in functions)
        wanted = [context.TYPE, context.EVENT_ID]
        if with_context:
            wanted = list(CONTEXT_HEADERS.values())
        elif contracts is not None and contracts.by_source:
            wanted.append(context.SOURCE)
        cols = {name: table.column(header(name)).to_pylist() for name in wanted}
        types, ids = cols[context.TYPE], cols[context.EVENT_ID]
        sources = cols.get(context.SOURCE) or [None] * len(texts)
        out = _Out()
        rows, new_texts, new_ids, errors = out.rows, out.texts, out.ids, out.errors
        dropped = derived = 0
        for i, (text, source) in enumerate(zip(texts, sources, strict=True)):
            event = _object(text)
            if event is None:  # not a JSON object: decode's to judge
                rows.append(i), new_texts.append(None), new_ids.append(None), errors.append(None)
                continue
            changed = False
            failure: tuple[str, str, str] | None = None
            if contracts is not None:
                kind = _contracts.event_type_of(event, types[i])
                verdict = contracts.check(kind, event, source)
                if verdict.action == "reject":
                    failure = (CONTRACT_STEP, CONTRACT_BROKEN, _contracts.reason(verdict))
                elif verdict.action == "warn":
                    event[VIOLATIONS] = _contracts.violations_json(verdict)
                    changed = True
            events = [event]
            if functions and failure is None:
                ctx = {k: cols[h][i] for k, h in CONTEXT_HEADERS.items()} if with_context else {}
                for fn in functions:
                    try:
                        if len(events) == 1:  # the usual case, without a list made per call
                            got = fn.call(events[0], ctx)
                            events = [got] if type(got) is dict else fn.events(got)
                        else:
                            made: list[dict[str, Any]] = []
                            for e in events:
                                made += fn.events(fn.call(e, ctx))
                            events = made
                    except Exception as exc:
                        failure = (FUNCTION_STEP, FUNCTION_FAILED, fn.failed(exc))
                        break
                    changed = True
            if failure is not None:
                rows.append(i), new_texts.append(None), new_ids.append(None), errors.append(failure)
            elif not events:
                dropped += 1
            elif len(events) == 1:
                rows.append(i), new_ids.append(None), errors.append(None)
                new_texts.append(_dump(events[0]) if changed else None)
            else:
                derived += len(events) - 1
                for k, e in enumerate(events):
                    out.made[len(rows)] = k
                    out.add(i, _dump(e), derived_id(ids[i] or "", k))
        out.one_each = not dropped and not derived
        index = None
        if out.made:
            index = np.full(len(rows), -1, dtype=np.int32)
            index[list(out.made)] = list(out.made.values())
        origin = np.asarray(rows, dtype=np.int64)
        return Shaped(_rebuild(table, out), origin, dropped, derived, index)


def derived_id(event_id: str, index: int) -> str:
    """The id of the ``index``-th event a function made of the event ``event_id``: a UUID of
    both, the same every time."""
    return str(uuid.uuid5(_DERIVED, f"{event_id}/{index}"))


class _Function:
    """A Python function of the config, called as it declares: ``fn(event)`` or
    ``fn(event, context)``; what it gives back is checked."""

    def __init__(self, path: str) -> None:
        from headwater.transport.functions import load_function

        self.path = path
        self.fn: Callable[..., Any] = load_function(path)
        try:
            params = inspect.signature(self.fn).parameters.values()
            positional = [
                p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            self.takes_context = len(positional) >= 2 or any(
                p.kind == p.VAR_POSITIONAL for p in params
            )
        except (TypeError, ValueError):  # a builtin without a signature: one argument
            self.takes_context = False

    def call(self, event: dict[str, Any], ctx: dict[str, Any]) -> Any:
        return self.fn(event, ctx) if self.takes_context else self.fn(event)

    @staticmethod
    def events(got: Any) -> list[dict[str, Any]]:
        """What a function returned as the events it made (``TypeError`` for anything else)."""
        if got is None:
            return []
        if isinstance(got, dict):
            return [got]
        if isinstance(got, list) and all(isinstance(e, dict) for e in got):
            return got
        raise TypeError(
            f"returned {type(got).__name__}: a function returns an event (a dict), None, or a "
            "list of events"
        )

    def failed(self, exc: BaseException) -> str:
        return f"function python {self.path} raised {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=8)
def _shaper(text: str) -> Shaper:
    return Shaper(orjson.loads(text))


def _event_texts(table: pa.Table) -> list[str | None]:
    """Each record's event as the decode step reads it: the protobuf payload's JSON when it has
    one, else its value as text."""
    texts = table.column(UTF8)
    if PROTO_JSON in table.column_names:
        import pyarrow.compute as pc

        texts = pc.coalesce(table.column(PROTO_JSON), texts)
    return texts.to_pylist()


def _object(text: str | None) -> dict[str, Any] | None:
    if not text or (text[0] != "{" and text.lstrip()[:1] != "{"):
        return None
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def _dump(event: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(event)
    except TypeError:  # a value orjson does not know (a set, a Decimal...): as text
        return orjson.dumps(event, default=str)


def _rebuild(table: pa.Table, out: _Out) -> pa.Table:
    """``table``'s rows ``out.rows`` (repeated or left out), with the new texts, event ids and
    errors set."""
    import pyarrow.compute as pc

    same = len(out.rows) == table.num_rows and all(
        r == i and t is None and e is None
        for i, (r, t, e) in enumerate(zip(out.rows, out.texts, out.errors, strict=True))
    )
    if same:
        return table.append_column(SHAPE_ERROR, pa.nulls(table.num_rows, _ERROR_TYPE))
    # a row per record, in order: nothing to take
    taken = table if out.one_each else table.take(pa.array(out.rows, pa.int64()))
    # orjson's bytes are UTF-8: as binary, then cast (checked at once; 10x faster than as text)
    new_text = pa.array(out.texts, pa.binary()).cast(pa.string())
    changed = pc.is_valid(new_text)
    columns = {name: taken.column(name) for name in taken.column_names}
    columns[UTF8] = pc.if_else(changed, new_text, taken.column(UTF8))
    if PROTO_JSON in columns:
        columns[PROTO_JSON] = pc.if_else(changed, new_text, taken.column(PROTO_JSON))
    kind = header(context.CONTENT_TYPE)
    columns[kind] = pc.if_else(changed, pa.scalar(_JSON), taken.column(kind))
    ids = header(context.EVENT_ID)
    columns[ids] = pc.coalesce(pa.array(out.ids, pa.string()), taken.column(ids))
    errors = [
        None if e is None else dict(zip(("step", "code", "reason"), e, strict=True))
        for e in out.errors
    ]
    columns[SHAPE_ERROR] = pa.array(errors, _ERROR_TYPE)
    return pa.table(columns)
