"""The configuration as the console shows it (``masked``) and as ``headwater config show`` prints
it (``redact``), and connection strings as logs and start-up lines show them (``redact_dsn``):
every secret masked.

A value is a secret when its key says so (password, secret, token, key, hash, authorization,
credentials) or when it is a header value (``headers:`` maps hold API keys); connection
strings and URLs keep their host but lose their password."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from headwater.config.model import HeadwaterConfig

MASK = "***"
_SECRET = re.compile(
    r"password|secret|token|(^|_)keys?($|_)|hash|authorization|credential|signing", re.I
)
_URL = re.compile(r"dsn|url|servers?$", re.I)
# the settings ``headwater config show`` hides (``redact``)
_SECRET_SETTING = re.compile(r"password|secret|token|credential|\.pem$|oauthbearer\.config", re.I)


def masked(config: HeadwaterConfig) -> dict[str, Any]:
    return _walk(config.model_dump(mode="json"), "")


def _walk(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if key == "headers":
            return {k: MASK for k in value}
        return {k: _walk(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, key) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    if _SECRET.search(key):
        return MASK
    if _URL.search(key):
        return redact_dsn(str(value))
    return value


def redact_dsn(dsn: str) -> str:
    """A connection string without its password."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", re.sub(r"password=\S+", "password=***", dsn))


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with secrets (passwords, tokens, keys) replaced by ``***``."""
    if isinstance(value, Mapping):
        return {
            k: "***" if isinstance(k, str) and _SECRET_SETTING.search(k) else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
