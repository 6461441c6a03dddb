"""The webhook state store: :class:`StateStore` and its backends (see :mod:`.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.webhooks.state.base import (
    Attempt,
    InvalidTransition,
    MessageState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
)

if TYPE_CHECKING:
    from headwater.config.model import HeadwaterConfig


def open_state(config: HeadwaterConfig) -> StateStore:
    """The configured state: the embedded SQLite file, or Redis."""
    state = config.webhooks.state
    if state.backend == "redis":
        from headwater.webhooks.state.redis import RedisState

        assert state.redis_url is not None  # the config requires it
        return RedisState(state.redis_url, prefix=state.redis_prefix)
    from headwater.webhooks.state.sqlite import SqliteState

    return SqliteState(config.webhooks_state_path())


__all__ = [
    "Attempt",
    "InvalidTransition",
    "MessageState",
    "StateStore",
    "Status",
    "Transition",
    "UnknownMessage",
    "open_state",
]
