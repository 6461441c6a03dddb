"""Data contracts: JSON Schema documents per event type that a destination's events must meet."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from headwater.config.base import Section


class ContractConfig(Section):
    schema_: Path | None = Field(
        None, alias="schema", description="A JSON Schema (draft 2020-12) file, beside the config."
    )
    mode: Literal["enforce", "warn", "allow", "reject"] = Field(
        "enforce", description="What a violation does (docs/shaping.md)."
    )
