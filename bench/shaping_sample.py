"""The shaping the pipeline benchmark's ``shaped`` case gives its destination: a Python function
(imported by Spark's workers from this folder), an SQL function, a filter, a data contract on
every event type (enforce), and all six enrichments (the fingerprint over messageId, unique, so
no event is dropped and the count stays exact)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["messageId", "event", "userId", "timestamp", "context", "properties"],
    "properties": {
        "messageId": {"type": "string"},
        "event": {"type": "string"},
        "userId": {"type": "string", "pattern": "^u-"},
        "timestamp": {"type": "string"},
        "context": {
            "type": "object",
            "required": ["ip", "page"],
            "properties": {
                "ip": {"type": "string"},
                "page": {"type": "object", "required": ["url"]},
            },
        },
        "properties": {
            "type": "object",
            "required": ["price", "quantity", "sku"],
            "properties": {
                "price": {"type": ["number", "string"]},
                "quantity": {"type": "integer", "minimum": 1},
                "sku": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def enrich(event: dict[str, Any]) -> dict[str, Any]:
    """The Python function: a key for the event's name."""
    event["event_key"] = str(event.get("event", "")).lower().replace(" ", "_")
    return event


KEY_ENV = "HW_PII_KEY"


def prepare_environment() -> None:
    """The pseudonymization key, in the environment before Spark starts (its workers inherit
    the JVM's environment)."""
    os.environ.setdefault(KEY_ENV, "bench-pii-key")


def destination(folder: Path, path: Path, event_types: list[str]) -> dict[str, Any]:
    """A DuckDB destination at ``path`` with every kind of shaping (the contract's file is
    written into ``folder``)."""
    schema = folder / "contracts" / "clickstream" / "1-0-0.json"
    schema.parent.mkdir(parents=True, exist_ok=True)
    schema.write_text(json.dumps(SCHEMA))
    contracts = {t: {"schema": str(schema), "mode": "enforce"} for t in event_types}
    return {
        "id": "shaped",
        "type": "duckdb",
        "path": str(path),
        "functions": [
            {"name": "python", "function": "shaping_sample:enrich"},
            {
                "name": "sql",
                "field": "/revenue",
                "expression": "properties.price * properties.quantity",
            },
            {"name": "filter", "expression": "event IS NOT NULL"},  # keeps all: counts stay exact
        ],
        "contracts": {**contracts, "*": {"mode": "reject"}},
        "enrichment": [
            {"name": "pii_pseudonymize", "fields": ["/userId", "/context/ip"], "key_env": KEY_ENV},
            {"name": "ip_anonymize", "octets": 1},
            {"name": "bot_detect", "drop_bots": False},
            {"name": "campaign"},
            {"name": "referrer"},
            {"name": "fingerprint", "fields": ["/messageId"], "window_s": 86_400},
        ],
    }
