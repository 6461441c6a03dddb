"""A console served from a thread of the test process, on a real embedded log, failed store
and webhook state under ``tmp_path``, and a ``requests`` session logged in to it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from headwater.bus import open_bus
from headwater.collector.auth import hash_key
from headwater.config.model import HeadwaterConfig
from headwater.console.app import Console
from headwater.console.site import make_app
from headwater.testing.webhooks import serving_app
from headwater.webhooks.state import open_state

TOKEN = "admin-token-for-tests"
SECRET = "whsec_" + base64.b64encode(b"console-test-signing-secret-32by").decode()


def console_config(tmp_path: Path, **extra: Any) -> HeadwaterConfig:
    return HeadwaterConfig.model_validate(
        {
            "data_dir": str(tmp_path / "data"),
            "bus": {"embedded": {"durability": "never"}},
            "console": {"admin_token_hashes": [hash_key(TOKEN)], "page_size": 5},
            "pipeline": {
                "destinations": [
                    {"id": "warehouse", "type": "duckdb"},
                    {
                        "id": "api",
                        "type": "http",
                        "options": {
                            "url": "http://127.0.0.1:9/batch",
                            "headers": {"Authorization": "Bearer sekrit-api-key"},
                        },
                    },
                ]
            },
            "webhooks": {
                "sources": [{"id": "shop", "write_keys": [hash_key("shop-key")]}],
                "receivers": [{"name": "crm", "url": "http://127.0.0.1:9/hook", "secret": SECRET}],
            },
            **extra,
        }
    )


@dataclass
class Served:
    url: str
    config: HeadwaterConfig
    console: Console

    def client(self, *, login: bool = True) -> requests.Session:
        session = requests.Session()
        session.headers["Origin"] = self.url
        if login:
            answer = session.post(f"{self.url}/login", data={"token": TOKEN}, allow_redirects=False)
            assert answer.status_code == 303, answer.text
        return session

    def csrf(self, session: requests.Session, path: str = "/") -> str:
        page = session.get(f"{self.url}{path}", headers={"Accept": "text/html"}).text
        start = page.index('name="csrf" value="') + len('name="csrf" value="')
        return page[start : page.index('"', start)]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    config = console_config(tmp_path)
    config.data_dir.mkdir(parents=True)
    bus = open_bus(config)
    store = open_state(config)
    console = Console(config, bus, webhook_state=store)
    try:
        with serving_app(make_app(console), "console") as port:
            yield Served(f"http://127.0.0.1:{port}", config, console)
    finally:
        store.close()
        bus.close()
