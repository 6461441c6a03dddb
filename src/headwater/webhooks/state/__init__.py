"""The webhook state store: :class:`StateStore` and its backends (see :mod:`.base`)."""

from headwater.webhooks.state.base import (
    Attempt,
    InvalidTransition,
    MessageState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
)

__all__ = [
    "Attempt",
    "InvalidTransition",
    "MessageState",
    "StateStore",
    "Status",
    "Transition",
    "UnknownMessage",
]
