"""The console in a real browser (Debian's Chromium through Playwright) against ``headwater up``
(collector, pipeline on the test session's Spark, DuckDB, webhook workers, console): log in,
watch a live event arrive, replay failed events and see them land in DuckDB, resend a failed
webhook, and be refused without the token. Each page is saved under docs/console/.

The failed events come first from a run with a broken table template (as in
tests/pipeline/test_replay.py); the operator fixes the template and starts headwater again,
then replays them from the console."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pytest
import yaml

from headwater.collector.auth import hash_key
from headwater.config.loader import load_config
from headwater.config.model import HeadwaterConfig
from headwater.pipeline.failed import FailedStore
from headwater.pipeline.runner import Pipeline
from headwater.testing.browser import screenshot
from headwater.testing.waiting import wait_until
from headwater.testing.webhooks import (
    Reply,
    RunningHeadwater,
    post_json,
    running_headwater,
    running_receiver,
)
from headwater.webhooks.state import Status, open_state

if TYPE_CHECKING:
    from playwright.sync_api import Page

TOKEN = "console-admin-token"
WRITE_KEY = "web-write-key"
SECRET = "whsec_" + base64.b64encode(b"b" * 32).decode()
AUTH = {"authorization": f"Bearer {WRITE_KEY}"}
DEADLINE_S = 60.0


def write_config(path: Path, template: str, receiver_url: str) -> HeadwaterConfig:
    document: dict[str, Any] = {
        "data_dir": str(path.parent / "data"),
        "bus": {"embedded": {"durability": "never"}},
        "collector": {
            "port": 0,
            "grpc_port": None,
            "sources": [{"id": "web", "write_keys": [hash_key(WRITE_KEY)]}],
        },
        "console": {"admin_token_hashes": [hash_key(TOKEN)], "port": 0, "sample_interval_s": 1},
        "pipeline": {
            "destinations": [
                {
                    "id": "warehouse",
                    "type": "duckdb",
                    "table_name_template": template,
                    "mode": "stream",
                    "trigger_interval_s": 0.5,
                }
            ]
        },
        "webhooks": {
            "sources": [{"id": "shop", "write_keys": [hash_key(WRITE_KEY)]}],
            "receivers": [
                {"name": "crm", "url": receiver_url, "secret": SECRET, "retry_schedule_s": [0.2]}
            ],
        },
    }
    path.write_text(yaml.safe_dump(document))
    return load_config(path)


def send_events(url: str, events: list[dict[str, Any]]) -> None:
    batch = [
        {"type": "track", "event": "Bought", "userId": "u1", "messageId": f"m-{e['n']}", **e}
        for e in events
    ]
    status, answer = post_json(f"{url}/v1/batch", {"batch": batch}, AUTH)
    assert status == 200, answer


def rows(config: HeadwaterConfig, sql: str) -> list[tuple[Any, ...]]:
    """Read as the pipeline in this process writes: with a connection configured like its
    (DuckDB shares one database between them; a read-only one would fail its next batch)."""
    try:
        with duckdb.connect(str(config.warehouse_path())) as con:
            return con.execute(sql).fetchall()
    except duckdb.CatalogException:
        return []  # no such table yet


@pytest.fixture(scope="module")
def receiver() -> Iterator[Any]:
    # the first delivery of each message is refused for good (400: FAILED), then accepted
    def script(n: int, _: Any) -> Reply:
        return Reply(400, b'{"error": "bad order"}') if n == 0 else Reply(200, b'{"ok": true}')

    with running_receiver(SECRET, script) as running:
        yield running


@pytest.fixture(scope="module")
def headwater(
    spark: Any, tmp_path_factory: pytest.TempPathFactory, receiver: Any
) -> Iterator[tuple[RunningHeadwater, HeadwaterConfig]]:
    path = tmp_path_factory.mktemp("console") / "headwater.yaml"
    broken = write_config(path, "{{ category }}", receiver.url)
    with running_headwater(broken, with_pipeline=False) as first:
        send_events(first.url, [{"n": n, "category": "books"} for n in range(3)])
        send_events(first.url, [{"n": n} for n in range(3, 5)])
    pipeline = Pipeline(broken, spark)
    try:
        pipeline.run_once()
    finally:
        pipeline.stop()
    assert len(FailedStore(broken).events()) == 2
    fixed = write_config(path, "{{ category | default('misc') }}", receiver.url)
    with running_headwater(fixed, with_pipeline=True) as running:
        assert running.console_url is not None
        yield running, fixed


def log_in(page: Page, url: str, path: str = "/") -> None:
    page.goto(f"{url}{path}")
    assert "/login" in page.url
    page.fill("input[name=token]", TOKEN)
    page.click("button:has-text('Log in')")
    page.wait_for_url(f"{url}{path}")


def test_without_the_token_nothing_is_shown_or_done(page: Page, headwater: Any) -> None:
    hw, _ = headwater
    url = hw.console_url
    page.goto(f"{url}/failed")
    assert page.url.startswith(f"{url}/login")
    screenshot(page, "login")
    page.fill("input[name=token]", "not-the-token")
    page.click("button:has-text('Log in')")
    assert page.locator("p.error").inner_text() == "that is not an admin token"
    for path in ("/failed", "/config", "/live/events?topic=x"):
        assert page.request.get(f"{url}{path}").status == 401
    answer = page.request.post(f"{url}/failed/replay", form={"all": "yes"})
    assert answer.status in (401, 403)


def test_a_live_event_arrives_and_is_shown_whole(page: Page, headwater: Any) -> None:
    hw, _ = headwater
    log_in(page, hw.console_url, "/live?topic=events-track")
    page.wait_for_selector("#tail-state:has-text('following')")
    send_events(hw.url, [{"n": 77, "category": "live-check"}])
    row = page.locator("#records tbody tr", has_text="live-check")
    row.wait_for(timeout=DEADLINE_S * 1000)
    assert "web" in row.inner_text() and "segment" in row.inner_text()
    row.click()
    page.wait_for_selector("#record-json:has-text('live-check')")
    headers = page.locator("#record-headers").inner_text()
    assert "source" in headers and "event-id" in headers
    assert page.locator("#record-hex").inner_text().startswith("7b")
    screenshot(page, "live")


def test_failed_events_replayed_from_the_console_land_in_duckdb(page: Page, headwater: Any) -> None:
    hw, config = headwater
    log_in(page, hw.console_url, "/failed")
    table = page.locator("table").first
    assert table.locator("tr", has_text="route").count() == 2
    screenshot(page, "failed")
    page.locator("a:has-text('show')").first.click()
    assert "Failed event" in page.locator("h1").inner_text()
    assert "Bought" in page.locator("pre").inner_text()
    screenshot(page, "failed-event")
    page.goto(f"{hw.console_url}/failed")
    page.check("input[data-check-all]")
    page.click("button:has-text('Replay selected')")
    assert "replayed 2 to warehouse" in page.locator("p.done").inner_text()
    got = wait_until(
        lambda: rows(config, "select n from misc order by n"), "the replayed rows", DEADLINE_S
    )
    assert got == [(3,), (4,)]
    assert rows(config, "select count(*) from books") == [(3,)]

    page.goto(f"{hw.console_url}/destinations")
    page.wait_for_selector("td:has-text('running')")
    screenshot(page, "destinations")
    page.click("a:has-text('warehouse')")
    assert page.locator("summary", has_text="misc").count() == 1
    assert page.locator("td", has_text="eventn_ctx_event_id").count() >= 1
    screenshot(page, "destination")


def test_a_failed_webhook_is_resent_from_the_console(
    page: Page, headwater: Any, receiver: Any
) -> None:
    hw, config = headwater
    doc = {"message_id": "order-1", "receiver": "crm", "payload": {"order": 1}}
    status, answer = post_json(f"{hw.url}/webhooks/shop", doc, AUTH)
    assert status == 202, answer

    def status_of() -> Status | None:
        with open_state(config) as store:
            state = store.get("shop", "order-1")
        return None if state is None else state.status

    wait_until(lambda: status_of() is Status.FAILED, "order-1 FAILED", DEADLINE_S)
    log_in(page, hw.console_url, "/webhooks?status=FAILED")
    page.click("a:has-text('order-1')")
    assert page.locator("#status").inner_text() == "FAILED"
    assert "400" in page.locator("table").first.inner_text()
    screenshot(page, "webhook-message")
    page.click("button:has-text('Resend')")
    assert "resent 1 message(s)" in page.locator("p.done").inner_text()
    wait_until(lambda: status_of() is Status.DONE, "order-1 DONE after the resend", DEADLINE_S)
    assert [json.loads(p.body) for p in receiver.posts("order-1")] == [{"order": 1}] * 2
    page.goto(f"{hw.console_url}/webhooks")
    screenshot(page, "webhooks")


def test_every_page_renders(page: Page, headwater: Any) -> None:
    hw, _ = headwater
    log_in(page, hw.console_url)
    page.wait_for_selector("svg")
    assert page.locator("figure.chart").count() == 5
    screenshot(page, "overview")
    for path, name in (("/transport", "transport"), ("/config", "config")):
        page.goto(f"{hw.console_url}{path}")
        assert page.locator("h1").count() == 1
        screenshot(page, name)
    assert TOKEN not in page.content() and WRITE_KEY not in page.content()
