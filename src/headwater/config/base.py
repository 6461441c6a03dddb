"""The base of every config model: unknown keys are errors, every field is described."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict

_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class Section(BaseModel):
    """A section of ``headwater.yaml``. Unknown keys are rejected so typos are named."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _identifier(v: str) -> str:
    if not _ID.match(v):
        raise ValueError("must be 1-63 of a-z, 0-9, _ and -, starting with a letter or digit")
    return v


# The id of a destination or a reader: it names files, checkpoints and topics.
Identifier = Annotated[str, AfterValidator(_identifier)]


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


def require_unique_ids(items: Iterable[_HasId], twice: str) -> None:
    """A ValueError for the first id that appears twice among ``items``: ``twice`` says so, with
    ``{!r}`` where the id goes."""
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ValueError(twice.format(item.id))
        seen.add(item.id)
