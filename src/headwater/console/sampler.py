"""Takes the overview's points every ``console.sample_interval_s`` (see ``series``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import aiohttp
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families

from headwater.console import data
from headwater.console.app import Console

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
PROTOCOL_COUNTER = "headwater_collector_events_received"
SOURCE_COUNTER = "headwater_collector_source_events"


def intake_points(families: Iterable[Metric]) -> dict[str, float]:
    """``protocol:<name>`` and ``source:<name>`` totals from the collector's counters."""
    out: dict[str, float] = {}
    for family in families:
        if family.name not in (PROTOCOL_COUNTER, SOURCE_COUNTER):
            continue
        kind = "protocol" if family.name == PROTOCOL_COUNTER else "source"
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = f"{kind}:{sample.labels.get(kind, '')}"
            out[name] = out.get(name, 0.0) + sample.value
    return out


async def _intake(console: Console, session: aiohttp.ClientSession) -> dict[str, float]:
    if console.metrics is not None:
        return intake_points(console.metrics.registry.collect())
    cfg = console.config
    scheme = "https" if cfg.collector.tls is not None else "http"
    base = cfg.console.collector_url or f"{scheme}://{cfg.collector.host}:{cfg.collector.port}"
    try:
        async with session.get(f"{base.rstrip('/')}/metrics") as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}  # no collector there right now: no intake points
    return intake_points(text_string_to_metric_families(text))


def _log_points(console: Console) -> dict[str, float]:
    out: dict[str, float] = {}
    for topic in data.log_topics(console.config, console.bus):
        out[f"topic:{topic.name}"] = topic.appended
    for lag in data.writer_lags(console.config, console.bus):
        out[f"lag:{lag.group}"] = lag.lag
    out["failed"] = console.failed.count()  # keeps the index caught up in the background
    return out


async def sample_once(console: Console, session: aiohttp.ClientSession) -> None:
    points = await _intake(console, session)
    points.update(await console.run(_log_points, console))
    console.series.add(points)


async def run_sampler(console: Console, stop: asyncio.Event) -> None:
    """Sample until ``stop``; a failed sample is logged and the next one taken on time."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            try:
                await sample_once(console, session)
            except Exception as e:
                log.warning("console: a sample of the overview failed: %r", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), console.config.console.sample_interval_s)
