"""Benchmark of the operator console (issue 13): how long each page takes to render with 100,000
failed events in the failed store, 100,000 webhook messages in the state and 100,000 events on
the log, against references measured in the same run.

Run from the repository root::

    .venv/bin/python bench/console.py                  # 100,000 of each, 20 loads per page
    .venv/bin/python bench/console.py --quick          # 10,000 of each, 5 loads per page
    .venv/bin/python bench/console.py --format json    # the figures as JSON on stdout

The data is made first, in a temporary directory under ./data (or --dir):

* the failed store: ``--events`` failed events of three destinations, three steps and four
  error codes, appended in batches of 1,000 (as a pipeline's micro-batches append them), with a
  ~600-byte value and the original headers each;
* the webhook state (SQLite): ``--events`` messages from three sources to three receivers,
  a tenth of them FAILED (with an attempt), the rest DONE or waiting;
* the log: ``--events`` events on one topic of two partitions.

Then ``headwater console`` runs in a child process (the log read-only) and a logged-in client
loads each page ``--loads`` times, one at a time, request to the HTML's last byte: the overview,
the failed events (first page, by destination, by a rare code, deep in the store, the oldest by
id), the webhooks (all, FAILED, one source), destinations, live, transport, configuration. The
failed events pages read the console's in-memory index (``FailedIndex``); the first page after
the start waits for it to be built and is reported on its own line.

References, in the same run: ``GET /healthz`` from the same server (the HTTP round trip and
the framework, nothing read), and reading the whole failed store as ``headwater failed list``
does (``FailedStore.events``), which is what a console without paging would do per page.
The target (issue 13): every page under 300 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from statistics import median

from _common import (
    arguments,
    emit_json,
    machine_info,
    percentile,
    print_table,
    progress,
    scratch_directory,
)
from headwater.bus import Message, open_bus
from headwater.bus import context as ctx
from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.failed import FailedEvent, FailedStore, make_id
from headwater.webhooks.state import open_state
from headwater.webhooks.state.base import Attempt, Status

TOKEN = "bench-console-token"
TARGET_MS = 300.0
DESTINATIONS = ("warehouse", "postgres", "api")
STEPS = ("decode", "route", "write")
CODES = ("HW-PIPE-101", "HW-PIPE-201", "HW-DST-001", "HW-PIPE-999")
SOURCES = ("shop", "billing", "crm-sync")
RECEIVERS = ("crm", "erp", "mail")
BATCH = 1000


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = arguments(__doc__, quick="10,000 of each, 5 loads a page.", markdown=False, keep=False)
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--loads", type=int, default=20, help="Loads of each page.")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.loads = 10_000, 5
    return args


def write_config(directory: Path) -> Path:
    document = {
        "data_dir": str(directory / "data"),
        "bus": {"embedded": {"durability": "never"}},
        "console": {"admin_token_hashes": [hash_key(TOKEN)], "port": 0, "page_size": 50},
        "pipeline": {"destinations": [{"id": d, "type": "duckdb"} for d in DESTINATIONS]},
        "webhooks": {
            "sources": [{"id": s, "write_keys": [hash_key(f"{s}-key")]} for s in SOURCES],
            "receivers": [
                {"name": r, "url": f"http://127.0.0.1:9/{r}", "secret": "whsec_" + "A" * 44}
                for r in RECEIVERS
            ],
        },
    }
    path = directory / "headwater.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def failed_events(start: int, count: int, value: bytes) -> list[FailedEvent]:
    out = []
    for n in range(start, start + count):
        dest = DESTINATIONS[n % 3]
        code = CODES[3] if n % 997 == 0 else CODES[n % 3]
        seconds = n * 36_000 // max(1, count * 100)
        out.append(
            FailedEvent(
                id=make_id(dest, "events-track", n % 2, n),
                destination=dest,
                step=STEPS[n % 3],
                code=code,
                reason=f"event {n}: the value of /properties/price is not a number",
                topic="events-track",
                partition=n % 2,
                offset=n,
                failed_at=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1.79e9 + n))
                + f".{seconds % 1000:03d}Z",
                key=None,
                value=value,
                headers=((ctx.TYPE, b"track"), (ctx.SOURCE, b"web"), (ctx.EVENT_ID, b"e%d" % n)),
            )
        )
    return out


def make_data(config: HeadwaterConfig, events: int) -> dict[str, float]:
    """Fill the failed store, the webhook state and the log; seconds each took."""
    took: dict[str, float] = {}
    value = json.dumps({"type": "track", "event": "Bought", "properties": {"x": "y" * 520}})
    started = time.perf_counter()
    store = FailedStore(config)
    for start in range(0, events, BATCH):
        store.append(failed_events(start, min(BATCH, events - start), value.encode()))
    took["failed store"] = time.perf_counter() - started

    started = time.perf_counter()
    now = time.time() - events
    with open_state(config) as state:
        for start in range(0, events, BATCH):
            batch = [
                (SOURCES[n % 3], f"msg-{n}", RECEIVERS[n % 3], b'{"order": %d}' % n)
                for n in range(start, min(events, start + BATCH))
            ]
            state.arrive_many(batch, now + start)
        for n in range(0, events, 10):
            attempt = Attempt(now + n, "deliver", 400, 12.5, '{"error": "bad order"}')
            state.advance(
                SOURCES[n % 3],
                f"msg-{n}",
                Status.FAILED,
                now + n + 1,
                reason="the receiver answered 400",
                attempt=attempt,
            )
    took["webhook state"] = time.perf_counter() - started

    started = time.perf_counter()
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with open_bus(config) as bus:
        bus.create_topic("events-track", 2)
        headers = ((ctx.TYPE, b"track"), (ctx.SOURCE, b"web"), (ctx.PROTOCOL, b"segment"))
        for start in range(0, events, BATCH):
            bus.append(
                "events-track",
                [
                    Message(value.encode(), key=b"%d" % n, headers=headers)
                    for n in range(start, min(events, start + BATCH))
                ],
            ).result()
        bus.flush()
    took["log"] = time.perf_counter() - started
    return took


class ConsoleProcess:
    def __init__(self, config_path: Path) -> None:
        cmd = [sys.executable, "-m", "headwater.cli.main", "--config", str(config_path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}
        self.proc = subprocess.Popen(
            [*cmd, "console", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        self.url = ""
        for line in self.proc.stdout:
            if line.startswith("headwater: console at "):
                self.url = line.split(" at ", 1)[1].split("/ ", 1)[0].rstrip("/")
            if line.startswith("headwater: console ready"):
                break
        if not self.url:
            raise SystemExit("headwater console did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


def time_page(session: requests.Session, url: str, loads: int) -> list[float]:
    samples = []
    for _ in range(loads):
        started = time.perf_counter()
        answer = session.get(url, headers={"Accept": "text/html"})
        _ = answer.content
        samples.append((time.perf_counter() - started) * 1000)
        if answer.status_code != 200:
            raise SystemExit(f"{url}: {answer.status_code} {answer.text[:300]}")
    return sorted(samples)


def deep_cursor(session: requests.Session, base: str, pages: int) -> str:
    """The ``Older`` link ``pages`` pages down the failed events."""
    path = "/failed"
    for _ in range(pages):
        page = session.get(f"{base}{path}", headers={"Accept": "text/html"}).text
        path = page.split('rel="next" href="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    return path


def measure(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    config_path = write_config(directory)
    config = load_config(config_path)
    progress(f"making {args.events:,} failed events, webhook messages and log events")
    made = make_data(config, args.events)
    progress("reading the whole failed store, as `headwater failed list` does")
    started = time.perf_counter()
    everything = FailedStore(config).events()
    full_read_ms = (time.perf_counter() - started) * 1000
    assert len(everything) == args.events, len(everything)
    oldest = everything[0].id

    console = ConsoleProcess(config_path)
    try:
        session = requests.Session()
        session.headers["Origin"] = console.url
        login = session.post(f"{console.url}/login", data={"token": TOKEN}, allow_redirects=False)
        assert login.status_code == 303, login.text
        cold = time_page(session, f"{console.url}/failed", 1)[0]  # the index being built
        pages = [
            ("healthz (reference)", "/healthz"),
            ("overview", "/"),
            ("failed: first page", "/failed"),
            ("failed: one destination", "/failed?destination=postgres"),
            ("failed: a rare code", f"/failed?code={CODES[3]}"),
            ("failed: 20 pages down", deep_cursor(session, console.url, 20)),
            ("failed: the oldest event", f"/failed/event?id={oldest}"),
            ("webhooks: all", "/webhooks"),
            ("webhooks: FAILED", "/webhooks?status=FAILED"),
            ("webhooks: one source", "/webhooks?source=billing"),
            ("destinations", "/destinations"),
            ("live", "/live"),
            ("transport", "/transport"),
            ("configuration", "/config"),
        ]
        for _, path in pages[1:]:  # warm: templates compiled, modules imported
            session.get(f"{console.url}{path}", headers={"Accept": "text/html"})
        results = []
        for name, path in pages:
            progress(f"{name}: {args.loads} loads")
            samples = time_page(session, f"{console.url}{path}", args.loads)
            results.append(
                {
                    "page": name,
                    "path": path,
                    "p50_ms": median(samples),
                    "p95_ms": percentile(samples, 95),
                    "max_ms": samples[-1],
                }
            )
    finally:
        console.stop()
    return {
        "events": args.events,
        "loads": args.loads,
        "made_s": made,
        "full_store_read_ms": full_read_ms,
        "first_failed_page_after_start_ms": cold,
        "pages": results,
        "machine": machine_info(directory),
    }


def report(result: dict[str, Any]) -> None:
    health = result["pages"][0]["p50_ms"]
    full = result["full_store_read_ms"]
    rows = [
        [
            p["page"],
            *(f"{p[k]:.1f}" for k in ("p50_ms", "p95_ms", "max_ms")),
            f"{p['p50_ms'] / health:.1f}",
            f"{p['max_ms'] / full:.3f}",
            "yes" if p["max_ms"] < TARGET_MS else "NO",
        ]
        for p in result["pages"]
    ]
    print(
        f"{result['events']:,} failed events, webhook messages and log events; "
        f"{result['loads']} loads a page"
    )
    print(f"reference: the whole failed store read as `failed list` does: {full:,.0f} ms")
    print(
        "the first failed-events page after the console started (its index built then): "
        f"{result['first_failed_page_after_start_ms']:,.0f} ms"
    )
    headers = ["page", "p50 ms", "p95 ms", "max ms", "x healthz", "max / full read", "< 300 ms"]
    print(print_table(headers, rows))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with scratch_directory(args.dir, "bench-console-") as directory:
        result = measure(args, directory)
    if args.format == "json":
        emit_json(result)
    else:
        report(result)
    return 0 if all(p["max_ms"] < TARGET_MS for p in result["pages"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
