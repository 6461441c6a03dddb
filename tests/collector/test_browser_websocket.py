"""Raccoon over a browser's WebSocket (Debian's Chromium through Playwright): the handshake a
browser sends, permessage-deflate as Chromium uses it (its messages compressed, with context
taken over from one message to the next), binary and text requests, and a clean close."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import pytest

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.collector import websocket
from headwater.collector.config import CollectorConfig, RaccoonConfig
from headwater.collector.protocols import raccoon
from headwater.testing.collector import running_collector

if TYPE_CHECKING:
    from playwright.sync_api import Page

# A browser cannot set headers on a WebSocket: the connection's own key is its identity here.
CONFIG = CollectorConfig(raccoon=RaccoonConfig(identity_header="Sec-WebSocket-Key"))

SCRIPT = """
async ([url, requests, text]) => {
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  const answers = [];
  ws.onmessage = (m) => answers.push(
    typeof m.data === "string" ? m.data : Array.from(new Uint8Array(m.data)));
  await new Promise((opened, failed) => {
    ws.onopen = opened;
    ws.onerror = () => failed(new Error("the WebSocket failed"));
  });
  for (const r of requests) ws.send(new Uint8Array(r));
  ws.send(text);
  const deadline = Date.now() + 10000;
  while (answers.length < requests.length + 1 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 10));
  }
  const closed = new Promise((r) => { ws.onclose = (e) => r(e.code); });
  ws.close(1000, "done");
  return {extensions: ws.extensions, answers, code: await closed};
}
"""


def request(guid: str, count: int) -> bytes:
    req: Any = raccoon.SendEventRequest(req_guid=guid)
    for i in range(count):  # compressible, as real events are: JSON-ish, repeated field names
        req.events.add(
            type="page",
            event_bytes=b'{"i": %d, "page": "/home", "pad": "%s"}'
            % (i, os.urandom(40).hex().encode()),
        )
    return req.SerializeToString()


def test_a_browser_sends_compressed_binary_and_text_requests(
    bus: EmbeddedBus, page: Page, monkeypatch: pytest.MonkeyPatch
) -> None:
    inflated: list[int] = []
    inflate = websocket.Frames._inflate

    def counted(frames: Any, opcode: int, fin: bool, rsv1: bool, payload: bytes) -> bytes:
        out = inflate(frames, opcode, fin, rsv1, payload)
        inflated.append(len(out) - len(payload) if rsv1 else 0)
        return out

    monkeypatch.setattr(websocket.Frames, "_inflate", counted)
    requests = [request(f"browser-{n}", 100) for n in range(3)]  # ~13 kB each
    text = json.dumps(
        {"req_guid": "browser-text", "events": [{"type": "page", "event_bytes": "dGV4dA=="}]}
    )
    with running_collector(bus, CONFIG) as server:
        out = page.evaluate(SCRIPT, [server.ws_url, [list(r) for r in requests], text])

    assert "permessage-deflate" in out["extensions"]
    assert len([n for n in inflated if n > 0]) == 4  # every message came compressed
    *binary, last = out["answers"]
    guids = []
    for answer in binary:
        response: Any = raccoon.SendEventResponse()
        response.ParseFromString(bytes(answer))
        assert response.status == raccoon.Status.SUCCESS
        guids.append(response.data["req_guid"])
    assert guids == ["browser-0", "browser-1", "browser-2"]
    assert json.loads(last)["data"]["req_guid"] == "browser-text"
    assert out["code"] == 1000
    stored = bus.read("clickstream-page-log", 0, 0, max_records=1000)
    assert len(stored) == 301
    assert stored[0].value == requests_events(requests[0])[0]


def requests_events(data: bytes) -> list[bytes]:
    req: Any = raccoon.SendEventRequest()
    req.ParseFromString(data)
    return [e.event_bytes for e in req.events]
