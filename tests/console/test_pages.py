"""The console's pages and actions on real data: the failed store (paged, filtered, replayed),
the webhook state (listed, resent, receivers disabled), the live tail over server-sent events,
the overview with its charts."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import aiohttp
import requests
from tests.console.conftest import Served

from headwater.bus import Message
from headwater.bus import context as ctx
from headwater.console.sampler import sample_once
from headwater.pipeline.failed import FailedEvent, FailedStore, make_id, replay_topic
from headwater.webhooks.state.base import Status

HTML = {"Accept": "text/html"}
DEADLINE_S = 15.0


def failed_event(n: int, code: str = "HW-PIPE-101") -> FailedEvent:
    return FailedEvent(
        id=make_id("warehouse", "events-track", 0, n),
        destination="warehouse",
        step="decode" if code == "HW-PIPE-101" else "route",
        code=code,
        reason=f"event {n} is bad <b>really</b>",
        topic="events-track",
        partition=0,
        offset=n,
        failed_at=f"2026-11-26T10:{n:02d}:00.000Z",
        key=None,
        value=json.dumps({"n": n}).encode(),
        headers=((ctx.TYPE, b"track"), (ctx.EVENT_ID, f"ev-{n}".encode())),
    )


def get(served: Served, client: requests.Session, path: str) -> str:
    answer = client.get(f"{served.url}{path}", headers=HTML)
    assert answer.status_code == 200, answer.text
    return answer.text


def test_failed_events_are_paged_filtered_shown_and_replayed(served: Served) -> None:
    store = FailedStore(served.config)
    store.append([failed_event(n, "HW-PIPE-101" if n % 4 else "HW-PIPE-301") for n in range(12)])
    client = served.client()

    first = get(served, client, "/failed")
    assert "12 failed events; 12 match the filters" in first
    shown = [
        n for n in range(12) if f"events-track:0:{n}&#34;" in first or f">event {n} is" in first
    ]
    assert shown == [7, 8, 9, 10, 11]  # newest first, a page of 5
    assert "<b>really</b>" not in first and "&lt;b&gt;really&lt;/b&gt;" in first  # escaped
    older = first[first.index('rel="next" href="') + 17 :].split('"')[0].replace("&amp;", "&")
    second = get(served, client, older)
    assert [n for n in range(12) if f">event {n} is" in second] == [2, 3, 4, 5, 6]

    only = get(served, client, "/failed?code=HW-PIPE-301")
    assert [n for n in range(12) if f">event {n} is" in only] == [0, 4, 8]
    assert "3 match the filters" in only
    since = get(served, client, "/failed?since=2026-11-26T10:10:00Z")
    assert [n for n in range(12) if f">event {n} is" in since] == [10, 11]
    bad = client.get(f"{served.url}/failed?since=yesterday", headers=HTML)
    assert bad.status_code == 400 and "since" in bad.text

    one = get(served, client, "/failed/event?id=warehouse:events-track:0:3")
    assert "ev-3" in one and "&#34;n&#34;: 3" in one

    csrf = served.csrf(client, "/failed")
    picked = ["warehouse:events-track:0:3", "warehouse:events-track:0:5"]
    answer = client.post(
        f"{served.url}/failed/replay", data={"csrf": csrf, "id": picked}, allow_redirects=False
    )
    assert answer.status_code == 303 and "replayed+2+to+warehouse" in answer.headers["Location"]
    replayed = [json.loads(r.value)["n"] for r in store.records(replay_topic("warehouse"))]
    assert replayed == [3, 5]
    every = client.post(
        f"{served.url}/failed/replay",
        data={"csrf": csrf, "all": "yes", "destination": "warehouse", "since": "2026-11-26T10:09"},
        allow_redirects=False,
    )
    assert "replayed+3+to+warehouse" in every.headers["Location"]
    unknown = client.post(
        f"{served.url}/failed/replay", data={"csrf": csrf, "id": "nope"}, allow_redirects=False
    )
    assert unknown.status_code == 400 and "nope" in unknown.text


def test_webhook_messages_are_listed_resent_and_receivers_disabled(served: Served) -> None:
    store = served.console.webhook_state
    assert store is not None
    now = time.time()
    for n in range(8):
        store.arrive("shop", f"m{n}", "crm", json.dumps({"order": n}).encode(), now + n)
    for n in (1, 4, 6):
        store.advance("shop", f"m{n}", Status.FAILED, now + 10 + n, reason=f"crm said 400 ({n})")
    client = served.client()

    page = get(served, client, "/webhooks?status=FAILED")
    assert [n for n in range(8) if f">m{n}</a>" in page] == [1, 4, 6]
    assert "crm said 400 (6)" in page
    all_of_them = get(served, client, "/webhooks")
    assert [n for n in range(8) if f">m{n}</a>" in all_of_them] == [1, 4, 5, 6, 7]  # newest 5

    detail = get(served, client, "/webhooks/message?source=shop&id=m4")
    assert "FAILED" in detail and "&#34;order&#34;: 4" in detail
    csrf = served.csrf(client, "/webhooks")
    answer = client.post(
        f"{served.url}/webhooks/resend",
        data={"csrf": csrf, "key": ["shop/m4"], "back": "/webhooks/message?source=shop&id=m4"},
        allow_redirects=False,
    )
    assert answer.status_code == 303
    assert answer.headers["Location"].startswith("/webhooks/message?source=shop&id=m4&done=")
    state = store.get("shop", "m4")
    assert state is not None and state.status is not Status.FAILED
    again = client.post(
        f"{served.url}/webhooks/resend",
        data={"csrf": csrf, "key": "shop/m4"},
        allow_redirects=False,
    )
    assert again.status_code == 409 and "only a FAILED message" in again.text

    client.post(
        f"{served.url}/webhooks/receivers", data={"csrf": csrf, "name": "crm", "action": "disable"}
    )
    assert store.receivers()["crm"].disabled
    assert "disabled: disabled from the console" in get(served, client, "/webhooks")
    client.post(
        f"{served.url}/webhooks/receivers", data={"csrf": csrf, "name": "crm", "action": "enable"}
    )
    assert not store.receivers()["crm"].disabled


def _event(n: int, kind: str) -> Message:
    return Message(
        json.dumps({"n": n, "kind": kind}).encode(),
        headers=((ctx.TYPE, kind.encode()), (ctx.SOURCE, b"web"), (ctx.PROTOCOL, b"segment")),
    )


def test_the_live_tail_streams_new_records_that_match(served: Served) -> None:
    bus = served.console.bus
    bus.create_topic("events", 1)
    bus.append("events", [_event(0, "page")]).result()
    client = served.client()
    url = f"{served.url}/live/events?topic=events&type=track&q=needle"
    with client.get(url, stream=True, timeout=DEADLINE_S) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        bus.append("events", [_event(1, "track"), _event(2, "page")]).result()
        bus.append(
            "events",
            [Message(b'{"kind": "track", "x": "needle"}', headers=((ctx.TYPE, b"track"),))],
        ).result()
        got = _first_record(stream)
    assert got["offset"] == 3 and got["type"] == "track" and "needle" in got["preview"]
    record = client.get(f"{served.url}/live/record?topic=events&partition=0&offset=1").json()
    assert json.loads(record["json"]) == {"n": 1, "kind": "track"}
    assert {"name": "source", "value": "web", "value_encoding": "utf8"} in record["headers"]
    assert record["hex"].startswith("7b 22 6e")
    missing = client.get(f"{served.url}/live/events?topic=nope")
    assert missing.status_code == 404


def _first_record(stream: requests.Response) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE_S
    event = None
    for line in stream.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event == "record":
            return json.loads(line[6:])
        assert time.monotonic() < deadline, "no record came"
    raise AssertionError("the stream ended")


def test_the_overview_shows_the_log_writers_and_charts(served: Served) -> None:
    bus = served.console.bus
    bus.create_topic("events", 2)
    bus.append("events", [_event(n, "track") for n in range(30)]).result()
    bus.commit("warehouse", {("events", 0): 2})

    async def two_samples() -> None:
        async with aiohttp.ClientSession() as session:
            await sample_once(served.console, session)
            bus.append("events", [_event(n, "track") for n in range(10)]).result()
            await sample_once(served.console, session)

    # in a thread of its own: Playwright's driver may hold this thread's event loop
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, two_samples()).result(DEADLINE_S)
    client = served.client()
    page = get(served, client, "/")
    assert ">events</a>" in page and ">40<" in page  # records held
    assert "warehouse" in page
    assert page.count("<svg") == 5 and "Appended to the log" in page
    assert "<polyline" in page  # the topic's rate between the two samples


def test_failed_events_filter_by_contract_and_show_each_violation(served: Served) -> None:
    broke = (
        'contract signup/1-0-0: /properties/plan: "gold" is not one of ["pro"] (enum); '
        "/properties/seats: 0 is less than the minimum of 1 (minimum)"
    )
    events = [
        replace(failed_event(n), step="contract", code="HW-PIPE-501", reason=broke)
        for n in (20, 21)
    ]
    FailedStore(served.config).append([*events, failed_event(22)])
    client = served.client()
    page = get(served, client, "/failed?contract=signup/1-0-0")
    assert "2 match the filters" in page
    one = get(served, client, "/failed/event?id=warehouse:events-track:0:20")
    assert "Contract violations" in one
    assert "<li><code>/properties/plan: &#34;gold&#34; is not one of" in one
    assert "<li><code>/properties/seats: 0 is less than the minimum of 1 (minimum)</code>" in one
