"""Errors of the operator commands."""

from __future__ import annotations

from headwater.errors import TerminalError


class OpsError(TerminalError):
    code = "HW-OPS-000"


class BadInput(OpsError):
    """Input given to a command (stdin lines, arguments) is invalid; nothing was done."""

    code = "HW-OPS-001"


class UnknownGroup(OpsError):
    """No committed offsets exist for the named group."""

    code = "HW-OPS-002"
