"""Benchmark of the data contracts' validator: events/s of ``jsonschema-rs``, ``fastjsonschema``
and the reference ``jsonschema`` on the same Segment-style track events and schema, and of
headwater's ``Contracts`` (``headwater.pipeline.contracts``) built on the one chosen.

Run from the repository root::

    .venv/bin/python bench/contracts.py                  # 200,000 events, ~2 min
    .venv/bin/python bench/contracts.py --quick          # 20,000 events, a smoke run
    .venv/bin/python bench/contracts.py --format json    # the figures as JSON on stdout

The events: ``--events`` track events (``signup``) with context, traits and a list of products;
one in ``--invalid-every`` breaks the schema three ways (an enum, an email format, and a
product's price of the wrong type inside the array). The schema (draft 2020-12; draft-07 for
fastjsonschema, which knows no later draft, with the same keywords): required fields, types,
formats (date-time, email, uri), enums, nested objects and array items, a ``$defs`` reference.

Each validator judges the valid events, then the violating ones, in one process, one after the
other, events already parsed (dicts):

* ``jsonschema-rs``: ``is_valid``, and ``iter_errors`` on the violating events (all reported);
* ``fastjsonschema``: the compiled function, first error (``fast_fail``, the default), and
  every error (``fast_fail=False``, new in 2.22: JsonSchemaValuesException);
* ``jsonschema``: ``iter_errors`` with its format checker, on ``--reference-events`` (it is
  ~100x slower);
* ``Contracts.check`` (dicts) and ``Contracts.check_many`` (JSON text: parsing included): what
  the pipeline's tasks run, verdicts and violations built.

Figures of one run (``python bench/contracts.py``, 200,000 events: 180,000 valid, 20,000
violating; jsonschema on 5,000 of each) on the development VM, 2 cores shared with other work:
events/s, and violations reported of the 3 in each violating event. Across three runs the
jsonschema-rs valid case ranged 315,000 to 465,000/s and fastjsonschema's 40,000 to 54,000/s.

| validator                          | valid ev/s | violating ev/s | reported |
|------------------------------------|-----------:|---------------:|---------:|
| jsonschema-rs 0.61                 |    315,000 |         50,600 |   3 of 3 |
| fastjsonschema 2.22, first error   |     39,900 |        103,000 |   1 of 3 |
| fastjsonschema 2.22, every error   |     52,200 |         35,600 |   3 of 3 |
| jsonschema 4.26 (reference)        |      3,800 |          3,240 |   3 of 3 |
| Contracts.check (jsonschema-rs)    |    453,000 |         48,900 |   3 of 3 |
| Contracts.check_many (JSON parsed) |    222,000 |         43,600 |   3 of 3 |

The choice: ``jsonschema-rs``. On valid events, the common case, it is 6 to 9 times
fastjsonschema and ~100 times jsonschema; on violating events it reports every violation faster
than fastjsonschema's ``fast_fail=False`` (fastjsonschema's default stops at the first one). It
implements draft 2020-12, where fastjsonschema implements drafts 4, 6 and 7 only
(``prefixItems``, ``unevaluatedProperties``, ``dependentRequired`` are not applied), gives each
violation's instance path as parts and the keyword by name (fastjsonschema's paths are text,
``data.a[1]``), bundles a ``$ref`` to another file offline, and runs no generated Python.
``check_many`` is ``orjson.loads`` and ``check`` per text: parsing costs about as much as judging
a valid event. This is not a test: it always exits 0 unless it fails.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from _common import arguments, machine_info, machine_line, output, print_table, progress
from headwater.pipeline.contracts import Contracts

PLANS = ["free", "pro", "team", "enterprise"]
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def track_schema(draft: str) -> dict[str, Any]:
    """A Segment-style track event's contract: required, types, formats, enums, nesting."""
    defs = "$defs" if draft == DRAFT_2020_12 else "definitions"
    product = {
        "type": "object",
        "required": ["sku", "price", "quantity"],
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0},
            "quantity": {"type": "integer", "minimum": 1},
            "category": {"type": "string", "maxLength": 40},
        },
    }
    return {
        "$schema": draft,
        defs: {"product": product},
        "type": "object",
        "required": ["type", "event", "messageId", "timestamp", "userId", "properties"],
        "properties": {
            "type": {"const": "track"},
            "event": {"const": "signup"},
            "messageId": {"type": "string", "minLength": 8},
            "timestamp": {"type": "string", "format": "date-time"},
            "userId": {"type": "string"},
            "anonymousId": {"type": "string"},
            "context": {
                "type": "object",
                "properties": {
                    "ip": {"type": "string", "format": "ipv4"},
                    "userAgent": {"type": "string"},
                    "page": {
                        "type": "object",
                        "required": ["url"],
                        "properties": {
                            "url": {"type": "string", "format": "uri"},
                            "title": {"type": "string"},
                        },
                    },
                    "traits": {
                        "type": "object",
                        "properties": {
                            "email": {"type": "string", "format": "email"},
                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        },
                    },
                },
            },
            "properties": {
                "type": "object",
                "required": ["plan", "products"],
                "properties": {
                    "plan": {"enum": PLANS},
                    "trial": {"type": "boolean"},
                    "revenue": {"type": "number", "minimum": 0},
                    "products": {
                        "type": "array",
                        "maxItems": 50,
                        "items": {"$ref": f"#/{defs}/product"},
                    },
                },
            },
        },
    }


def make_events(n: int, invalid_every: int, seed: int = 7) -> tuple[list[dict], list[dict]]:
    """``n`` track events: (the valid ones, the violating ones)."""
    rnd = random.Random(seed)
    valid, invalid = [], []
    for i in range(n):
        products = [
            {
                "sku": f"ABC-{rnd.randrange(10_000):04d}",
                "price": round(rnd.uniform(1, 200), 2),
                "quantity": rnd.randint(1, 5),
                "category": rnd.choice(["books", "games", "tools"]),
            }
            for _ in range(rnd.randint(1, 4))
        ]
        event = {
            "type": "track",
            "event": "signup",
            "messageId": f"msg-{i:012d}",
            "timestamp": f"2026-11-{1 + i % 28:02d}T12:{i % 60:02d}:05.123Z",
            "userId": f"user-{rnd.randrange(100_000)}",
            "anonymousId": f"anon-{rnd.randrange(1_000_000)}",
            "context": {
                "ip": f"10.{i % 256}.{(i // 256) % 256}.{rnd.randrange(256)}",
                "userAgent": "Mozilla/5.0 (X11; Linux x86_64) Firefox/128.0",
                "page": {"url": f"https://shop.example/p/{i % 997}", "title": "Sign up"},
                "traits": {"email": f"user{i}@example.com", "age": rnd.randint(18, 90)},
            },
            "properties": {
                "plan": rnd.choice(PLANS),
                "trial": rnd.random() < 0.5,
                "revenue": round(rnd.uniform(0, 500), 2),
                "products": products,
            },
        }
        if invalid_every and i % invalid_every == 0:
            event["properties"]["plan"] = "gold"
            event["context"]["traits"]["email"] = "not an email"
            products[-1]["price"] = "12.50"
            invalid.append(event)
        else:
            valid.append(event)
    return valid, invalid


@dataclass
class Figure:
    validator: str
    case: str  # valid | violating
    events: int
    seconds: float
    violations_per_event: float  # violations reported, per event

    @property
    def per_s(self) -> float:
        return self.events / self.seconds if self.seconds else float("nan")


def timed(events: Sequence[Any], judge: Callable[[Any], int]) -> tuple[float, float]:
    """Seconds to judge every event, and the violations reported per event."""
    found = 0
    started = time.perf_counter()
    for e in events:
        found += judge(e)
    seconds = time.perf_counter() - started
    return seconds, found / max(len(events), 1)


def judges() -> dict[str, tuple[Callable[[Any], int], Callable[[Any], int]]]:
    """Each validator's (valid-case, violating-case) judge: the number of violations found."""
    import fastjsonschema
    import jsonschema
    import jsonschema_rs

    rs = jsonschema_rs.Draft202012Validator(track_schema(DRAFT_2020_12), validate_formats=True)
    fast_first = fastjsonschema.compile(track_schema(DRAFT_07))
    fast_every = fastjsonschema.compile(track_schema(DRAFT_07), fast_fail=False)
    ref = jsonschema.Draft202012Validator(
        track_schema(DRAFT_2020_12), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )

    def rs_all(e: Any) -> int:
        return 0 if rs.is_valid(e) else sum(1 for _ in rs.iter_errors(e))

    def fast(fn: Callable[[Any], Any]) -> Callable[[Any], int]:
        def judge(e: Any) -> int:
            try:
                fn(e)
            except fastjsonschema.JsonSchemaValuesException as exc:
                return len(exc.errors)
            except fastjsonschema.JsonSchemaValueException:
                return 1
            return 0

        return judge

    def ref_all(e: Any) -> int:
        return sum(1 for _ in ref.iter_errors(e))

    return {
        "jsonschema-rs": (rs_all, rs_all),
        "fastjsonschema, first error": (fast(fast_first), fast(fast_first)),
        "fastjsonschema, every error": (fast(fast_every), fast(fast_every)),
        "jsonschema (reference)": (ref_all, ref_all),
    }


def contracts_under_test() -> Contracts:
    schema = track_schema(DRAFT_2020_12)
    spec = {
        "contracts": {
            "signup": {
                "label": "signup/1-0-0",
                "mode": "enforce",
                "schema": schema,
                "base_uri": "file:///bench/signup/1-0-0.json",
            }
        },
        "unknown": "reject",
    }
    return Contracts.compile(spec)


def measure(events: int, invalid_every: int, reference_events: int) -> dict[str, Any]:
    progress(f"making {events:,} events")
    valid, invalid = make_events(events, invalid_every)
    gc.collect()
    gc.freeze()  # the workload's millions of objects are not the collector's to scan each time
    figures: list[Figure] = []
    for name, (on_valid, on_invalid) in judges().items():
        limit = reference_events if name.startswith("jsonschema (") else events
        for case, sample, judge in (("valid", valid, on_valid), ("violating", invalid, on_invalid)):
            sample = sample[:limit]
            progress(f"{name}: {len(sample):,} {case} events")
            seconds, per_event = timed(sample, judge)
            figures.append(Figure(name, case, len(sample), seconds, per_event))

    contracts = contracts_under_test()
    for case, sample in (("valid", valid), ("violating", invalid)):
        progress(f"Contracts.check: {len(sample):,} {case} events")
        seconds, per_event = timed(sample, lambda e: len(contracts.check("signup", e).violations))
        figures.append(Figure("Contracts.check", case, len(sample), seconds, per_event))
        texts = [orjson.dumps(e).decode() for e in sample]
        types: list[str | None] = ["signup"] * len(texts)
        gc.freeze()
        started = time.perf_counter()
        verdicts = contracts.check_many(types, texts)
        seconds = time.perf_counter() - started
        found = sum(len(v.violations) for v in verdicts) / max(len(verdicts), 1)
        figures.append(Figure("Contracts.check_many (+parse)", case, len(texts), seconds, found))
    return {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(Path.cwd()),
        "workload": {
            "events": events,
            "valid": len(valid),
            "violating": len(invalid),
            "violations_in_each_violating_event": 3,
            "reference_events": reference_events,
            "event_bytes": sum(len(orjson.dumps(e)) for e in valid[:1000]) / min(len(valid), 1000),
        },
        "figures": [{**asdict(f), "per_s": f.per_s} for f in figures],
    }


def report(result: dict[str, Any], markdown: bool) -> str:
    figures = result["figures"]
    base = {f["case"]: f["per_s"] for f in figures if f["validator"] == "jsonschema-rs"}
    rows = [
        [
            f["validator"],
            f["case"],
            f"{f['events']:,}",
            f"{f['per_s']:,.0f}",
            f"{f['per_s'] / base[f['case']]:.2f}",
            f"{f['violations_per_event']:.2f}",
        ]
        for f in figures
    ]
    headers = ["validator", "case", "events", "events/s", "x jsonschema-rs", "violations/event"]
    w = result["workload"]
    return "\n".join(
        [
            machine_line(result["machine"]),
            f"{w['events']:,} track events of ~{w['event_bytes']:.0f} bytes as JSON: "
            f"{w['valid']:,} valid, {w['violating']:,} violating (3 violations each); "
            f"jsonschema on the first {w['reference_events']:,} of each",
            "",
            print_table(headers, rows, markdown=markdown),
            "",
            "violations/event on the violating events: how many of the 3 each reported.",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments(__doc__, quick="20,000 events", keep=False)
    parser.add_argument("--events", type=int, default=None, help="events (default 200,000)")
    parser.add_argument(
        "--invalid-every", type=int, default=10, help="one event in N violates (default 10)"
    )
    parser.add_argument(
        "--reference-events",
        type=int,
        default=5_000,
        help="events of each case jsonschema judges (default 5,000)",
    )
    args = parser.parse_args(argv)
    events = args.events or (20_000 if args.quick else 200_000)
    result = measure(events, args.invalid_every, args.reference_events)
    output(args.format, lambda: result, lambda markdown: report(result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
