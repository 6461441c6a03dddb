"""Enrichments through Spark: a destination that pseudonymizes an email, reads a campaign from
the page URL, drops bots and drops repeated orders lands what it should, with the key reaching
Spark's Python workers by their environment and fingerprints remembered from one run to the
next."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline.test_replay import append_events, rows, run_pipeline, write_config

KEY_ENV = "HW_TEST_PII_KEY"
KEY = "spark-test-key"
BROWSER = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/124.0"
BOT = "Mozilla/5.0 (compatible; Googlebot/2.1; +http://www.google.com/bot.html)"
ENRICHMENT = [  # not in the order they run in
    {"name": "fingerprint", "fields": ["/order_id"]},
    {"name": "pii_pseudonymize", "fields": ["/email"], "key_env": KEY_ENV},
    {"name": "campaign", "src": ["/url"]},
    {"name": "bot_detect", "src": "/ua", "drop_bots": True},
]


@pytest.fixture
def pii_key(spark: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The key in the driver's environment (checked when the batch is planned) and in the
    environment Spark gives its Python workers (the session's JVM started before this test)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    environment = spark.sparkContext.environment
    environment[KEY_ENV] = KEY
    yield
    environment.pop(KEY_ENV, None)


def event(n: int, order_id: int, agent: str = BROWSER) -> dict[str, Any]:
    url = f"https://shop.example/p/{n}?utm_source=news%20letter&gclid=g{n}"
    return {"n": n, "order_id": order_id, "email": f"u{n}@example.com", "ua": agent, "url": url}


def hashed(value: str) -> str:
    return hmac.new(KEY.encode(), value.encode(), hashlib.sha256).hexdigest()


def test_enrichments_shape_what_lands_and_drop_bots_and_repeats_across_runs(
    spark: Any, tmp_path: Path, pii_key: None
) -> None:
    config = write_config(tmp_path / "headwater.yaml", "events", enrichment=ENRICHMENT)
    append_events(config, [event(1, 1), event(2, 2, BOT), event(3, 3), event(4, 4)])

    first = run_pipeline(spark, config).queries[0].writer
    assert first.last is not None and first.last.skipped == 1  # the bot
    query = "select n, email, mkt_source, mkt_clickid, mkt_network, bot_is_bot from events"
    got = rows(config, query + " order by n")
    assert got == [
        (n, hashed(f"u{n}@example.com"), "news letter", f"g{n}", "Google", False) for n in (1, 3, 4)
    ]

    # a later run (a new worker, a new connection to the store): order 1 again is a repeat
    append_events(config, [event(5, 1), event(6, 6)])
    second = run_pipeline(spark, config).queries[0].writer
    assert second.last is not None and second.last.skipped == 1
    assert rows(config, "select n from events order by n") == [(1,), (3,), (4,), (6,)]
    assert len(list((tmp_path / "data").rglob("warehouse.fingerprints"))) == 1
