"""``webhooks`` in headwater.yaml: receivers and sources validated with errors that name what is
wrong; Svix's retry schedule by default; the state's backend."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from pydantic import ValidationError

from headwater.config.model import HeadwaterConfig
from headwater.webhooks.config import SVIX_RETRY_SCHEDULE_S, WebhooksConfig

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
KEY = "sha256:" + "ab" * 32


def receiver(**over: Any) -> dict[str, Any]:
    return {"name": "ci", "url": "https://ci.example/hooks", "secret": SECRET, **over}


def test_a_receiver_and_a_source_with_defaults() -> None:
    config = HeadwaterConfig.model_validate(
        {
            "webhooks": {
                "receivers": [receiver(rate_limit={"requests": 50})],
                "sources": [{"id": "github", "write_keys": [KEY]}],
            }
        }
    )
    ci = config.webhooks.receiver("ci")
    assert ci is not None and ci.secret == [SECRET]  # one secret given as a string
    assert ci.retry_schedule_s == list(SVIX_RETRY_SCHEDULE_S) and ci.timeout_s == 15.0
    assert ci.rate_limit is not None and ci.rate_limit.per_s == 1.0
    assert not ci.ordered and ci.status_url is None
    assert config.webhooks.source("github") is not None
    assert config.webhooks.receiver("other") is None
    assert config.webhooks.state.backend == "embedded"


@pytest.mark.parametrize(
    ("webhooks", "message"),
    [
        ({"receivers": [receiver(url="ftp://x")]}, "http"),
        ({"receivers": [receiver(secret="s3cret")]}, "whsec_"),
        ({"receivers": [receiver(status_url="https://ci.example/status")]}, "{message_id}"),
        ({"receivers": [receiver(name="a/b")]}, "pattern"),
        ({"receivers": [receiver(), receiver()]}, "unique: ci"),
        ({"receivers": [receiver(retry_schedule_s=[5, -1])]}, "negative"),
        ({"sources": [{"id": "gh", "write_keys": ["plain-key"]}]}, "hashed"),
        ({"sources": [{"id": "gh", "callback_url": "https://gh.example/cb"}]}, "needs a secret"),
        ({"state": {"backend": "redis"}}, "redis_url"),
        ({"receivers": [receiver(colour="red")]}, "colour"),
    ],
)
def test_bad_settings_are_named(webhooks: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        WebhooksConfig.model_validate(webhooks)
    assert message in str(caught.value)
