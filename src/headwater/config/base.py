"""The base of every config model: unknown keys are errors, every field is described."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of ``headwater.yaml``. Unknown keys are rejected so typos are named."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
