"""The webhook intake on the collector:

- ``POST /webhooks/{source_id}`` with ``{"message_id": "...", "receiver": "name", "payload":
  {...}}`` (the message id may come in a ``webhook-id`` header instead): ``202`` with the
  message's status URL once the message is durably on ``webhooks.from_sender``; a message the
  state already knows (the same ``(source_id, message_id)``) answers ``200`` with its status and
  is not appended again. Two collectors that take the same message at the same moment both
  append it: the FromSender step records it once and delivers it once.
- ``GET /webhooks/{source_id}/messages/{message_id}``: the status, the history and every
  attempt (404 until the FromSender step has recorded the message, a moment after its 202).

A source's write keys (``webhooks.sources[].write_keys``, as for the other JSON APIs: Basic
auth, Bearer, ``X-Write-Key``) guard both; a source without keys is open. Errors name what was
wrong and store nothing: an unknown source (404), a missing or wrong key (401), bad JSON or a
missing field (400), a receiver that is not configured (422), a payload over
``webhooks.max_payload_bytes`` (413).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from headwater.collector.auth import WriteKeys, key_from_headers
from headwater.collector.errors import Rejected, bad_request, too_large, unauthorized
from headwater.collector.publisher import Publisher
from headwater.webhooks.config import WebhooksConfig
from headwater.webhooks.routing import Topics, WebhookMessage
from headwater.webhooks.state.base import LoopState, MessageState, StateStore

PREFIX = "/webhooks/"
MAX_MESSAGE_ID = 256
JSON = "application/json"


class WebhookIntake:
    def __init__(self, config: WebhooksConfig, store: StateStore, publisher: Publisher) -> None:
        self.config = config
        self.store = store
        self.publisher = publisher
        self.topic = Topics(config.topic_prefix).from_sender
        self._keys = {s.id: WriteKeys([s]) for s in config.sources if s.write_keys}  # type: ignore[list-item]
        self._state: LoopState | None = None

    async def close(self) -> None:
        """Let go of the state's connections made for the loop (not of the store)."""
        if self._state is not None:
            await self._state.close()

    def route(self, method: str, path: str) -> tuple[str, str, str | None] | None:
        """(method, source id, message id) of a webhook path, None when it is not one."""
        if not path.startswith(PREFIX):
            return None
        parts = path[len(PREFIX) :].strip("/").split("/")
        if method == "POST" and len(parts) == 1 and parts[0]:
            return ("POST", parts[0], None)
        if method == "GET" and len(parts) == 3 and parts[1] == "messages" and parts[0]:
            return ("GET", parts[0], parts[2])
        return None

    def authorize(
        self, source_id: str, headers: Mapping[str, str], query: Mapping[str, str]
    ) -> None:
        if self.config.source(source_id) is None:
            configured = ", ".join(s.id for s in self.config.sources) or "none"
            raise Rejected(
                f"no webhook source {source_id!r} (webhooks.sources: {configured})",
                status=404,
                kind="unknown_source",
            )
        keys = self._keys.get(source_id)
        if keys is not None and keys.source_for(key_from_headers(headers, query)) != source_id:
            raise unauthorized(f"the write key is not one of source {source_id!r}")

    async def post(
        self, source_id: str, body: bytes, headers: Mapping[str, str], base_url: str
    ) -> tuple[int, dict[str, Any]]:
        """Take one message; (status, JSON answer). Raises ``Rejected`` for bad input."""
        message = self.parse(source_id, body, headers)
        url = status_url(base_url, source_id, message.message_id)
        if self._state is None:  # made on the loop that serves the requests
            self._state = self.store.on_loop()
        known = await self._state.lookup(source_id, message.message_id)
        if known is not None:
            return 200, {**summary(known), "status_url": url, "duplicate": True}
        await self.publisher.store({self.topic: [message.to_message()]})
        return 202, {
            "source_id": source_id,
            "message_id": message.message_id,
            "receiver": message.receiver,
            "status": "ACCEPTED",
            "status_url": url,
        }

    def parse(self, source_id: str, body: bytes, headers: Mapping[str, str]) -> WebhookMessage:
        limit = self.config.max_payload_bytes
        if len(body) > limit:
            raise too_large(
                f"the message is {len(body)} bytes; the limit is {limit} "
                "(webhooks.max_payload_bytes)"
            )
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            try:  # what orjson refuses but JSON allows (integers past 64 bits), or the error
                doc = json.loads(body)
            except ValueError as e:
                raise bad_request(f"the body is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise bad_request("the body must be a JSON object with receiver and payload")
        message_id = doc.get("message_id") or headers.get("webhook-id")
        if not isinstance(message_id, str) or not message_id.strip():
            raise bad_request("message_id is required (in the body or a webhook-id header)")
        if len(message_id) > MAX_MESSAGE_ID or "/" in message_id:
            raise bad_request(
                f"message_id must be at most {MAX_MESSAGE_ID} characters, without '/'"
            )
        receiver = doc.get("receiver")
        if not isinstance(receiver, str) or not receiver:
            raise bad_request("receiver is required: the name of a configured receiver")
        if self.config.receiver(receiver) is None:
            configured = ", ".join(r.name for r in self.config.receivers) or "none"
            raise Rejected(
                f"no receiver named {receiver!r} (webhooks.receivers: {configured})",
                status=422,
                kind="unknown_receiver",
            )
        if "payload" not in doc:
            raise bad_request("payload is required: the JSON the receiver gets")
        try:
            payload = orjson.dumps(doc["payload"])
        except TypeError:  # an integer past 64 bits
            payload = json.dumps(doc["payload"], separators=(",", ":"), ensure_ascii=False).encode()
        return WebhookMessage(source_id, message_id, receiver, payload)

    def status(self, source_id: str, message_id: str) -> tuple[int, dict[str, Any]]:
        state = self.store.get(source_id, message_id)
        if state is None:
            return 404, {
                "error": f"no webhook message {message_id!r} from source {source_id!r} "
                "(a message just accepted is recorded a moment after its 202)"
            }
        return 200, state.to_json()


def summary(state: MessageState) -> dict[str, Any]:
    return {
        "source_id": state.source_id,
        "message_id": state.message_id,
        "receiver": state.receiver,
        "status": state.status.value,
        "reason": state.reason,
    }


def status_url(base_url: str, source_id: str, message_id: str) -> str:
    return f"{base_url}{PREFIX}{source_id}/messages/{message_id}"


def to_body(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)
