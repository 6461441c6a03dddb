"""The enrichments a destination runs on its events (``enrichment:``), each configured by name.

Whatever the list's order, they run in this one: ``ip_lookup``, ``user_agent_parse``,
``bot_detect``, ``referrer``, ``campaign``, ``ip_anonymize``, ``pii_pseudonymize``,
``fingerprint``
(``headwater.pipeline.steps.lookup_rules``; docs/shaping.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from headwater.config.base import Section

PAGE_URL = ["/context/page/url", "/url", "/page_url"]  # Segment's analytics.js, Jitsu
REFERRER = ["/context/page/referrer", "/referrer", "/doc_referrer"]
USER_AGENT = "/eventn_ctx/user_agent"  # the context step's, from the collector's header
CLICK_IDS = {
    "gclid": "Google",
    "dclid": "DoubleClick",
    "msclkid": "Microsoft",
    "fbclid": "Facebook",
    "ttclid": "TikTok",
    "li_fat_id": "LinkedIn",
    "twclid": "Twitter",
}
CAMPAIGN = {
    "utm_source": "mkt_source",
    "utm_medium": "mkt_medium",
    "utm_campaign": "mkt_campaign",
    "utm_term": "mkt_term",
    "utm_content": "mkt_content",
}


def _pointer(v: str) -> str:
    if not v.strip("/").strip():
        raise ValueError(f"{v!r} names no field (write a JSON path: /a/b)")
    return v


class LookupRule(Section):
    name: Literal["ip_lookup", "user_agent_parse"] = Field(description="Which lookup to run.")
    src: str = Field(description="JSON path of the input (an IP address or a user agent).")
    dst: str = Field(description="JSON path where the result object goes.")


class BotDetect(Section):
    name: Literal["bot_detect"] = Field(
        description="Mark the events of bots (crawlers, scripts) by their user agent."
    )
    src: str = Field(USER_AGENT, description="JSON path of the user agent.")
    dst: str = Field("/bot", description="JSON path of the result: {is_bot, pattern}.")
    drop_bots: bool = Field(False, description="Discard the events of bots (counted, skipped).")


class Referrer(Section):
    name: Literal["referrer"] = Field(
        description="Split the referrer URL into host, path, medium and source."
    )
    src: list[str] = Field(
        default_factory=lambda: list(REFERRER),
        description="JSON paths of the referrer URL, the first an event has.",
    )
    page: list[str] = Field(
        default_factory=lambda: list(PAGE_URL),
        description="JSON paths of the page URL (a referrer on its host is internal).",
    )
    dst: str = Field("/referrer_parsed", description="JSON path of {host, path, medium, source}.")
    internal_hosts: list[str] = Field(
        default_factory=list, description="More hosts whose referrals are internal."
    )
    extra: dict[Literal["search", "social", "email"], dict[str, str]] = Field(
        default_factory=dict,
        description="More referrer hosts per medium: host -> source name (beside the built-in).",
    )


class Campaign(Section):
    name: Literal["campaign"] = Field(
        description="Read utm_* parameters and click ids from the page URL."
    )
    src: list[str] = Field(
        default_factory=lambda: list(PAGE_URL),
        description="JSON paths of the page URL, the first an event has.",
    )
    mapping: dict[str, str] = Field(
        default_factory=lambda: dict(CAMPAIGN),
        description="Query parameter -> field it sets (the utm_* parameters by default).",
    )
    click_ids: dict[str, str] = Field(
        default_factory=lambda: dict(CLICK_IDS),
        description="Click-id parameter -> network: mkt_clickid and mkt_network.",
    )


class IpAnonymize(Section):
    name: Literal["ip_anonymize"] = Field(description="Zero the last parts of the IP address.")
    field: str = Field("/source_ip", description="JSON path of the IP address.")
    octets: int = Field(1, ge=1, le=4, description="IPv4: how many last octets become 0.")
    segments: int = Field(4, ge=1, le=8, description="IPv6: how many last segments become 0.")

    _field = field_validator("field")(_pointer)


class PiiPseudonymize(Section):
    name: Literal["pii_pseudonymize"] = Field(
        description="Replace fields by their keyed hash (HMAC-SHA256)."
    )
    fields: list[str] = Field(
        min_length=1,
        description="JSON paths replaced by HMAC-SHA256 (hex); * stands for every array item: "
        "/items/*/email.",
    )
    key_env: str = Field(
        "HW_PII_KEY", min_length=1, description="The environment variable holding the HMAC key."
    )

    @field_validator("fields")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_pointer(p) for p in v]


class Fingerprint(Section):
    name: Literal["fingerprint"] = Field(
        description="Drop events whose chosen fields were seen within a window."
    )
    fields: list[str] = Field(
        min_length=1, description="JSON paths hashed together (with what is below them)."
    )
    window_s: float = Field(
        86_400.0, gt=0, description="An event whose fingerprint was seen this recently is dropped."
    )
    store: Path | None = Field(
        None,
        description="The folder of fingerprints seen (default: <checkpoints>/<destination>"
        ".fingerprints); on a Spark cluster, on storage every executor reaches.",
    )

    @field_validator("fields")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_pointer(p) for p in v]


EnrichmentRule = Annotated[
    LookupRule | BotDetect | Referrer | Campaign | IpAnonymize | PiiPseudonymize | Fingerprint,
    Field(discriminator="name"),
]
