"""End to end: events sent to a running collector over the Raccoon WebSocket and through the
Segment SDK land as rows in DuckDB and PostgreSQL, with the expected columns and types, in batch
mode (``run_once``: Trigger.AvailableNow) and in stream mode (a processing-time trigger).

The collector runs in this process on the embedded log (it holds the write lock); Spark's Python
workers read the log read-only, as ``headwater up`` does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pytest
from segment.analytics import Client
from websockets.asyncio.client import connect as ws_connect

from headwater.bus import open_bus
from headwater.collector.auth import hash_key
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.runner import Pipeline
from headwater.testing.clients import raccoon_request, raccoon_response
from headwater.testing.collector import RunningCollector, running_collector

KEY = "e2e-write-key"
TIMEOUT_S = 60.0


def make_config(tmp_path: Path, dest: dict[str, Any]) -> HeadwaterConfig:
    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "bus": {"embedded": {"default_partitions": 2}},
            "collector": {"sources": [{"id": "web", "write_keys": [hash_key(KEY)]}]},
            "pipeline": {"destinations": [dest]},
        }
    )


def send_raccoon(server: RunningCollector, n: int) -> None:
    """``n`` page events as JSON in Raccoon event bytes, in requests of 10."""

    async def go() -> None:
        async with ws_connect(server.ws_url, additional_headers={"X-User-ID": "e2e"}) as ws:
            for r in range(n // 10):
                events = [
                    (
                        "page",
                        json.dumps(
                            {
                                "page_id": r * 10 + i,
                                "url": f"https://example.com/p/{r * 10 + i}",
                                "ratio": 0.5 + i,
                                "visible": i % 2 == 0,
                                "viewport": {"w": 1280, "h": 720},
                            }
                        ).encode(),
                    )
                    for i in range(10)
                ]
                await ws.send(raccoon_request(f"req-{r}", events))
                answer = raccoon_response(await asyncio.wait_for(ws.recv(), 10))
                assert answer.status == 1, answer.reason

    asyncio.run(go())


def send_segment(server: RunningCollector, n: int) -> None:
    client = Client(KEY, host=server.url, sync_mode=True, timeout=10, max_retries=0)
    for i in range(n):
        ok, _ = client.track(
            f"user-{i % 3}",
            "Order Completed",
            {"order": i, "total": 10.25 + i, "coupon": None, "items": [{"sku": "A", "qty": i}]},
            message_id=f"m-{i}",
        )
        assert ok


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Warehouse:
    """Reads the destination's rows back (after the pipeline closed it)."""

    def __init__(self, config: HeadwaterConfig, kind: str, dsn: str | None) -> None:
        self.config, self.kind, self.dsn = config, kind, dsn

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.kind == "duckdb":
            with closing(duckdb.connect(str(self.config.warehouse_path()), read_only=True)) as c:
                return c.execute(sql).fetchall()
        with psycopg.connect(self.dsn) as c:
            return c.execute(sql).fetchall()

    def columns(self, table: str) -> dict[str, str]:
        rows = self.query(
            "select column_name, data_type from information_schema.columns "
            f"where table_name = '{table}'"
        )
        return {name: str(kind).lower() for name, kind in rows}


@pytest.fixture(params=["duckdb", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dsn(kind: str, request: pytest.FixtureRequest) -> Iterator[str | None]:
    if kind != "postgres":
        yield None
        return
    service = request.getfixturevalue("postgres_service")
    name = f"e2e_{request.node.name.split('[')[0][-20:]}_{time.monotonic_ns() % 10**8}"
    yield service.fresh_database(name)


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_events_from_the_collector_land_as_typed_rows(
    spark: Any, tmp_path: Path, kind: str, dsn: str | None, mode: str
) -> None:
    dest: dict[str, Any] = {
        "id": "wh",
        "type": kind,
        "mode": mode,
        "trigger_interval_s": 0.5,
        "table_name_template": "{{ event_type }}",
    }
    if dsn:
        dest["dsn"] = dsn
    config = make_config(tmp_path, dest)
    bus = open_bus(config)
    pipeline = Pipeline(config, spark)
    try:
        with running_collector(bus, config.collector) as server:
            if mode == "stream":
                pipeline.start()
            send_raccoon(server, 40)
            send_segment(server, 5)
            if mode == "batch":
                pipeline.run_once()
            writer = pipeline.queries[0].writer
            wait_for(lambda: writer.written >= 45, "45 rows written")
            assert writer.failed_events == 0
    finally:
        pipeline.stop()
        bus.close()

    wh = Warehouse(config, kind, dsn)
    pages = wh.columns("page")
    assert {
        "page_id": "bigint",
        "url": wh_text(kind),
        "ratio": wh_float(kind),
        "visible": "boolean",
        "viewport_w": "bigint",
        "viewport_h": "bigint",
        "src": wh_text(kind),
        "eventn_ctx_event_id": wh_text(kind),
    }.items() <= pages.items()
    assert pages["_timestamp"].startswith("timestamp")
    rows = wh.query("select page_id, url, ratio, visible, viewport_w, src from page order by 1")
    assert rows == [
        (i, f"https://example.com/p/{i}", 0.5 + i % 10, i % 2 == 0, 1280, "raccoon-ws")
        for i in range(40)
    ]
    assert wh.query("select count(distinct eventn_ctx_event_id) from page") == [(40,)]

    track = wh.columns("track")
    expected = {"event": wh_text(kind), "properties_order": "bigint", "userid": wh_text(kind)}
    assert expected.items() <= track.items()
    # arrays are stored as JSON text; nulls are not columns of their own type
    assert track["properties_items"] == wh_text(kind)
    rows = wh.query("select messageid, properties_total, properties_items from track order by 1")
    assert [(r[0], float(r[1]), json.loads(r[2])) for r in rows] == [
        (f"m-{i}", 10.25 + i, [{"sku": "A", "qty": i}]) for i in range(5)
    ]


def wh_text(kind: str) -> str:
    return {"duckdb": "varchar", "postgres": "text"}[kind]


def wh_float(kind: str) -> str:
    return {"duckdb": "double", "postgres": "numeric"}[kind]
