"""The enrichments a destination runs on its events (``enrichment:``), each configured by name."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from headwater.config.base import Section


class EnrichmentRule(Section):
    name: Literal["ip_lookup", "user_agent_parse"] = Field(description="Which lookup to run.")
    src: str = Field(description="JSON path of the input (an IP address or a user agent).")
    dst: str = Field(description="JSON path where the result object goes.")
